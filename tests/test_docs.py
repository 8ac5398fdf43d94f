"""The docs site (mkdocs.yml, docs/) builds with every warning an error, and a broken link or a nav entry without
its page fails it; every repository path and olmax module that the README and the docs name exists; the picture
of a run's page (docs/images/run-page.svg, written by docs/run_page_svg.py) is a self-contained SVG of a page's
charts."""

import ast
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml
from testlib import ROOT, docs

from olmax.cli import main

sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "docs")]
from run_page import write_run  # noqa: E402 - the benchmark's run directory, small
from run_page_svg import page_svg  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


def nav_pages(nav: list) -> list[str]:
    return [page for entry in nav for value in entry.values()
            for page in (nav_pages(value) if isinstance(value, list) else [value])]


def test_the_site_builds_with_every_page_in_its_nav(tmp_path):
    built = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    pages = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        assert (tmp_path / "site" / ("" if page == "index.md" else page.removesuffix(".md")) / "index.html").exists()


def test_a_broken_link_or_a_nav_entry_without_its_page_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs", symlinks=True)
    shutil.copy(ROOT / "BENCHMARKS.md", tmp_path)
    with open(tmp_path / "docs" / "data.md", "a") as f:
        f.write("\nSee [the shards](shard-format.md) and [the order](training.md#no-such-section).\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["nav"].append({"Recipes": "recipes.md"})
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    built = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "shard-format.md" in built.stderr and "no-such-section" in built.stderr and "recipes.md" in built.stderr


def _defines(module: Path, name: str) -> bool:
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return True
    return False


def _module_exists(dotted: str) -> bool:
    """olmax.a.b names a module or package of src/olmax, or a name defined at the top of one (olmax.a.b.fn)."""
    path, parts = ROOT / "src", dotted.split(".")
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
            return len(parts) == i + 1 or (len(parts) == i + 2 and _defines(path, parts[i + 1]))
        else:
            return i == len(parts) - 1 and _defines(path / "__init__.py", part)
    return True


def test_every_path_and_module_the_docs_name_exists():
    """A path under src/, tests/, benchmarks/ or docs/ must be there; a backticked `name.py` (or `pkg/name.py`)
    must be some file of the repository; a `configs/x.yaml` or `train/x.py` relative to src/olmax must be there;
    an `olmax.x.y` module must be one. Paths a run writes (`runs/NAME/...`, `RUN/...`) are not the repository's."""
    text = re.sub(r"\[([^\]]*)\]\(https?://[^)]*\)", "", docs())  # an outside link's text names its own repository
    files = [p.relative_to(ROOT).as_posix() for top in ("src", "tests", "benchmarks", "docs")
             for p in (ROOT / top).rglob("*") if "__pycache__" not in p.parts]
    missing = []
    for path in set(re.findall(r"(?<![\w/.~-])((?:src|tests|benchmarks|docs)/[\w./-]*\w/?)", text)):
        if not (ROOT / path).exists():
            missing.append(path)
    for path in set(re.findall(r"`([\w./-]+\.(?:py|yaml|txtpb))`", text)):
        first = path.split("/")[0]
        if path.endswith(".py") and not path.startswith(("src/", "tests/", "benchmarks/", "docs/")):
            if not any(f == path or f.endswith("/" + path) for f in files):
                missing.append(path)
        elif "/" in path and (ROOT / "src" / "olmax" / first).is_dir() and not (ROOT / "src" / "olmax" / path).exists():
            missing.append(path)
    for module in set(re.findall(r"\bolmax(?:\.[A-Za-z_]\w*)+", text)):
        if not _module_exists(module):
            missing.append(module)
    for link in set(re.findall(r"\]\(((?:docs/|BENCHMARKS)[^)#]*)", (ROOT / "README.md").read_text())):
        if not (ROOT / link).exists():
            missing.append(link)
    assert not missing, f"the docs name what the repository does not have: {sorted(missing)}"


def _charts(svg: ET.Element) -> list[ET.Element]:
    return [e for e in svg.iter(f"{SVG}svg") if e.get("class") == "chart"]


def test_the_run_page_picture_is_a_pages_charts_in_one_svg(tmp_path):
    """The committed picture: one self-contained SVG (nothing fetched, no script) with the 8 training charts of a
    resumed run, its restart marked on each, shown by the README and docs/metrics.md; and what the script makes
    of a page: every chart of it, marks and all."""
    committed = ET.parse(ROOT / "docs" / "images" / "run-page.svg").getroot()
    assert not [e.tag for e in committed.iter() if e.tag in (f"{SVG}script", f"{SVG}image", f"{SVG}foreignObject")]
    assert not [v for e in committed.iter() for k, v in e.attrib.items() if k.endswith("href")]
    training = [c for c in _charts(committed) if c.get("data-metric") in ("loss", "LR", "grad norm", "throughput")]
    assert len(training) == 8 and all(len([e for e in c if e.get("class") == "restart"]) == 1 for c in training)
    assert "](docs/images/run-page.svg)" in (ROOT / "README.md").read_text()
    assert "](images/run-page.svg)" in docs("metrics.md")

    run = tmp_path / "run"
    write_run(run, 300, spike=100)
    assert main(["report", str(run)]) == 0
    page = (run / "page" / "index.html").read_text()
    made = ET.fromstring(page_svg(page))
    assert [c.get("data-metric") for c in _charts(made)] == re.findall(r'<svg class="chart" data-metric="([^"]*)"', page)
    assert [len([e for e in c if e.get("class") == "restart"]) for c in _charts(made)] == [3] * 8
    assert [len([e for e in c if e.get("class") == "skipped"]) for c in _charts(made)] == [1] * 8
