"""How long the training step stalls for a checkpoint, synchronous against asynchronous, to disk and to a
local S3 server (moto, started here on 127.0.0.1), and the upload throughput of one file at a time against
olmax's concurrent uploads.

    .venv/bin/python benchmarks/checkpoint_stall.py              # a 1.2 GB state, medians of 3 saves

Rows (medians over --saves):
- stall: seconds `AsyncSaver.save` holds the training thread for a state of float32 arrays on the device
  (params and an optimizer state of the same size): with `checkpoint.async: false` the whole write (and
  upload); asynchronous, the arrays' checksums (computed on the device before the copy) and the copy to
  host memory. `checksum_s` is the checksums alone. `background_s` is the rest of an asynchronous save
  (write, upload, commit), which overlaps the steps that follow. Each save starts after the previous one
  is done, so no save waits for another here.
- upload: MB/s of uploading one written checkpoint step to the bucket, one file at a time with s3fs's
  default part size (as olmax did before) and with olmax's settings (storage.UPLOAD_THREADS files at
  once, S3 multipart in storage.MULTIPART_CHUNK parts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from olmax.runtime import skip_absent_tpus

skip_absent_tpus()  # before jax is imported: on a machine without accelerators, the CPU without probing for TPUs
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bucket_io import _moto  # noqa: E402  (the same local S3 server)

from olmax import storage  # noqa: E402
from olmax.checkpoint import Checkpointer  # noqa: E402
from olmax.checkpoint.async_save import AsyncSaver  # noqa: E402
from olmax.checkpoint.checksums import checksums  # noqa: E402
from olmax.config import CheckpointConfig  # noqa: E402
from olmax.run_dir import RunDir  # noqa: E402
from olmax.train.bucket_run import BucketRun  # noqa: E402


class State(NamedTuple):
    params: dict
    opt_state: dict


def make_state(gigabytes: float, arrays: int = 8) -> State:
    """Random float32 arrays on the default device (constant ones would compress to nothing), half params,
    half optimizer state, `gigabytes` in all."""
    rows = int(gigabytes * 1e9 / 4 / arrays / 1024)
    keys = iter(jax.random.split(jax.random.key(0), arrays))
    trees = [{f"w{i}": jax.random.normal(next(keys), (rows, 1024), jnp.float32) for i in range(arrays // 2)}
             for _ in (0, 1)]
    return State(*jax.block_until_ready(trees))


def stall_row(state: State, work: Path, url: str | None, asynchronous: bool, saves: int) -> dict:
    bucket = BucketRun(url, CheckpointConfig(keep_last=1)) if url else None
    directory = RunDir(bucket.local if bucket else work).checkpoints
    checkpointer = Checkpointer(directory, CheckpointConfig(keep_last=1), asynchronous=asynchronous)
    saver = AsyncSaver(checkpointer, bucket.push_checkpoint if bucket else None)
    stalls, background = [], []
    for step in range(1, saves + 1):
        start = time.perf_counter()
        saver.save(step, state, {"step": step, "config": {}})
        stalls.append(time.perf_counter() - start)
        start = time.perf_counter()
        saver.finish()
        background.append(time.perf_counter() - start)
    checkpointer.close()
    if bucket:
        bucket.close()
    start = time.perf_counter()
    checksums(state.params), checksums(state.opt_state)
    checksum_s = time.perf_counter() - start
    return {"row": "stall", "where": "s3" if url else "disk", "async": asynchronous, "checksum_s": checksum_s,
            "stall_s": statistics.median(stalls), "background_s": statistics.median(background),
            "stalls_s": stalls, "gb": sum(a.nbytes for t in state for a in t.values()) / 1e9}


def upload_row(step_dir: Path, url: str, concurrent: bool, repeats: int) -> dict:
    threads, chunk = storage.UPLOAD_THREADS, storage.MULTIPART_CHUNK
    if not concurrent:
        storage.UPLOAD_THREADS, storage.MULTIPART_CHUNK = 1, None
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    seconds = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            storage.upload(step_dir, f"{url}/step")  # over the last one: the server keeps one copy
            seconds.append(time.perf_counter() - start)
    finally:
        storage.UPLOAD_THREADS, storage.MULTIPART_CHUNK = threads, chunk
    median = statistics.median(seconds)
    return {"row": "upload", "concurrent": concurrent, "mb_per_s": size / 1e6 / median, "seconds": seconds,
            "files": sum(p.is_file() for p in step_dir.rglob("*")), "mb": size / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.2, help="size of the state (params + optimizer state)")
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    server, endpoint = _moto()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    state = make_state(args.gb)
    try:
        for url in (None, "s3://bench/run"):
            for asynchronous in (False, True):
                with tempfile.TemporaryDirectory() as work:
                    run = url and f"{url}-{int(asynchronous)}"
                    print(json.dumps(stall_row(state, Path(work), run, asynchronous, args.saves)), flush=True)
        with tempfile.TemporaryDirectory() as work:
            checkpointer = Checkpointer(Path(work), CheckpointConfig())
            checkpointer.save(1, state, {"step": 1, "config": {}})
            checkpointer.close()
            for concurrent in (False, True):
                print(json.dumps(upload_row(Path(work) / "1", "s3://bench/uploads", concurrent, args.saves)),
                      flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
