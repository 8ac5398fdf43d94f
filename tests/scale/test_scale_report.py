"""`--report DIR` and `olmax report`: the page of a compile or a plan, opened in a real headless Chromium (Debian's
`chromium`, installed here as the Slurm tests install slurm-wlm) and read back against report.json."""

import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from testlib import apt_install

from olmax.cli import main
from olmax.scale.anatomy import collectives
from olmax.scale.targets import aot_missing

needs_tpu = pytest.mark.skipif(bool(aot_missing("tpu")), reason=str(aot_missing("tpu")))
SECTIONS = ("mesh", "memory", "parameters", "collectives", "pipeline", "plan", "target")
# a pipelined MoE: stage, fsdp and expert axes, experts, collectives over several axes, 1F1B's tick table
PIPELINED_MOE = ["tiny_moe", "mesh.stage=2", "mesh.expert=2", "model.n_layers=8", "impl.pipeline.schedule=1f1b",
                 "--target", "tpu:v5p:2x2x2"]
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _install_chromium() -> None:
    """Debian's package, as the README's test command gets it on a fresh machine; skipped only where no chromium
    package can be installed."""
    if os.geteuid() != 0:
        pytest.skip("installing Debian's chromium needs root; this process is not root")
    if (out := apt_install("chromium", check=False)).returncode != 0:
        policy = subprocess.run(["apt-cache", "policy", "chromium"], capture_output=True, text=True).stdout
        if "Candidate: (none)" in policy or not policy.strip():
            pytest.skip("no chromium package can be installed here (apt-cache policy chromium has no candidate)")
        pytest.fail(f"could not install chromium: {out.stderr[-2000:]}")


@pytest.fixture(scope="session")
def chromium():
    if shutil.which("chromium") is None:
        _install_chromium()
    return shutil.which("chromium")


