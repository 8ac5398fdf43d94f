"""A run that lives in buckets: shards in S3, output_dir in GCS, 10% of requests faulted, kill -9 in the
middle, resumed: every logged loss bitwise the local-disk run's; checkpoints, events and metrics in the bucket.
And the one-line exit 2 of a missing object, a denied bucket and an unreachable endpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from olmax import storage
from olmax.config import load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.eval.curves import read_curve
from olmax.train.trainer import train

STEPS = ["train.steps=16", "checkpoint.every=2", "checkpoint.keep_last=2", "mesh.fsdp=1"]


@pytest.fixture
def bucket_shards(stores, tmp_path):
    """Synthetic shards on disk and the same in s3://BUCKET/tokens, with a mix file of relative paths."""
    shards = write_synthetic_shards(tmp_path / "tokens", vocab_size=512, eos_id=0, n_tokens=60_000, n_shards=2,
                                    seed=0, token_dtype="uint16")
    storage.upload(tmp_path / "tokens", f"s3://{stores.bucket}/tokens")
    storage.write_bytes(f"s3://{stores.bucket}/tokens/mix.txt",
                        "".join(f"synth,{Path(p).name}\n" for p in shards).encode())
    return shards


def _cli(env, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "olmax.cli", *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _committed_steps(run: str) -> list[int]:
    checkpoints = storage.join(run, "checkpoints")
    return [int(s) for s in storage.listdir(checkpoints)
            if s.isdigit() and storage.committed(storage.join(checkpoints, s))]


def _losses(text: str) -> dict[int, float]:
    return {m["step"]: m["train/CE loss"] for m in map(json.loads, text.splitlines())}


@pytest.mark.slow
def test_run_in_buckets_through_faults_and_kill_9_is_the_local_run(stores, bucket_shards, tmp_path):
    local = train(load_config("tiny", [f"data.paths={json.dumps(bucket_shards)}", f"output_dir={tmp_path}/local",
                                       *STEPS]), quiet=True)
    expected = {h["step"]: h["train/CE loss"] for h in local}
    run = f"gs://{stores.bucket}/run"
    overrides = [f"data.mix_file=s3://{stores.bucket}/tokens/mix.txt", f"output_dir={run}", *STEPS]
    stores.set_faults(share=0.1)
    proc = _cli(stores.env, "train", "tiny", *overrides)
    deadline = time.monotonic() + 600
    while not any(step >= 6 for step in _committed_steps(run)):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no checkpoint reached the bucket"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert max(_committed_steps(run)) < 16  # killed in the middle
    resumed = _cli(stores.env, "train", "tiny", *overrides)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert f"checkpoints in {run}/checkpoints" in out
    logged = _losses(storage.read_text(f"{run}/metrics.jsonl"))
    assert logged == expected  # bitwise: the same floats, step for step
    assert _committed_steps(run) == [14, 16]  # keep_last=2: the others deleted from the bucket
    assert storage.listdir(f"{run}/tensorboard")
    assert stores.s3.faults > 0 and stores.gcs.faults > 0
    assert max(json.loads(line)["io/retries"] for line in storage.read_text(f"{run}/metrics.jsonl").splitlines()) > 0
    # Warm start from the bucket is the warm start from the local run's identical checkpoint.
    warm = [f"data.paths={json.dumps(bucket_shards)}", "train.steps=2", "mesh.fsdp=1"]
    from_bucket = train(load_config("tiny", [*warm, f"output_dir={tmp_path}/w1",
                                             f"checkpoint.init_from={run}/checkpoints/16"]), quiet=True)
    from_disk = train(load_config("tiny", [*warm, f"output_dir={tmp_path}/w2",
                                           f"checkpoint.init_from={tmp_path}/local/checkpoints/16"]), quiet=True)
    assert [h["train/CE loss"] for h in from_bucket] == [h["train/CE loss"] for h in from_disk]
    curve = read_curve(run, "train/CE loss")  # what `olmax compare` reads: the bucket's TensorBoard events
    assert curve.name == run and dict(zip(curve.steps.tolist(), curve.values.tolist())) == \
        {s: float(np.float32(v)) for s, v in expected.items()}


def _one_line_exit_2(env, *overrides) -> str:
    proc = _cli(env, "train", "tiny", *overrides, "train.steps=2", "mesh.fsdp=1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow
def test_missing_object_denied_bucket_unreachable_endpoint_exit_2(stores, bucket_shards, unused_port):
    line = _one_line_exit_2(stores.env, f"data.mix_file=s3://{stores.bucket}/tokens/nothing.txt",
                            f"output_dir=gs://{stores.bucket}/run")
    assert f"s3://{stores.bucket}/tokens/nothing.txt does not exist" in line
    stores.set_faults(denied=(stores.bucket,))
    line = _one_line_exit_2(stores.env, f"data.mix_file=s3://{stores.bucket}/tokens/mix.txt",
                            f"output_dir=gs://{stores.bucket}/run")
    assert "access denied" in line and stores.bucket in line
    stores.set_faults()
    line = _one_line_exit_2({**stores.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{unused_port}"},
                            f"data.mix_file=s3://{stores.bucket}/tokens/mix.txt", f"output_dir=gs://{stores.bucket}/run")
    assert f"cannot reach http://127.0.0.1:{unused_port}" in line


@pytest.mark.slow
def test_a_resume_copies_down_only_the_step_it_restores_and_an_older_one_when_that_is_unreadable(stores, shards,
                                                                                                  tmp_path):
    run = f"s3://{stores.bucket}/older"
    common = [f"data.paths={json.dumps(shards)}", "checkpoint.every=5", "checkpoint.keep_last=3", "mesh.fsdp=1"]
    continuous = train(load_config("tiny", [*common, f"output_dir={tmp_path}/local", "train.steps=20"]), quiet=True)
    train(load_config("tiny", [*common, f"output_dir={run}", "train.steps=20", "train.stop_after=10"]), quiet=True)
    older = stores.s3.add("delay", method="GET", path=r"/older/checkpoints/5/")  # counts reads of step 5's objects
    torn = storage.read_bytes(storage.join(run, "goodput.json"))[:100]
    storage.write_bytes(storage.join(run, "goodput.json"), torn)  # a goodput record cut short
    resumed = train(load_config("tiny", [*common, f"output_dir={run}", "train.steps=20", "train.stop_after=15"]),
                    quiet=True)
    [aside] = [n for n in storage.listdir(run) if n.startswith("goodput.json.damaged-")]
    assert storage.read_bytes(storage.join(run, aside)) == torn, "kept in the bucket (it was in staging alone)"
    assert resumed[0]["step"] == 11 and older.hits == 0, "step 10 was restored; step 5 stays in the bucket"
    assert sorted(_committed_steps(run)) == [5, 10, 15], "kept by the rule over the bucket's steps, not the local copy's"
    params = storage.join(run, "checkpoints", "15", "params")
    storage.download(params, tmp_path / "params")
    big = next(p for p in sorted((tmp_path / "params").rglob("*")) if p.is_file() and p.stat().st_size > 1000)
    storage.write_bytes(storage.join(params, *big.relative_to(tmp_path / "params").parts), b"\0" * 7)  # changed
    fallen_back = train(load_config("tiny", [*common, f"output_dir={run}", "train.steps=20"]), quiet=True)
    assert fallen_back[0]["step"] == 11 and older.hits == 0
    assert [n for n in storage.listdir(run) if ".damaged-" in n] == [aside], "neither copied down nor up again"
    assert [h["train/CE loss"] for h in resumed + fallen_back] == [h["train/CE loss"] for h in continuous[10:15]] + \
        [h["train/CE loss"] for h in continuous[10:]]
