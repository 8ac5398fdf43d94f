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
