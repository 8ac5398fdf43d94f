"""A multi-process run whose output_dir is a bucket: 2 processes x 2 CPU devices (jax.distributed, gloo on
127.0.0.1), each staging on a directory of its own as hosts without a shared filesystem do. Each uploads the
shards it holds of a checkpoint; process 0 commits it. Stopped after 6 steps and resumed by both processes
to step 9: the losses are a one-process run's, and one process reads the checkpoint back whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import free_port

from olmax import storage
from olmax.config import load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.model.weights import load_olmax
from olmax.train.trainer import train
from testlib import child_env, signal_once_when

STEPS = 9


def _run_two_processes(stores, tmp_path, overrides: list[str], attempt: str) -> list[str]:
    """Start `olmax train tiny` as processes 0 and 1 of one run; their outputs once both exited 0."""
    env = child_env(os.environ["JAX_COMPILATION_CACHE_DIR"], 2, **stores.env, OLMAX_LOCAL_DEVICES="2",
                    OLMAX_COORDINATOR=f"127.0.0.1:{free_port()}", OLMAX_NUM_PROCESSES="2")
    logs = [tmp_path / f"{attempt}-{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as out:  # files, not pipes: an unread pipe would block a process
            procs.append(subprocess.Popen([sys.executable, "-m", "olmax.cli", "train", "tiny", *overrides],
                                          env={**env, "OLMAX_PROCESS_ID": str(i)}, stdout=out,
                                          stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(f"--- process {i} ---\n{out[-3000:]}" for i, out in enumerate(outputs))
    return outputs


@pytest.mark.slow
def test_two_processes_write_one_checkpoint_to_a_bucket_and_resume_from_it(stores, tmp_path):
    shards = write_synthetic_shards(tmp_path / "tokens", vocab_size=512, eos_id=0, n_tokens=60_000, n_shards=2,
                                    seed=0, token_dtype="uint16")
    run = f"s3://{stores.bucket}/run"
    common = [f"data.paths={json.dumps(shards)}", f"train.steps={STEPS}", "checkpoint.every=3", "mesh.fsdp=-1"]
    _run_two_processes(stores, tmp_path, [*common, f"output_dir={run}", "train.stop_after=6"], "first")

    checkpoints = storage.join(run, "checkpoints")
    assert [s for s in storage.listdir(checkpoints) if storage.committed(storage.join(checkpoints, s))] == ["3", "6"]
    # Both processes' shards went up: each array's metadata of both, and the chunk files each wrote.
    arrays = storage.join(checkpoints, "6", "params")
    assert set(storage.listdir(storage.join(arrays, "array_metadatas"))) == {"process_0", "process_1"}
    embedding = [n for n in storage.listdir(arrays) if "embed" in n]
    assert embedding, storage.listdir(arrays)
    chunks = [n for n in storage.listdir(storage.join(arrays, embedding[0])) if not n.startswith(".")]
    assert len(chunks) == 4, chunks  # one per device of the fsdp=4 mesh, two from each process

    outputs = _run_two_processes(stores, tmp_path, [*common, f"output_dir={run}"], "resumed")
    assert "resuming from step 6" in outputs[0]
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


@pytest.mark.slow
def test_olmax_launch_restarts_a_two_process_bucket_run_from_the_buckets_checkpoint(stores, tmp_path, monkeypatch):
    """`olmax launch --nprocs 2` with output_dir in a bucket: its records go to runs/NAME here; process 1 is
    killed once step 3 is committed in the bucket, the group restarts, resumes from the bucket and finishes; the
    progress the launcher judges attempts by is the bucket's committed steps."""
    import signal

    from olmax.launch.supervisor import Backoff, Supervisor

    monkeypatch.chdir(tmp_path)
    shards = write_synthetic_shards(tmp_path / "tokens", vocab_size=512, eos_id=0, n_tokens=60_000, n_shards=2,
                                    seed=0, token_dtype="uint16")
    run = f"s3://{stores.bucket}/launched"
    step3 = storage.join(run, "checkpoints", "3")
    env = child_env(os.environ["JAX_COMPILATION_CACHE_DIR"], 2, **stores.env, OLMAX_LOCAL_DEVICES="2")
    overrides = [f"data.paths={json.dumps(shards)}", "train.steps=6", "checkpoint.every=3", "mesh.fsdp=-1",
                 f"output_dir={run}"]
    sleeps = []
    supervisor = Supervisor("tiny", overrides, nprocs=2, backoff=Backoff(0.1, 2, 1), max_retries=1,
                            sleep=sleeps.append, env=env,
                            on_start=signal_once_when(lambda: storage.committed(step3), signal.SIGKILL, 1, poll=0.2))
    assert supervisor.run() == 0
    first, second = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "launch.jsonl").read_text().splitlines()]
    assert first["reason"] == "killed by SIGKILL (process 1)" and 3 <= first["checkpoint_after"] < 6, first
    assert second["reason"] == "finished" and second["checkpoint_after"] == 6, second
    assert sleeps == [0.1]  # a crash, after progress: the backoff's first delay
    logged = [json.loads(line) for line in storage.read_bytes(storage.join(run, "metrics.jsonl")).splitlines()]
    assert [m["step"] for m in logged] == list(range(1, 7))
    records = set(os.listdir(tmp_path / "runs" / "tiny"))  # records only: the run is in the bucket
    assert "launch.jsonl" in records and not records & {"checkpoints", "metrics.jsonl", "tensorboard"}, records
