"""`olmax report RUN`: a run's page, opened in headless Chromium as the layout pages are (tests/scale/
test_scale_report.py's helpers), and read back: its figures against report.json, its marks, its heatmap's shape."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scale.test_scale_report import HOSTILE, Facts, check_inert, check_rendered, chromium  # noqa: F401

from olmax.cli import main
from olmax.train.run_page import Metrics

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from run_page import write_run  # noqa: E402 - the benchmark's run directory, small

PLOT = 560 - 62 - 8  # a chart's pixel columns (olmax.train.run_page: WIDTH - LEFT - 8)


class Page(Facts):
    """Facts, and each chart's marks by kind, the curves' pixel columns and the heatmap."""

    def __init__(self):
        super().__init__()
        self.charts, self.heatmap, self._chart = [], None, None

    def handle_starttag(self, tag, attrs):
        super().handle_starttag(tag, attrs)
        attrs = dict(attrs)
        if tag == "svg" and attrs.get("class") == "chart":
            self._chart = {**attrs, "restart": 0, "checkpoint": 0, "skipped": 0, "grid": 0}
            self.charts.append(self._chart)
        elif tag == "svg" and attrs.get("class") == "heatmap":
            self.heatmap = attrs
        elif tag in ("line", "path") and attrs.get("class") in ("restart", "checkpoint", "skipped", "grid"):
            self._chart[attrs["class"]] += 1


def rendered_page(chromium, run: Path, tmp_path) -> tuple[dict, Page]:
    report, _ = check_rendered(chromium, run / "page" / "index.html", tmp_path)
    page = Page()
    page.feed((run / "page" / "index.html").read_text())
    return report, page


def test_a_long_run_is_drawn_a_pixel_column_at_a_time_with_its_spike(chromium, tmp_path, capsys):
    """5,000 steps on 490 pixel columns: every curve at most a point pair a column; the loss spike of one step
    (a stride would miss it 9 times in 10) is the chart's top; 3 restarts marked on each chart; an MoE's 4 layers
    by 490 columns of load."""
    run = tmp_path / "run"
    write_run(run, 5000, layers=4, spike=1234)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().err.strip() == f"olmax: run page {run / 'page' / 'index.html'}"
    report, page = rendered_page(chromium, run, tmp_path)
    assert page.sections == ["curves", "goodput", "expert-load", "commands", "config"]
    assert len(page.charts) == 8 and all(int(c["data-columns"]) == PLOT for c in page.charts)
    assert [c["restart"] for c in page.charts] == [3] * 8 and report["skipped_steps"] == [1234]
    assert all(c["skipped"] == 1 for c in page.charts)
    loss = next(c for c in page.charts if c["data-metric"] == "loss" and c["data-x"] == "step")
    assert loss["checkpoint"] == 10  # every 500 steps (the config's checkpoint.every)
    text = (run / "page" / "index.html").read_text()
    curve = text.split('data-metric="loss" data-x="step"', 1)[1].split('class="curve" d="', 1)[1].split('"', 1)[0]
    points = [tuple(map(float, p.split())) for p in re.findall(r"[ML]([\d.]+ [\d.]+)", curve)]
    assert min(points, key=lambda p: p[1])[0] == 62 + (1234 - 1) * (PLOT - 1) // 4999  # the spike's column is the top
    assert (page.heatmap["data-layers"], page.heatmap["data-columns"], page.heatmap["data-steps"]) == \
        ("4", str(2 * 560 - 62 - 8), "5000")
    assert page.rects["cell"] == 4 * (2 * 560 - 62 - 8)
    assert (run / "page" / "config.yaml").read_text().startswith("name: long")


@pytest.mark.slow
def test_the_page_of_an_moe_run_with_evaluations(chromium, tmp_path, shards):
    """A real tiny_moe run: its layers by its logged steps (fewer than the pixels: one column each), its held-out
    loss, its goodput and the commands, the figures as report.json has them."""
    run = tmp_path / "run"
    sets = json.dumps([{"label": "web", "paths": shards[:1]}, {"label": "code", "paths": shards[1:]}])
    assert main(["train", "tiny_moe", f"data.paths={json.dumps(shards)}", f"output_dir={run}", "mesh.fsdp=1",
                 "train.steps=6", "checkpoint.every=3", "eval.every=3", f"eval.sets={sets}", "eval.tokens=2048"]) == 0
    assert main(["report", str(run)]) == 0
    report, page = rendered_page(chromium, run, tmp_path)
    assert page.sections == ["curves", "heldout", "goodput", "expert-load", "commands", "config"]
    assert (page.heatmap["data-layers"], page.heatmap["data-columns"]) == ("4", "6") and page.rects["cell"] == 4 * 6
    assert report["steps_logged"] == 6 and report["committed_steps"] == [3, 6] and report["attempts"] == 1
    text = (run / "page" / "index.html").read_text()
    assert f"olmax eval heldout {run}/checkpoints/6 --data web=" in text and "<h3>code</h3>" in text


def test_what_is_not_a_run_nor_a_report_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    write_run(run, 10)
    for args, words in ((["report", str(tmp_path / "empty")], "not a run directory"),
                        (["report", str(tmp_path / "missing")], "no such file or directory"),
                        (["report", str(run), "--watch", "0"], "--watch 0"),
                        (["report", str(run / "metrics.jsonl"), "--watch", "5"], "--watch"),
                        (["report", str(run / "goodput.json")], "not a report.json olmax wrote")):
        assert main(args) == 2, args
        out, err = capsys.readouterr()
        [line] = err.splitlines()
        assert words in line and out == "", (args, line)
    assert not (tmp_path / "empty" / "page").exists()


def test_hostile_values_of_a_run_are_shown_as_text(chromium, tmp_path):
    """A run whose eval labels and config carry markup: the page shows it, Chromium runs nothing."""
    run = tmp_path / "run"
    write_run(run, 20)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 21, "wall_time": 1.8e9 + 11, f"eval/lm/{HOSTILE}/CE loss": 3.0}) + "\n")
    meta = run / "checkpoints" / "20" / "meta" / "metadata"
    meta.write_text(json.dumps({"step": 20, "config": {"name": HOSTILE, "eval": {"sets": [
        {"label": HOSTILE, "paths": [HOSTILE], "mix_file": None}]}}}))
    assert main(["report", str(run), "--out", str(tmp_path / "page")]) == 0
    text = (tmp_path / "page" / "index.html").read_text()
    check_inert(text)
    assert text.count("&lt;script&gt;") >= 3
    from scale.test_scale_report import open_in_chromium

    _, log = open_in_chromium(chromium, tmp_path / "page" / "index.html", tmp_path)
    assert "injected" not in log and "CONSOLE" not in log


def test_watch_writes_the_page_again_as_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    write_run(run, 3)
    watching = subprocess.Popen([sys.executable, "-m", "olmax.cli", "report", str(run), "--watch", "0.2"],
                                stderr=subprocess.PIPE, text=True)
    try:
        def logged():
            try:
                return json.loads((run / "page" / "report.json").read_text())["steps_logged"]
            except (OSError, ValueError):
                return None

        deadline = time.monotonic() + 120
        while logged() != 3 and time.monotonic() < deadline and watching.poll() is None:
            time.sleep(0.05)
        assert logged() == 3
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 4, "wall_time": 1.8e9 + 2, "train/CE loss": 1.0}) + "\n")
        while logged() != 4 and time.monotonic() < deadline and watching.poll() is None:
            time.sleep(0.05)
        assert logged() == 4
        watching.terminate()  # SIGTERM ends it as Ctrl-C does, with 143 for SIGTERM (it was 130 for both)
        _, err = watching.communicate(timeout=60)
        assert watching.returncode == 143 and err.splitlines()[-1] == "olmax: terminated", err[-500:]
    finally:
        watching.kill()


def _replace_line(path: Path, number: int, edit) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = edit(lines[number - 1])
    path.write_text("".join(lines))


# A line of metrics.jsonl that is not what olmax writes: how it is made from line 3, and what the error says of it
NOT_A_RECORD = {
    "a null loss": (lambda line: line.replace('"train/CE loss": ', '"train/CE loss": null, "x": '), "train/CE loss null"),
    "a string loss": (lambda line: line.replace('"train/CE loss": ', '"train/CE loss": "high", "x": '),
                      'train/CE loss "high"'),
    "a list of grad norms": (lambda line: line.replace('"optim/total grad norm": ', '"optim/total grad norm": [1, 2], '
                                                       '"x": '), "optim/total grad norm [1, 2], not a number"),
    "500 grad norms": (lambda line: line.replace('"optim/total grad norm": ', '"optim/total grad norm": '
                                                 f"{[0] * 500}, " '"x": '),
                       f"has optim/total grad norm {str([0] * 500)[:57]}..., not a number"),  # at most 60 characters
    "a negative step": (lambda line: line.replace('{"step": 3', '{"step": -5'), "step -5"),
    "a step of 10^23": (lambda line: line.replace('{"step": 3', '{"step": ' + "1" + "0" * 23), "step 1000"),
    "a wall time as a string": (lambda line: line.replace('"wall_time": ', '"wall_time": "noon", "x": '),
                                'wall_time "noon"'),
    "a line of text": (lambda line: "not json\n", "is not a record olmax wrote"),
    "an empty line": (lambda line: "\n", "is not a record olmax wrote"),
    "a short line": (lambda line: "{}\n", "is not a record olmax wrote"),
    "a torn line that is not the last": (lambda line: line[:40] + "\n", "line 3"),
    "a record inside a record": (lambda line: line.replace('"wall_time": ', '"x": {"step": 4}, "wall_time": '),
                                 "is not a record olmax wrote"),
    # JSON has no leading zero: the step was read with isdigit() and values with numpy, which take 0003 and +5
    "a step with leading zeros": (lambda line: line.replace('{"step": 3', '{"step": 0003'), "has step 0003, not a"),
    "a loss with a leading zero": (lambda line: line.replace('"train/CE loss": ', '"train/CE loss": 05, "x": '),
                                   "has train/CE loss 05, not a number"),
    "a loss with a plus": (lambda line: line.replace('"train/CE loss": ', '"train/CE loss": +5, "x": '),
                           "has train/CE loss +5, not a number"),
    # a key spelled with an escape is that key (the page looked for its plain spelling only)
    "a string loss under an escaped key": (lambda line: line.replace('"train/CE loss": ',
                                                                     '"train\\/CE loss": "abc", "x": '),
                                           'has train/CE loss "abc", not a number'),
    "an escape that is not JSON": (lambda line: line.replace('"wall_time": ', '"w\\all": 1, "wall_time": '),
                                   "is not JSON (JSONDecodeError: Invalid \\escape"),
}


@pytest.mark.parametrize("damage", NOT_A_RECORD)
def test_a_line_of_metrics_olmax_did_not_write_is_exit_2_naming_it(tmp_path, capsys, damage):
    """These crashed `olmax report RUN` with a traceback (ValueError, OverflowError, JSONDecodeError)."""
    edit, words = NOT_A_RECORD[damage]
    run = tmp_path / "run"
    write_run(run, 10)
    _replace_line(run / "metrics.jsonl", 3, edit)
    assert main(["report", str(run)]) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith(f"olmax: BadInput: {run / 'metrics.jsonl'} line 3 ") and words in line, line
    assert not (run / "page" / "index.html").exists()


@pytest.mark.parametrize("torn", ['{"step": 11, "wall_time": 1800000005.5, "train/CE loss": ',
                                  '{"step": 11, "wall_time": 1800000005.5, "eval/lm/web/CE loss": ', '{"ste'])
def test_a_last_line_torn_by_a_kill_is_left_out_as_a_resume_leaves_it(tmp_path, capsys, torn):
    run = tmp_path / "run"
    write_run(run, 10)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(torn)
    assert main(["report", str(run)]) == 0
    report = json.loads((run / "page" / "report.json").read_text())
    assert report["last_step"] == 10 and report["steps_logged"] == 10 and report["torn_last_line"]
    assert "not a whole record" in (run / "page" / "index.html").read_text()


def test_keys_spelled_with_escapes_or_beyond_ascii_are_read_decoded(tmp_path):
    """A key is compared as JSON decodes it: the loss under "train\\u002fCE loss" is drawn as the loss, an eval
    label written as UTF-8 (no \\u escape) is drawn under its name (it was an IndexError)."""
    run = tmp_path / "run"
    write_run(run, 10)
    _replace_line(run / "metrics.jsonl", 3, lambda line: line.replace('"train/CE loss": ', '"train\\u002fCE loss": '))
    with open(run / "metrics.jsonl", "ab") as f:
        f.write('{"step": 11, "wall_time": 1800000006.0, "eval/lm/wéb/CE loss": 2.5}\n'.encode())
    assert main(["report", str(run)]) == 0
    loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[2])["train/CE loss"]  # under the escape
    metrics = Metrics((run / "metrics.jsonl").read_bytes())
    assert metrics.column("train/CE loss")[2] == loss and metrics.optional == ["eval/lm/wéb/CE loss"]
    assert "<h3>wéb</h3>" in (run / "page" / "index.html").read_text()


@pytest.mark.parametrize("seconds", ["inf", "1e300", "1e10"])
def test_watch_beyond_a_day_is_refused_in_one_line(tmp_path, capsys, seconds):
    """Each wrote the page, then its sleep was an OverflowError."""
    run = tmp_path / "run"
    write_run(run, 3)
    assert main(["report", str(run), "--watch", seconds]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: ConfigError: --watch {float(seconds)}: give the seconds between two writes"), line
    assert not (run / "page").exists()


def test_checkpoint_metadata_or_a_goodput_record_olmax_did_not_write_is_exit_2_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, 10)
    meta = run / "checkpoints" / "10" / "meta" / "metadata"
    meta.write_text('{"step": 10, "config": {"na')
    assert main(["report", str(run)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: BadInput: {meta} is not checkpoint metadata olmax wrote"), line
    meta.write_text(json.dumps({"step": 10, "config": {"name": "run", "checkpoint": {"every": 5}}}))
    (run / "goodput.json").write_text('{"attempts": [{"started": "noon"}]}')
    assert main(["report", str(run)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: BadInput: {run / 'goodput.json'} is not a goodput record olmax wrote"), line


def test_values_far_beyond_a_float32_are_drawn(tmp_path):
    run = tmp_path / "run"
    write_run(run, 10)
    _replace_line(run / "metrics.jsonl", 3, lambda line: line.replace('"train/CE loss": ', '"train/CE loss": 1e308, "x": '))
    _replace_line(run / "metrics.jsonl", 4, lambda line: line.replace('"train/CE loss": ', '"train/CE loss": -1e308, "x": '))
    assert main(["report", str(run)]) == 0


def test_the_time_axis_is_in_the_unit_of_the_runs_span_broken_at_pauses(tmp_path):
    """A 7-second run's time axis read `0.001858 hours`; a curve against time was drawn straight across a
    checkpoint's pause; only the minimum and the maximum were labelled; checkpoints were ticks like the axis's."""
    run = tmp_path / "run"
    write_run(run, 14, restarts=0)  # a step every 0.5 s: 7 seconds
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records[7:]:
        record["wall_time"] += 3.0  # a checkpoint written after step 7
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = run / "checkpoints" / "14" / "meta" / "metadata"
    meta.write_text(json.dumps({"step": 14, "config": {"name": "short", "checkpoint": {"every": 7}}}))
    assert main(["report", str(run)]) == 0
    page = Page()
    page.feed((run / "page" / "index.html").read_text())
    by_time = [c for c in page.charts if c["data-x"] != "step"]
    assert len(by_time) == 4 and all(c["data-x"] == "seconds" for c in by_time)
    assert all(c["data-breaks"] == "1" for c in by_time)
    assert all(c["data-breaks"] == "0" for c in page.charts if c["data-x"] == "step")
    assert all(3 <= c["grid"] <= 5 for c in page.charts), [c["grid"] for c in page.charts]
    assert all(c["checkpoint"] == 2 for c in page.charts)  # steps 7 and 14: triangles, not lines


def test_a_short_last_line_is_named_too(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, 10)
    _replace_line(run / "metrics.jsonl", 10, lambda line: "{}\n")
    assert main(["report", str(run)]) == 2
    assert f"{run / 'metrics.jsonl'} line 10 is not a record olmax wrote" in capsys.readouterr().err
