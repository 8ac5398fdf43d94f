"""How long a training step waits for its batch when the shards are in a slow bucket: the tiny preset reading
from a local S3 server (moto, started here on 127.0.0.1) through a proxy that holds every request for a set
latency, with and without the loader's read-ahead.

    .venv/bin/python benchmarks/slow_bucket.py                 # 0 and 200 ms a request, 0 and 8 read-ahead threads

One row per (latency, `data.num_workers`), and rows straight to the server (no proxy): the data-wait share of the loop's time (data wait over productive
steps, data wait, checkpoints and evaluation, from the goodput record's per-step figures, after the first step,
which compiles) and the mean seconds a step waited for its batch. The rows at 0 ms and without the proxy are the floor
this machine sets: the server (and the proxy, a thread of this process) run in Python on the cores the steps
use, so their CPU per request shows as data wait whatever the latency. Latency is hidden when the 200 ms row is
at that floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from olmax.runtime import skip_absent_tpus

skip_absent_tpus()  # before jax is imported: on a machine without accelerators, the CPU without probing for TPUs

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from bucket_io import _moto  # noqa: E402  (the same local S3 server)
from fault_proxy import FaultProxy  # noqa: E402  (the tests' proxy: `delay` holds every request)

from olmax import storage  # noqa: E402
from olmax.config import load_config  # noqa: E402
from olmax.data.synthetic import write_synthetic_shards  # noqa: E402
from olmax.train.trainer import train  # noqa: E402

LOOP = ("productive", "data wait", "checkpoint", "evaluation")


def row(shards: str, work: Path, latency: float | None, workers: int, steps: int, endpoint: str) -> dict:
    """latency None: straight to the server, no proxy."""
    proxy = None if latency is None else FaultProxy(int(endpoint.rsplit(":", 1)[1]))
    if proxy:
        proxy.add("delay", seconds=latency)
    os.environ["AWS_ENDPOINT_URL"] = proxy.url if proxy else endpoint
    try:
        history = train(load_config("tiny", [f"data.paths={shards}", f"data.num_workers={workers}",
                                             f"output_dir={work}/{latency}-{workers}", f"train.steps={steps}",
                                             f"checkpoint.every={steps}", "train.log_every=1", "mesh.fsdp=1"]),
                        quiet=True)
    finally:
        if proxy:
            proxy.close()
    steady = history[1:]
    wait = sum(h["goodput/step/data wait (s)"] for h in steady)
    loop = sum(h[f"goodput/step/{c} (s)"] for h in steady for c in LOOP)
    return {"latency_ms": "no proxy" if proxy is None else round(latency * 1000), "num_workers": workers,
            "data_wait_share": wait / loop, "wait_per_step_s": wait / len(steady), "step_s": loop / len(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--latencies-ms", default="direct,0,200",
                        help="added to every request by the proxy; direct: no proxy, olmax talks to the server")
    parser.add_argument("--workers", default="0,8", help="data.num_workers of each row")
    args = parser.parse_args()
    server, endpoint = _moto()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    try:
        with tempfile.TemporaryDirectory() as work:
            local = write_synthetic_shards(Path(work) / "tokens", vocab_size=512, eos_id=0, n_tokens=120_000,
                                           n_shards=2, seed=0, token_dtype="uint16")
            storage.upload(Path(work) / "tokens", "s3://bench/tokens")
            shards = json.dumps([f"s3://bench/tokens/{Path(p).name}" for p in local])
            for ms in args.latencies_ms.split(","):
                for workers in (int(w) for w in args.workers.split(",")):
                    latency = None if ms == "direct" else int(ms) / 1000
                    print(json.dumps(row(shards, Path(work), latency, workers, args.steps, endpoint)), flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
