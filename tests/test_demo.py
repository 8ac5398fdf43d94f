"""The embedded demo, shortened: real stdlib text -> tokenizer -> shards -> training with evals -> report."""

import json
from pathlib import Path

import pytest

from olmax.demo import run_demo


@pytest.mark.slow
def test_demo_end_to_end_twice_bitwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo preset's paths are relative to the working directory
    short = ["train.steps=40", "eval.every=20", "eval.tokens=4096", "checkpoint.every=20", "model.vocab_size=1024",
             "schedule.warmup_steps=5"]
    report = run_demo(short, fresh=False)
    first = json.loads(Path("runs/demo/report.json").read_text())
    assert first["losses_repeat_previous_run"] is None
    # 40 steps already beat the unigram baseline (the full demo's margins are in its report and README)
    assert first["final"]["eval/lm/code/CE loss"] < first["unigram_baseline"]["code"] - 0.5
    assert first["final"]["eval/lm/prose/CE loss"] < first["unigram_baseline"]["prose"]
    text = report.read_text()
    assert "## Greedy samples" in text and "olmax convert olmax-to-hf" in text
    assert Path("runs/demo/loss_curves.png").stat().st_size > 10_000

    run_demo(short, fresh=False)  # reuses the cached data, trains again from scratch
    second = json.loads(Path("runs/demo/report.json").read_text())
    assert second["losses_repeat_previous_run"] is True


@pytest.mark.slow
def test_demo_moe_reports_the_load_of_every_expert(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    short = ["train.steps=30", "eval.every=30", "eval.tokens=4096", "checkpoint.every=30", "model.vocab_size=1024",
             "schedule.warmup_steps=5"]
    report = run_demo(short, fresh=False, moe=True)
    assert report == Path("runs/demo/report_moe.md")
    result = json.loads(Path("runs/demo/report_moe.json").read_text())
    counts = result["final"]["train/block 03/tokens per expert"]
    assert len(counts) == 8 and sum(counts) == 16 * 256 * 2  # the whole global batch, top-2
    text = report.read_text()
    assert "## Experts" in text and "train/load balancing loss" in text and "olmax train demo_moe" in text
    assert Path("runs/demo/expert_load_moe.png").stat().st_size > 10_000
    assert not Path("runs/demo/report.md").exists()  # the dense demo's report is its own
