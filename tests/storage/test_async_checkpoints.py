"""Asynchronous checkpoints survive kill -9 at any moment of a save: one run killed once at each moment of its
saves (on disk: while Orbax writes a step in the background, the first save and a later one whose finish
deletes an old step; in a bucket on moto: while the step is written locally, in the middle of its upload, with
every file up but the commit marker, and once it is committed but not yet recorded) logs every step once, with
every loss bitwise the uninterrupted run's, and never resumes from a step that was not committed when it was
killed. Each kill is at a named point (tests/signal_at.py), so each moment is reached every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testlib import child_env

from olmax import storage
from olmax.config import load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.train.trainer import train

STEPS = 12
RUN = [f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep_last=2", "train.log_every=1", "mesh.fsdp=1"]
KILL_AT = str(Path(__file__).parents[1] / "signal_at.py")
# (where the run is killed, what of the save it stops), in the order the run meets them.
ON_DISK = [
    ("olmax.checkpoint:Checkpointer.finish", "the first save written in the background"),
    ("olmax.checkpoint:Checkpointer.finish#3", "a third save written in the background (two committed before it)"),
]
IN_A_BUCKET = [
    ("olmax.checkpoint:Checkpointer.finish", "the step written to the local staging directory, nothing uploaded"),
    # olmax uploads 8 files at once (storage.UPLOAD_THREADS) of the step's 26: the 12th starts once 4 are up
    ("olmax.storage:_write@/checkpoints/#12", "the upload, 4 or more of the step's files up"),
    ("olmax.storage:commit", "every file of the step up, its commit marker not"),
    ("olmax.storage:write_bytes@committed.json", "the step committed, the run's record of it not yet written"),
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_synthetic_shards(tmp_path_factory.mktemp("shards"), vocab_size=512, eos_id=0, n_tokens=120_000,
                                  n_shards=2, seed=0, token_dtype="uint16")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shards):
    out = tmp_path_factory.mktemp("ref")
    history = train(load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={out}/ref", *RUN]),
                    quiet=True)
    return {h["step"]: h["train/CE loss"] for h in history}


def _committed(run: str) -> set[int]:
    """Steps a resume may take: local step directories Orbax renamed into place, bucket steps with their marker."""
    checkpoints = storage.join(run, "checkpoints")
    names = storage.listdir(checkpoints) if storage.is_remote(run) or Path(checkpoints).is_dir() else []
    return {int(n) for n in names if n.isdigit() and (not storage.is_remote(run) or
                                                      storage.committed(storage.join(checkpoints, n)))}


def _upload_cut_short(run: str) -> bool:
    """A bucket step without its marker: what a resume must not take."""
    checkpoints = storage.join(run, "checkpoints")
    return any(n.isdigit() and not storage.committed(storage.join(checkpoints, n)) for n in storage.listdir(checkpoints))


def _metrics(run: str) -> list[dict]:
    path = storage.join(run, "metrics.jsonl")
    text = storage.read_text(path) if storage.is_remote(run) else Path(path).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _kill_at_each(points: list[tuple[str, str]], run: str, overrides: list[str], env: dict) -> list[dict]:
    """Run the training once per point, SIGKILLed there; then let it finish. One record per run."""
    runs = []
    for point, _ in points:
        proc = subprocess.run([sys.executable, KILL_AT, point, "train", "tiny", *overrides], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == -9, f"the run ended before it reached {point}:\n{proc.stderr[-3000:]}"
        runs.append({"point": point, "committed": _committed(run), "out": proc.stdout,
                     "cut short": storage.is_remote(run) and _upload_cut_short(run)})
    proc = subprocess.run([sys.executable, "-m", "olmax.cli", "train", "tiny", *overrides], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [*runs, {"out": proc.stdout}]


def _check(run: str, runs: list[dict], uninterrupted: dict) -> None:
    steps = [m["step"] for m in _metrics(run)]
    assert steps == list(range(1, STEPS + 1)), "every step logged exactly once"
    assert {m["step"]: m["train/CE loss"] for m in _metrics(run)} == uninterrupted
    for killed, after in zip(runs, runs[1:]):
        resumed = [int(line.split()[3]) for line in after["out"].splitlines() if line.startswith("resuming from step")]
        assert resumed == ([max(killed["committed"])] if killed["committed"] else []), \
            f"killed at {killed['point']}: a resume takes the latest step committed then, never another"
    print(f"\n{run}: " + "; ".join(f"killed at {r['point']} with steps {sorted(r['committed'])} committed"
                                    for r in runs[:-1]) + f"; steps 1-{STEPS} logged once each, every loss bitwise "
          "the uninterrupted run's")


@pytest.mark.slow
def test_kill_9_at_each_moment_of_async_saves_on_disk(tmp_path, shards, uninterrupted):
    """Cost: 3 processes of the tiny model's training (start-up, restore, a few steps each), ~15 s apiece."""
    run = str(tmp_path / "run")
    runs = _kill_at_each(ON_DISK, run, [f"data.paths={json.dumps(shards)}", f"output_dir={run}", *RUN], child_env(8))
    _check(run, runs, uninterrupted)
    assert max(runs[1]["committed"]) > max(runs[0]["committed"], default=0), "the second run committed steps of its own"


@pytest.mark.slow
def test_kill_9_at_each_moment_of_async_uploads_in_a_bucket(stores, tmp_path, shards, uninterrupted):
    """Cost: 5 processes of the tiny model's training in a bucket, ~15 s apiece."""
    run = f"s3://{stores.bucket}/run"
    runs = _kill_at_each(IN_A_BUCKET, run, [f"data.paths={json.dumps(shards)}", f"output_dir={run}", *RUN],
                         child_env(8, **stores.env))
    _check(run, runs, uninterrupted)
    assert [r["cut short"] for r in runs[:-1]] == [False, True, True, False], "the kills cut the uploads short"
    assert runs[-2]["committed"] and max(runs[-2]["committed"]) not in runs[-3]["committed"], \
        "the last kill came after a commit"
