"""`--report DIR` and `olmax report`: the page of a compile or a plan, opened in a real headless Chromium (Debian's
`chromium`, installed here as the Slurm tests install slurm-wlm) and read back against report.json."""

import collections
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from testlib import apt_install

from olmax.cli import main
from olmax.errors import ConfigError
from olmax.scale.anatomy import collectives
from olmax.scale.targets import aot_missing

needs_tpu = pytest.mark.skipif(bool(aot_missing("tpu")), reason=str(aot_missing("tpu")))
SECTIONS = ("mesh", "memory", "parameters", "collectives", "pipeline", "plan", "step-time", "target")
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
        self.rects, self.timeline = collections.Counter(), None

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
        if tag == "rect":
            self.rects[attrs.get("class")] += 1
        if tag == "svg" and attrs.get("class") == "timeline":
            self.timeline = attrs


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
    # the predicted step: its breakdown's figures are the report's, and one step drawn as a timeline with as many
    # red stretches (the compute waiting for a collective) as the prediction has
    prediction = report["step_time"]
    assert facts.facts["step_time.step_seconds"] == prediction["step_seconds"] > 0
    assert all(f"step_time.seconds.{c}" in facts.facts for c in ("matmul", "attention", "memory", "collective"))
    events = collections.Counter(e["category"] for e in prediction["timeline"])
    assert int(facts.timeline["data-exposed"]) == events["exposed"] == facts.rects["event exposed"]
    assert facts.rects["event matmul"] == events["matmul"] > 0 and facts.rects["event hidden"] == events["hidden"]
    assert facts.rects["layer"] > 2 * 4  # the layers the compute runs through, forward and backward


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@needs_tpu
def test_reports_side_by_side(chromium, compiled, tmp_path, capsys):
    """A compile and a plan of another schedule side by side: the page and BENCHMARKS.md's Markdown table."""
    plan_dir = tmp_path / "plan"
    assert main(["plan", *PIPELINED_MOE[:-3], "impl.pipeline.schedule=gpipe", *PIPELINED_MOE[-2:], "--mfu", "0.4",
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
    """A plan at a given MFU needs no compile: the 32B on 4 stages, each schedule's ticks, GPipe's bubble 3 of 11."""
    directory = tmp_path / "plan"
    assert main(["plan", "olmo3_32b", "mesh.stage=4", "impl.pipeline.microbatches=8", "--target", "tpu:v5p:4x4x8",
                 "--mfu", "0.4", "--report", str(directory)]) == 0
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


def test_a_report_or_run_that_does_not_exist_is_named_as_missing(tmp_path, capsys):
    """`olmax report /no/such/run` said "not a report.json olmax wrote"."""
    for reports in ([tmp_path / "no-run"], [STORED, tmp_path / "no.json"]):
        assert main(["report", *map(str, reports), "--out", str(tmp_path / "out")]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == (f"olmax: ConfigError: {reports[-1]}: no such file or directory; give a run directory "
                        "(output_dir), or report.json files of --report"), line
    assert not (tmp_path / "out").exists()


def test_a_report_directory_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert main(["plan", "tiny", "--target", "tpu:v5p:2x2x2", "--report", str(taken)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--report" in err and taken.read_text() == "mine"
    assert main(["report", str(taken), "--out", str(tmp_path / "out")]) == 2
    assert "not a report.json" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_link_planted_in_the_page_directory_during_the_work_is_not_written_through(tmp_path, capsys, monkeypatch):
    """`--report DIR` (compile, plan, tune) and `report --out DIR` checked DIR's files for links before the work and
    wrote them after it following links: a link planted at DIR/index.html during the work (here after the check,
    as the page's writer is called) had its target overwritten. Each file is checked as it is written now, and
    all of them before the first: exit 2 naming the link, nothing written, the target untouched."""
    from olmax.scale import layout_page as report

    directory, target = tmp_path / "page", tmp_path / "target"
    target.write_text("precious")
    write = report.write

    def plant_then_write(r, to):
        (directory / "index.html").symlink_to(target)
        return write(r, to)

    monkeypatch.setattr(report, "write", plant_then_write)
    assert main(["report", str(STORED), "--out", str(directory)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: RunDirError: {directory / 'index.html'} is a symbolic link (to {target})"), line
    assert target.read_text() == "precious" and [p.name for p in directory.iterdir()] == ["index.html"]


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
    assert found == {"by_axis": [{"axes": "a+b", "kind": "all-reduce", "as": None, "count": 1, "bytes_per_step": 32},
                                 {"axes": "b", "kind": "all-gather", "as": None, "count": 4, "bytes_per_step": 4 * 32}],
                     "loops_without_trip_count": 0}


# What a crafted report.json puts where the page shows a name: markup that would log to the browser's console if run.
HOSTILE = '"\'><script>console.error("injected")</script><img src=x onerror="console.error(\'injected\')"><olmax-injected>'
# The report of `olmax compile tiny_moe mesh.stage=2 mesh.expert=2 model.n_layers=8 --target tpu:v5p:2x2x2
# --report DIR` (commit 8ecb39f, 2026-12-05): every section of the page; the slow tier checks a fresh one the same way.
STORED = Path(__file__).with_name("compiled_report.json")
NAMED_BY_KEYS = ("mesh", "index", "spans", "custom_calls", "xla_flags", "attention_tiles")  # dicts keyed by names


def hostile(value, key=None):
    """`value` with HOSTILE after every string in it, and after the keys of the dicts keyed by names."""
    if isinstance(value, str):
        return value + HOSTILE
    if isinstance(value, list):
        return [hostile(v) for v in value]
    if isinstance(value, dict):
        return {(k + HOSTILE if key in NAMED_BY_KEYS else k): hostile(v, k) for k, v in value.items()}
    return value


def hostile_report(report: dict) -> dict:
    return hostile({**report, "xla_flags": {"xla_flag": "value"}, "attention_tiles": {"block_q": 512},
                    "layout": {"target": "tpu:*", "settings": ["mesh.fsdp=2"]}})


class Markup(HTMLParser):
    """The elements and attributes of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.attributes = set(), set()
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attributes |= {name for name, _ in attrs}


def check_inert(text: str) -> None:
    """No element nor attribute a report's values put there: every value shown as text."""
    markup = Markup(text)
    assert not markup.tags & {"script", "img", "olmax-injected"} and not [a for a in markup.attributes if a.startswith("on")]


def leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, (*path, i))
    else:
        yield path, value


def test_hostile_names_in_a_report_are_shown_as_text(chromium, tmp_path, capsys):
    """Every string of a report.json (names, config values, overrides, flags, paths) made markup: `olmax report`
    draws the page and the comparison with all of it as text, and Chromium runs nothing."""
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(hostile_report(json.loads(STORED.read_text()))))
    for out, reports in (("one", [crafted]), ("both", [crafted, crafted])):
        assert main(["report", *map(str, reports), "--out", str(tmp_path / out)]) == 0, capsys.readouterr().err
        text = (tmp_path / out / "index.html").read_text()
        check_inert(text)
        assert text.count("&lt;script&gt;") >= 20  # the names are there, as text
        dom, log = open_in_chromium(chromium, tmp_path / out / "index.html", tmp_path / out)
        assert "injected" not in log and "CONSOLE" not in log, log[-3000:]
        assert not Markup(dom).tags & {"script", "img"}
    assert Markup(text).tags >= {"svg", "rect", "table"}  # the sections were drawn


def test_hostile_names_in_a_report_stay_text_in_its_markdown_table():
    """The Markdown table `olmax report A.json B.json` prints, with every name made markup, a pipe, a backtick and a
    line break: rendered (Python-Markdown, as mkdocs renders), each row keeps its cells and no name is markup."""
    import markdown

    from olmax.scale.comparison import markdown_table

    report = hostile_report(json.loads(STORED.read_text()))
    report["overrides"] = [o + "|`x\ny" for o in report["overrides"]]
    text = markdown_table([report, {**report, "config": report["config"] + "|"}])
    assert len(text.splitlines()) == 4
    rendered = markdown.markdown(text, extensions=["tables"])
    check_inert(rendered)
    rows = re.findall(r"<tr>(.*?)</tr>", rendered, re.S)
    assert [row.count("<td") + row.count("<th") for row in rows] == [text.splitlines()[0].count(" | ") + 1] * 3
    assert rendered.count("&lt;script&gt;") >= 6  # config, overrides and target of both, shown as text


def test_a_report_field_of_another_kind_is_text_or_exit_2(capsys, tmp_path):
    """Each value of a report.json, one at a time, made a hostile string where olmax writes a number, a flag, a list
    or nothing: the page shows it as text, or `olmax report` refuses the file in one line, exit 2."""
    from olmax.scale.comparison import comparison_page
    from olmax.scale.layout_page import page
    from olmax.scale.report_json import unusable

    report = json.loads(STORED.read_text())
    refused = 0
    for path, value in leaves(report):
        if isinstance(value, str):
            continue
        crafted = json.loads(STORED.read_text())
        node = crafted
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = HOSTILE
        if unusable(crafted):
            refused += 1
            continue
        check_inert(page(crafted))
        check_inert(comparison_page([crafted, report]))
    assert refused  # some are refused: the check below sees them as a user does
    (tmp_path / "bad.json").write_text(json.dumps({**report, "devices": HOSTILE, "memory_per_device": HOSTILE}))
    assert main(["report", str(tmp_path / "bad.json"), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: ConfigError: {tmp_path / 'bad.json'}: not a report.json olmax wrote"), line
    assert not (tmp_path / "out").exists()


def test_a_report_without_the_fields_of_a_page_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "minimal.json").write_text(json.dumps({"config": "tiny", "target": "tpu:v5p:2x2x2"}))
    assert main(["report", str(tmp_path / "minimal.json"), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "not a report.json olmax wrote (no field" in line and not (tmp_path / "out").exists()


def _set(path: str, value):
    """An edit of report.json: the value at the dotted `path` made `value`."""
    def edit(report):
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = report
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


# A report.json whose figures are beyond a page's bounds: the field the one line names. A place in the slice of
# 10^30 drew 10^30 panels (20 GB before the kernel killed it), stages of 10^9 as many rows; 10^400 bytes was an
# OverflowError, NaN bytes a page of "nan%", an array 100,000 deep a RecursionError, a pipeline schedule's tick table
# of 4M cells a page of 491 MiB.
BEYOND = {
    "a place in the slice of 10^30": (_set("chips.0.at.z", 10**30), "chips.0.at.z is 1e+30"),
    "a place in the slice of 1e30": (_set("chips.3.at.x", 1e30), "chips.3.at.x is 1e+30"),
    "10^9 pipeline stages": (_set("plan.schedules.0.stages", 10**9), "plan.schedules.0.stages is 1000000000"),
    "a peak of 10^400 bytes": (_set("peak", 10**400), "peak is a number of 401 digits"),
    "a peak of NaN bytes": (_set("peak", math.nan), "peak is nan"),
    "an infinite step time": (_set("plan.exact_window.step_seconds", math.inf), "plan.exact_window.step_seconds is inf"),
    "a list 100 deep": (_set("remat", json.loads("[" * 100 + "]" * 100)), "remat.0.0.0"),
    # 4M cells took 1.8 GiB and 40 s, and wrote a page of 491 MiB
    "a tick table of 600 x 600 cells": (_set("plan.schedules.0.ticks", [[None] * 600] * 600),
                                        "plan.schedules.0.ticks.436 is past the 262,144 cells of the tick tables"),
}


@pytest.mark.parametrize("damage", BEYOND)
def test_a_figure_beyond_what_a_page_draws_is_exit_2_naming_it(tmp_path, capsys, damage):
    from olmax.scale.report_json import load  # before anything is drawn: the old code drew until memory ran out

    edit, words = BEYOND[damage]
    report = json.loads(STORED.read_text())
    edit(report)
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(report))
    with pytest.raises(ConfigError, match=re.escape(words)):
        load(str(crafted))
    for reports in ([crafted], [STORED, crafted]):
        assert main(["report", *map(str, reports), "--out", str(tmp_path / "out")]) == 2
        out, err = capsys.readouterr()
        [line] = err.splitlines()
        assert line.startswith(f"olmax: ConfigError: {crafted}: not a report.json olmax wrote") and words in line, line
        assert out == "" and not (tmp_path / "out").exists()


def test_a_json_array_100000_deep_is_not_a_report(tmp_path, capsys):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["report", str(tmp_path / "deep.json"), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: ConfigError: {tmp_path / 'deep.json'}: not a report.json olmax wrote (JSON "
                           "nested deeper"), line
    assert not (tmp_path / "out").exists()


def test_the_report_of_a_tune_or_of_a_comparison_is_named_as_what_it_is(tmp_path, capsys):
    """`olmax report A.json TUNE/report.json` said the tune's report was "not a report.json olmax wrote"."""
    from olmax.scale.tune_page import write_tune

    write_tune({"config": "tiny", "overrides": [], "target": "tpu:v5p:2x2x2", "budget": 2, "headroom": 0.1,
                "space": 4, "compiled": 0, "seconds": 3.0, "memory_per_device": 2**30, "results": []},
               str(tmp_path / "tune"))  # as `olmax tune --report` writes it
    assert main(["report", str(STORED), str(STORED), "--out", str(tmp_path / "both")]) == 0
    capsys.readouterr()
    takes = "; olmax report takes report.json files of olmax compile or olmax plan --report, or a run directory"
    for directory, what in (("tune", "the report of olmax tune --report"), ("both", "the report of a comparison page")):
        path = tmp_path / directory / "report.json"
        assert main(["report", str(STORED), str(path), "--out", str(tmp_path / "out")]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"olmax: ConfigError: {path}: {what}") and line.endswith(takes), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["", "{file}/report", "/proc/olmax-report"])
def test_a_report_directory_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys, where):
    (tmp_path / "file").write_text("mine")
    where = where.format(file=tmp_path / "file")
    for command in (["plan", "tiny", "--target", "tpu:v5p:2x2x2", "--report", where],
                    ["report", str(STORED), "--out", where]):
        assert main(command) == 2
        out, err = capsys.readouterr()
        [line] = err.splitlines()
        assert out == "" and line.startswith(f"olmax: ConfigError: {command[-2]} ") and repr(where)[1:-1] in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.slow
@needs_tpu
def test_hostile_names_in_a_fresh_report_are_text(compiled):
    """The stored report above against what this olmax writes now: the same check on a fresh compile's."""
    from olmax.scale.comparison import comparison_page
    from olmax.scale.layout_page import page

    report = hostile_report(json.loads((compiled / "report.json").read_text()))
    for text in (page(report), comparison_page([report, report])):
        check_inert(text)
    assert page(report).count("&lt;script&gt;") >= 20


def test_the_all_reduces_that_are_fsdp_gathers_and_scatters_say_so():
    """The TPU compiler gathers a sharded weight as an all-reduce of the shard written into zeros, and scatters a
    gradient as an all-reduce of which each device keeps its slice: the report names both."""
    hlo = """HloModule m
ENTRY %main (w: bf16[4,8], g: f32[16,8]) -> bf16[16,8] {
  %w = bf16[4,8]{1,0} parameter(0)
  %g = f32[16,8]{1,0} parameter(1)
  %zeros = bf16[16,8]{1,0} constant({...})
  %i = s32[] partition-id()
  %z = s32[] constant(0)
  %padded = bf16[16,8]{1,0} dynamic-update-slice(%zeros, %w, %i, %z)
  %whole = bf16[16,8]{1,0} all-reduce(%padded), replica_groups=[1,4]<=[4], to_apply=%add
  %summed = f32[16,8]{1,0} all-reduce(%g), replica_groups=[1,4]<=[4], to_apply=%add
  %mine = f32[4,8]{1,0} dynamic-slice(%summed, %i, %z), dynamic_slice_sizes={4,8}
  %other = f32[16,8]{1,0} all-reduce(%g), replica_groups=[1,4]<=[4], to_apply=%add
  ROOT %t = (bf16[16,8], f32[4,8], f32[16,8]) tuple(%whole, %mine, %other)
}
"""
    rows = {row["as"]: row for row in collectives(hlo, {"fsdp": 4})["by_axis"]}
    assert set(rows) == {"all-gather", "reduce-scatter", None}
    assert all(row["kind"] == "all-reduce" and row["count"] == 1 for row in rows.values())
    assert rows["all-gather"]["bytes_per_step"] == 16 * 8 * 2 and rows["reduce-scatter"]["bytes_per_step"] == 16 * 8 * 4


def test_the_residuals_are_read_from_the_program_as_the_forward_stacks_them():
    """program_memory finds the buffers the forward's layer loop fills for the backward: under remat full, each
    layer group's input and nothing else (its size exactly), under remat none more; no gathers on one device."""
    import jax
    import jax.numpy as jnp

    from olmax.config import load_config
    from olmax.model import families, transformer
    from olmax.scale.anatomy import program_memory

    def kept(remat):
        cfg = load_config("tiny", ["model.n_layers=12", f"impl.remat={remat}", "impl.compute_dtype=bfloat16"])
        params = jax.eval_shape(lambda: families.init_params(cfg.model, jax.random.key(0)))
        tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)

        def loss(p, t):
            return transformer.forward(cfg.model, cfg.impl, p, t)[0].astype(jnp.float32).mean()

        return cfg, program_memory(jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text())

    cfg, full = kept("full")
    groups = cfg.model.n_layers // len(cfg.model.layer_pattern)
    assert full == {"residuals": groups * 2 * 128 * cfg.model.d_model * 2, "gathered_weights": 0}
    assert kept("none")[1]["residuals"] > 4 * full["residuals"]
