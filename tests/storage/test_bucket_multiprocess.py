"""A multi-process run whose output_dir is a bucket: 2 processes x 2 CPU devices (jax.distributed, gloo on
127.0.0.1), each staging on a directory of its own as hosts without a shared filesystem do. Each uploads the
shards it holds of a checkpoint; process 0 commits it. Started by `olmax launch --nprocs 2`, one process killed
after step 3 and the group resumed by both processes to step 6: the losses are a one-process run's, and one
process reads the checkpoint back whole."""

from __future__ import annotations

import json
import os
import signal

import jax
import numpy as np
import pytest

from olmax import storage
from olmax.config import load_config
from olmax.model.weights import load_olmax
from olmax.train.trainer import train
from testlib import child_env, read_jsonl, signal_once_when

STEPS = 6


@pytest.mark.slow
def test_olmax_launch_restarts_two_processes_from_the_one_checkpoint_they_wrote_to_a_bucket(stores, tmp_path, shards,
                                                                                           monkeypatch):
    """`olmax launch --nprocs 2` with output_dir in a bucket: its records go to runs/s3/BUCKET/PATH here; process 1 is
    killed once step 3 is committed in the bucket, the group restarts, resumes from the bucket and finishes; the
    progress the launcher judges attempts by is the bucket's committed steps. (One scenario for what were two
    tests: two processes writing one checkpoint and resuming from it, and the launcher restarting them.)
    Cost: two launches of two jax.distributed processes each against a real S3 server, and the one-process reference."""
    from olmax.launch.supervisor import Backoff, Supervisor

    monkeypatch.chdir(tmp_path)
    run = f"s3://{stores.bucket}/launched"
    checkpoints = storage.join(run, "checkpoints")
    env = child_env(2, **stores.env, OLMAX_LOCAL_DEVICES="2")
    common = [f"data.paths={json.dumps(shards)}", f"train.steps={STEPS}", "checkpoint.every=3", "mesh.fsdp=-1"]
    sleeps = []
    supervisor = Supervisor("tiny", [*common, f"output_dir={run}"], nprocs=2, backoff=Backoff(0.1, 2, 1),
                            max_retries=1, sleep=sleeps.append, env=env,
                            on_start=signal_once_when(lambda: storage.committed(storage.join(checkpoints, "3")),
                                                      signal.SIGKILL, 1, poll=0.2))
    assert supervisor.run() == 0
    first, second = read_jsonl(tmp_path / "runs" / "s3" / stores.bucket / "launched" / "launch.jsonl")
    assert first["reason"] == "killed by SIGKILL (process 1)" and 3 <= first["checkpoint_after"] < STEPS, first
    assert second["reason"] == "finished" and second["checkpoint_after"] == STEPS, second
    assert second["checkpoint_before"] == first["checkpoint_after"]  # resumed from the bucket's checkpoint
    assert sleeps == [0.1]  # a crash, after progress: the backoff's first delay
    records = set(os.listdir(tmp_path / "runs" / "s3" / stores.bucket / "launched"))  # records only: the run is in the bucket
    assert "launch.jsonl" in records and not records & {"checkpoints", "metrics.jsonl", "tensorboard"}, records

    assert [s for s in storage.listdir(checkpoints) if storage.committed(storage.join(checkpoints, s))] == ["3", "6"]
    # Both processes' shards went up: each array's metadata of both, and the chunk files each wrote.
    arrays = storage.join(checkpoints, "6", "params")
    assert set(storage.listdir(storage.join(arrays, "array_metadatas"))) == {"process_0", "process_1"}
    embedding = [n for n in storage.listdir(arrays) if "embed" in n]
    assert embedding, storage.listdir(arrays)
    chunks = [n for n in storage.listdir(storage.join(arrays, embedding[0])) if not n.startswith(".")]
    assert len(chunks) == 4, chunks  # one per device of the fsdp=4 mesh, two from each process
    logged = [json.loads(line) for line in storage.read_bytes(storage.join(run, "metrics.jsonl")).splitlines()]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))

    # One process reads the step the two wrote (checksums verified on read) ...
    cfg, params, step = load_olmax(run)
    assert step == STEPS and cfg.train.steps == STEPS
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    # ... and the losses are those of one process on 4 devices (not bitwise: the rows of the global batch
    # sit on other devices, so partial sums and the gloo all-reduce round differently).
    reference = train(load_config("tiny", [*common, "mesh.fsdp=4", f"output_dir={tmp_path / 'one'}"]), quiet=True)
    np.testing.assert_allclose([m["train/CE loss"] for m in logged], [m["train/CE loss"] for m in reference],
                               rtol=3e-7, atol=0)