def open_in_chromium(chromium: str, page, tmp_path) -> tuple[str, str]:
    """(the DOM after rendering, the browser's log) of a page, and its screenshot written next to it at 1280 px wide."""
    url = page.resolve().as_uri()
    common = [chromium, *BROWSER_FLAGS, "--enable-logging=stderr", "--v=0"]
    dom = subprocess.run([*common, f"--user-data-dir={tmp_path / 'profile-dom'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=300)
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = subprocess.run([*common, f"--user-data-dir={tmp_path / 'profile-shot'}", "--window-size=1280,3000",
                           f"--screenshot={page.parent / 'screenshot.png'}", url],
                          capture_output=True, text=True, timeout=300)
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert (page.parent / "screenshot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return dom.stdout, dom.stderr + shot.stderr


class Facts(HTMLParser):
    """The page's figures (data-fact -> data-value), its sections, and the idle cells of each schedule's grid."""

    def __init__(self):
        super().__init__()
        self.facts, self.sections, self.idle, self._schedule = {}, [], {}, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-fact" in attrs:
            self.facts[attrs["data-fact"]] = json.loads(attrs["data-value"])
        if tag == "section":
            self.sections.append(attrs["id"])
        if "data-schedule" in attrs:
            self._schedule = attrs["data-schedule"]
            self.idle[self._schedule] = 0
        if tag == "rect" and attrs.get("class") == "idle":
            self.idle[self._schedule] += 1


def read_page(dom: str) -> Facts:
    facts = Facts()
    facts.feed(dom)
    return facts


def at(report: dict, path: str):
    for key in path.split("."):
        report = report[int(key)] if isinstance(report, list) else report[key]
    return report


def check_self_contained(html_text: str) -> None:
    """Nothing fetched and nothing run: readable with JavaScript off."""
    assert "<script" not in html_text and "@import" not in html_text and "@font-face" not in html_text
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html_text)
    assert not re.search(r"url\((?!#)", html_text)


def check_rendered(chromium, page, tmp_path) -> tuple[dict, Facts]:
    report = json.loads((page.parent / "report.json").read_text())
    check_self_contained(page.read_text())
    dom, log = open_in_chromium(chromium, page, tmp_path)
    assert "CONSOLE" not in log, [line for line in log.splitlines() if "CONSOLE" in line]
    facts = read_page(dom)
    for path, value in facts.facts.items():
        assert at(report, path) == value, path
    return report, facts


def test_the_console_check_sees_an_error(chromium, tmp_path):
    """What the checks below rest on: a page that logs an error shows it in the browser's log."""
    page = tmp_path / "broken" / "index.html"
    page.parent.mkdir()
    page.write_text('<html><body><script>console.error("broken page")</script></body></html>')
    _, log = open_in_chromium(chromium, page, tmp_path)
    assert "CONSOLE" in log and "broken page" in log


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One compile of the pipelined MoE with --report (and --json: the figures printed are the report's)."""
    directory = tmp_path_factory.mktemp("report") / "moe"
    assert main(["compile", *PIPELINED_MOE, "--report", str(directory)]) == 0
    return directory


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@needs_tpu
def test_compile_report_renders_with_every_section_and_its_figures(chromium, compiled, tmp_path):
    report, facts = check_rendered(chromium, compiled / "index.html", tmp_path)
    assert facts.sections == list(SECTIONS)
    # the memory bar's segments add up to the compiler's peak (exactly: temporaries are the rest of it)
    segments = [s["bytes"] for s in report["memory_stack"]]
    assert abs(sum(segments[:-1]) - report["peak"]) <= 0.01 * report["peak"]
    assert sum(segments) == report["memory_per_device"]
    assert all(facts.facts[f"memory_stack.{i}.bytes"] == b for i, b in enumerate(segments))
    # every parameter with its placement: experts split over `expert`, layers over `stage`
    table = report["parameter_table"]
    assert {p["family"] for p in table} >= {"embeddings", "attention projections", "experts", "norms", "router"}
    assert all(f"parameter_table.{i}.bytes_per_device" in facts.facts for i in range(len(table)))
    experts = next(p for p in table if p["family"] == "experts")
    assert experts["spec"][:2] == ["stage", "expert"]
    assert experts["bytes_per_device"] == math.prod(experts["shape"]) * 4 // (2 * 2)  # float32 over stage x expert
    # collectives per mesh axis: the expert exchange, the stages' handoffs and the fsdp gathers
    kinds = {(c["axes"], c["kind"]) for c in report["collectives"]["by_axis"]}
    assert {("expert", "all-to-all"), ("stage", "collective-permute"), ("fsdp", "all-gather")} <= kinds
    assert all(c["count"] > 0 and c["bytes_per_step"] > 0 for c in report["collectives"]["by_axis"])
    # the mesh on the slice: 2 x 2 x 2 chips, every mesh axis of size 2 along one physical dimension
    assert {a["axis"]: sum(a["spans"].values()) for a in report["mesh_axes"] if a["size"] > 1} == \
        {"stage": 2, "fsdp": 2, "expert": 2}
    # the schedules this config allows, as ticks by stages, the bubble's cells shaded
    schedules = {s["schedule"]: s for s in report["plan"]["schedules"]}
    assert schedules["1f1b"]["configured"] and schedules["gpipe"]["allowed"]
    assert not schedules["interleaved_1f1b"]["allowed"]  # 2 layer-pattern periods: one chunk per stage
    assert facts.idle == {"gpipe": 2 * 1, "1f1b": 2 * 2 * 1}  # S - 1 idle a stage, in each of 1F1B's two phases
    assert facts.facts["plan.schedules.0.bubble_fraction"] == pytest.approx(1 / 3)  # S - 1 of M + S - 1
    for key in ("chip_seconds_per_step", "step_seconds", "chip_hours"):
        assert f"plan.exact_window.{key}" in facts.facts


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@needs_tpu
def test_reports_side_by_side(chromium, compiled, tmp_path, capsys):
    """A compile and a plan of another schedule side by side: the page and BENCHMARKS.md's Markdown table."""
    plan_dir = tmp_path / "plan"
    assert main(["plan", *PIPELINED_MOE[:-3], "impl.pipeline.schedule=gpipe", *PIPELINED_MOE[-2:],
                 "--report", str(plan_dir)]) == 0
    capsys.readouterr()
    assert main(["report", str(compiled / "report.json"), str(plan_dir / "report.json"), "--out",
                 str(tmp_path / "both")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| config | overrides | target | schedule | bubble |") and len(table) == 4
    assert "| 1F1B | 33.3% (1 of 3) |" in table[2] and "| GPipe | 33.3% (1 of 3) |" in table[3]
    page = tmp_path / "both" / "index.html"
    check_self_contained(page.read_text())
    dom, log = open_in_chromium(chromium, page, tmp_path)
    assert "CONSOLE" not in log and dom.count("<svg") == 1  # one memory bar: the plan compiled nothing


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_plan_report_draws_every_schedule(chromium, tmp_path):
    """A plan needs no compile: the 32B on 4 stages, each schedule's ticks, GPipe's bubble 3 of 11."""
    directory = tmp_path / "plan"
    assert main(["plan", "olmo3_32b", "mesh.stage=4", "impl.pipeline.microbatches=8", "--target", "tpu:v5p:4x4x8",
                 "--report", str(directory)]) == 0
    report, facts = check_rendered(chromium, directory / "index.html", tmp_path)
    assert facts.sections == ["pipeline", "plan", "target"]
    assert [s["schedule"] for s in report["schedules"] if s["allowed"]] == \
        ["gpipe", "circular", "1f1b", "interleaved_1f1b"]
    assert facts.facts["schedules.0.bubble_fraction"] == pytest.approx(3 / 11)
    assert facts.idle["gpipe"] == 4 * 3  # each stage idles S - 1 of the forward iterations
    for schedule in report["schedules"]:  # the bubble's cells: S - 1 a stage in each phase (1F1B: forward, backward)
        phases = 2 if "1f1b" in schedule["schedule"] else 1
        assert facts.idle[schedule["schedule"]] == phases * 4 * 3
    assert facts.facts["exact_window.chip_hours"] == report["exact_window"]["chip_hours"] > 0


def test_a_report_directory_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert main(["plan", "tiny", "--target", "tpu:v5p:2x2x2", "--report", str(taken)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--report" in err and taken.read_text() == "mine"
    assert main(["report", str(taken), "--out", str(tmp_path / "out")]) == 2
    assert "not a report.json" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_collectives_are_counted_per_mesh_axis_and_loop_run():
    """A program with a loop of 4 runs around a gather over the second mesh axis, and one reduction over all."""
    hlo = """HloModule m
%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %g = f32[8]{0} all-gather(%x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %g)
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %r = bf16[16]{0} all-reduce(%a), channel_id=2, replica_groups=[1,4]<=[4], to_apply=%add
}
"""
    found = collectives(hlo, {"a": 2, "b": 2})
    assert found == {"by_axis": [{"axes": "a+b", "kind": "all-reduce", "count": 1, "bytes_per_step": 32},
                                 {"axes": "b", "kind": "all-gather", "count": 4, "bytes_per_step": 4 * 32}],
                     "loops_without_trip_count": 0}
