"""Asynchronous checkpoints survive kill -9 at any moment: one run killed 20 times while its saves are being
written (on disk) or uploaded (to S3 on moto) logs every step once, with every loss bitwise the
uninterrupted run's, and never resumes from a step that was not committed when it was killed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testlib import child_env

from olmax import storage
from olmax.config import load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.run_dir import RunDir
from olmax.train.trainer import train

KILLS = 20
RUN = ["train.steps=60", "checkpoint.every=2", "checkpoint.keep_last=2", "train.log_every=1", "mesh.fsdp=1"]


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


def _save_in_flight(run: str) -> bool:
    """A step being written (Orbax's temporary directory) or uploaded (a bucket step without its marker)."""
    checkpoints = storage.join(run, "checkpoints")
    if storage.is_remote(run):
        return any(n.isdigit() and not storage.committed(storage.join(checkpoints, n))
                   for n in storage.listdir(checkpoints))
    return Path(checkpoints).is_dir() and any("tmp" in p.name for p in Path(checkpoints).iterdir())


def _logged_steps(run: str) -> list[int]:
    metrics = storage.join(run, "metrics.jsonl")
    try:
        text = storage.read_text(metrics) if storage.is_remote(run) else Path(metrics).read_text()
    except (OSError, storage.StorageError):
        return []
    return [json.loads(line)["step"] for line in text.splitlines() if line.strip()]


def _attempts(run: str) -> int:
    """The attempts the run's goodput record holds: a new one is there once it has restored its checkpoint."""
    try:
        return len(json.loads(storage.read_text(str(RunDir(run).goodput)))["attempts"])
    except (OSError, ValueError, storage.StorageError):
        return 0


def _kill_during_saves(run: str, overrides: list[str], env: dict, seed: int) -> list[dict]:
    """Start the run KILLS times and SIGKILL it each time at a random moment after it has trained a step or
    more, most often while a save is in flight; then let it finish. One record per kill."""
    rng, kills = random.Random(seed), []
    command = [sys.executable, "-m", "olmax.cli", "train", "tiny", *overrides]
    for _ in range(KILLS):
        before, attempts = max(_committed(run), default=0), _attempts(run)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wanted = before + rng.randint(1, 4)
        # Until this attempt has restored and logged its own steps: the files still hold the last one's at first.
        while proc.poll() is None and (_attempts(run) == attempts or max(_logged_steps(run), default=0) < wanted):
            time.sleep(0.02)
        in_flight = False
        while proc.poll() is None and not (in_flight := _save_in_flight(run)) and rng.random() < 0.98:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        proc.kill()
        out, err = proc.communicate()
        assert proc.returncode == -9, f"the run ended before it was killed:\n{err}"
        kills.append({"committed": _committed(run), "in_flight": in_flight, "out": out})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    kills.append({"out": proc.stdout})
    return kills


def _check(run: str, kills: list[dict], uninterrupted: dict) -> None:
    steps = _logged_steps(run)
    assert sorted(steps) == steps == list(range(1, 61)), "every step logged exactly once"
    text = storage.read_text(storage.join(run, "metrics.jsonl")) if storage.is_remote(run) \
        else Path(run, "metrics.jsonl").read_text()
    assert {m["step"]: m["train/CE loss"] for m in map(json.loads, text.splitlines())} == uninterrupted
    resumes = []
    for killed, after in zip(kills, kills[1:]):
        resumed = [int(line.split()[3]) for line in after["out"].splitlines() if line.startswith("resuming from step")]
        assert resumed == ([max(killed["committed"])] if killed["committed"] else []), \
            "a resume takes the latest step committed when the run was killed, never another"
        resumes += resumed
    in_flight = sum(k.get("in_flight", False) for k in kills)
    assert in_flight >= KILLS // 4, "most kills land while a save is in flight"
    print(f"\n{run}: {KILLS} kills, {in_flight} while a save was in flight; resumed from steps {resumes}; steps 1-60 "
          "logged once each, every loss bitwise the uninterrupted run's")


@pytest.mark.slow
def test_kill_9_during_async_saves_20_times_on_disk(tmp_path, shards, uninterrupted):
    run = str(tmp_path / "run")
    env = child_env(8)
    kills = _kill_during_saves(run, [f"data.paths={json.dumps(shards)}", f"output_dir={run}", *RUN], env, seed=1)
    _check(run, kills, uninterrupted)


@pytest.mark.slow
def test_kill_9_during_async_uploads_20_times_in_a_bucket(stores, tmp_path, shards, uninterrupted):
    run = f"s3://{stores.bucket}/run"
    env = child_env(8, **stores.env)
    kills = _kill_during_saves(run, [f"data.paths={json.dumps(shards)}", f"output_dir={run}", *RUN], env, seed=2)
    _check(run, kills, uninterrupted)
