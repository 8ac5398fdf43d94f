"""Resume A/B: a continuous run against the same run stopped at step N and resumed in a new process.

Each run is a separate `olmax train` process, so nothing in memory carries over the
resume. On CPU every per-step delta must be exactly 0.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from olmax.config import ConfigError, load_config
from olmax.data import build_loader
from olmax.errors import OlmaxError
from olmax.run_dir import RunDir, drawn, write_files

OUTPUTS = ("resume_check.tsv", "resume_check.png")  # the table and its plot, in --out beside the two runs


def _train(config: str, overrides: list[str], run_dir: Path, steps: int, stop_after: int | None, every: int) -> None:
    args = [sys.executable, "-m", "olmax.cli", "train", config, *overrides, f"output_dir={run_dir}",
            f"train.steps={steps}", f"checkpoint.every={every}", "checkpoint.resume=true"]
    if stop_after:
        args.append(f"train.stop_after={stop_after}")
    code = subprocess.run(args).returncode
    if code > 0:
        sys.exit(code)  # the train process said why itself: its one line, and its exit code is the check's
    if code < 0:
        raise OlmaxError(f"the train process in {run_dir} was killed by signal {-code} ({signal.strsignal(-code)})")


def _metric(run_dir: Path, name: str) -> dict[int, float]:
    rows = (json.loads(line) for line in RunDir(run_dir).metric_records())
    return {row["step"]: row[name] for row in rows}


def resume_check(config: str, overrides: list[str], at: int, steps: int, out: Path,
                 metric: str = "train/CE loss") -> list[tuple[int, float, float, float]]:
    """(step, continuous, resumed, delta) for every step after the resume."""
    if not 0 < at < steps:
        raise ConfigError(f"--at {at} must be between 0 and --steps {steps} (exclusive): the run stops and resumes "
                          "after step --at and is compared up to step --steps")
    cfg = load_config(config, overrides)
    # Bad data refused here, before any train process starts, with the line each of them would print.
    build_loader(cfg.data, global_batch_instances=cfg.train.global_batch_instances,
                 vocab_size=cfg.model.vocab_size).close()
    continuous, resumed = out / "continuous", out / "resumed"
    if earlier := [run_dir.name for run_dir in (continuous, resumed) if run_dir.exists()]:
        print(f"resume-check: deleting the runs of an earlier check in {out} ({' and '.join(earlier)}), to run "
              "them again", flush=True)
    for run_dir in (continuous, resumed):
        shutil.rmtree(run_dir, ignore_errors=True)
    phases = [(f"the continuous run, steps 1 to {steps}, in {continuous}", continuous, None),
              (f"the same run stopped after step {at}, in {resumed}", resumed, at),
              (f"that run resumed from its checkpoint {at} in a new process, to step {steps}", resumed, None)]
    for number, (heading, run_dir, stop_after) in enumerate(phases, start=1):
        print(f"== resume-check {number}/3: {heading}", flush=True)
        _train(config, overrides, run_dir, steps, stop_after, at)
    a, b = _metric(continuous, metric), _metric(resumed, metric)
    return [(step, a[step], b[step], b[step] - a[step]) for step in range(at + 1, steps + 1)]


def write_results(rows, out: Path, at: int) -> str:
    """The table of `rows` (`resume_check`'s), written to OUT/resume_check.tsv beside its plot, each through no
    symbolic link (run_dir.write_files: OUT opened once; neither written when either would be refused); the table."""
    text = "\n".join(["step\tcontinuous\tresumed\tdelta"] + [f"{s}\t{a!r}\t{b!r}\t{d:.3f}" for s, a, b, d in rows])
    write_files(out, dict(zip(OUTPUTS, (text + "\n", drawn(lambda png: plot(rows, png, at))))))
    return text


def plot(rows, file, at: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r[0] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    top.plot(steps, [r[1] for r in rows], label="continuous")
    top.plot(steps, [r[2] for r in rows], "--", label=f"resumed at {at}")
    top.set_ylabel("train/CE loss")
    top.legend()
    bottom.plot(steps, [r[3] for r in rows], color="C3")
    bottom.set_ylabel("resumed - continuous")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(file, dpi=100)
    plt.close(fig)
