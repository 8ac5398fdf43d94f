"""`olmax compare`: step-aligned windowed means and smoothed deltas on constructed curves, and the readers
(TensorBoard events with a restart's purge, metrics.jsonl, a published TSV)."""

import json

import numpy as np
import pytest
from tensorboardX import SummaryWriter

from olmax.eval import curves
from olmax.errors import EvalError


def test_windowed_delta_on_constructed_curves():
    steps = np.arange(1, 201)
    a = curves.Curve("a", steps, 3.0 - 0.004 * steps + 0.01 * np.sin(steps))
    offset = np.where(steps < 100, 0.02, -0.01)
    # B is logged every other step only: windows average the steps both curves have.
    b = curves.Curve("b", steps[1::2], (a.values + offset)[1::2])
    result = curves.compare(a, b, window=20, smooth=60, ranges=[(0, 100), (100, 1000)])
    w = result["windows"]
    assert w["window_start"].tolist() == list(range(0, 201, 20))
    assert w["steps"].tolist() == [9] + [10] * 9 + [1]  # steps 2..18 in [0, 20), 20..38 in [20, 40), ...
    common = steps[1::2]
    for i, start in enumerate(w["window_start"]):
        inside = (common >= start) & (common < start + 20)
        assert w["mean_a"][i] == pytest.approx(a.values[common[inside] - 1].mean())
    np.testing.assert_allclose(w["delta"], [0.02] * 5 + [-0.01] * 6, atol=1e-12)
    # smoothed over 60 steps: each window with the one either side, where there is one
    np.testing.assert_allclose(w["smoothed_delta"][[0, 2, 4, 5, 8, 10]], [0.02, 0.02, 0.01, 0.0, -0.01, -0.01],
                               atol=1e-12)
    summary = result["summary"]
    assert summary["0:100"]["delta_mean"] == pytest.approx(0.02) and summary["0:100"]["windows"] == 5
    assert summary["100:1000"]["delta_max_abs"] == pytest.approx(0.01)
    assert summary["all"]["steps"] == 100 and summary["all"]["step_delta_max_abs"] == pytest.approx(0.02)
    assert summary["0:100"]["steps"] == 49  # even steps 2..98


def test_window_of_one_gives_per_step_deltas():
    steps = np.arange(1, 100)
    a = curves.Curve("a", steps, np.linspace(3, 2, 99))
    result = curves.compare(a, curves.Curve("b", steps, a.values.copy()), window=1)
    assert result["summary"]["all"]["step_delta_max_abs"] == 0 and result["summary"]["all"]["windows"] == 99


def test_curves_share_no_step():
    with pytest.raises(EvalError, match="share no step"):
        curves.compare(curves.Curve("a", np.array([1, 2]), np.ones(2)), curves.Curve("b", np.array([3]), np.ones(1)),
                       window=10)


def test_readers_agree(tmp_path):
    run = tmp_path / "run"
    writer = SummaryWriter(str(run / "tensorboard"))
    for step in range(1, 11):
        writer.add_scalar("train/CE loss", 5.0 - step * 0.1, step)
    writer.close()
    # a restart after step 6 (tensorboardX purge_step) re-logs steps 7.. with other values
    writer = SummaryWriter(str(run / "tensorboard"), purge_step=7, filename_suffix=".restart")  # same second: own file
    for step in range(7, 9):
        writer.add_scalar("train/CE loss", 1.0, step)
    writer.close()
    tb = curves.read_curve(run, "train/CE loss")
    assert tb.steps.tolist() == list(range(1, 9))
    np.testing.assert_allclose(tb.values, [4.9, 4.8, 4.7, 4.6, 4.5, 4.4, 1.0, 1.0], rtol=1e-6)

    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"step": int(s), "train/CE loss": float(v)}) + "\n"
                                              for s, v in zip(tb.steps, tb.values)))
    jsonl = curves.read_curve(tmp_path / "m.jsonl", "train/CE loss")
    (tmp_path / "published.tsv").write_text("step\tloss\n" + "".join(f"{s}\t{v}\n" for s, v in zip(tb.steps, tb.values)))
    tsv = curves.read_curve(tmp_path / "published.tsv", "train/CE loss")
    for other in (jsonl, tsv):
        assert other.steps.tolist() == tb.steps.tolist() and np.allclose(other.values, tb.values)
    with pytest.raises(EvalError, match="no scalar 'eval/lm/c4/PPL'"):
        curves.read_curve(run, "eval/lm/c4/PPL")


def test_compare_cli_writes_table_plot_and_summary(tmp_path):
    from test_eval import run_cli

    steps = np.arange(1, 61)
    (tmp_path / "a.tsv").write_text("".join(f"{s}\t{3 - 0.01 * s}\n" for s in steps))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"step": int(s), "train/CE loss": 3 - 0.01 * s + 0.05}) + "\n"
                                              for s in steps))
    run_cli("compare", tmp_path / "a.tsv", tmp_path / "b.jsonl", "--window", 10, "--smooth", 30, "--ranges", "0:30,30:",
            "--out", tmp_path / "cmp")
    summary = json.loads((tmp_path / "cmp.json").read_text())["summary"]
    assert summary["all"]["delta_mean"] == pytest.approx(0.05) and set(summary) == {"all", "0:30", "30:"}
    table = (tmp_path / "cmp.tsv").read_text().splitlines()
    assert table[0].split("\t")[:3] == ["window_start", "window_end", "steps"] and len(table) == 1 + 7
    assert [float(x) for x in table[1].split("\t")] == pytest.approx([0, 9, 9, 2.95, 3.0, 0.05, 0.05])
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_defaults_fit_a_short_run_and_write_beside_it(tmp_path, monkeypatch):
    """Two 300-step runs: windows of 15 steps (20 points, not one of 2000), smoothing over 9 of them; the
    outputs go into the first run's directory, never the current one."""
    from olmax.cli import main

    for name, offset in (("a", 0.0), ("b", 0.05)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "train/CE loss": 3 - 0.001 * s + offset}) + "\n" for s in range(1, 301)))
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "a" / "compare.json").read_text())
    assert (report["window"], report["smooth"]) == (15, 135)
    assert len((tmp_path / "a" / "compare.tsv").read_text().splitlines()) == 1 + 21  # steps 1..300 in 0..314
    assert not list(tmp_path.glob("compare*"))
