"""`olmax report RUN`: a run's page, opened in headless Chromium as the layout pages are (tests/scale/
test_scale_report.py's helpers), and read back: its figures against report.json, its marks, its heatmap's shape."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scale.test_scale_report import HOSTILE, Facts, check_inert, check_rendered, chromium  # noqa: F401

from olmax.cli import main

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
            self._chart = {**attrs, "restart": 0, "checkpoint": 0, "skipped": 0}
            self.charts.append(self._chart)
        elif tag == "svg" and attrs.get("class") == "heatmap":
            self.heatmap = attrs
        elif tag == "line" and attrs.get("class") in ("restart", "checkpoint", "skipped"):
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
    top = text.split('data-metric="loss" data-x="step"', 1)[1].split('text-anchor="end">', 1)[1].split("<", 1)[0]
    assert float(top) == pytest.approx(6.0 / 1235 ** 0.1 + 5.0, rel=1e-3)
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
                        (["report", str(tmp_path / "missing")], "not a report.json olmax wrote"),
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
    finally:
        watching.terminate()
        watching.wait(timeout=60)
