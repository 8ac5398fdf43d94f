"""Bucket I/O next to local disk, on a local S3 server (moto, started here on 127.0.0.1).

    .venv/bin/python benchmarks/bucket_io.py            # 8192-token instances; olmo3_1b-shaped checkpoint

Rows:
- loader: tokens/s of `build_loader` over shards on disk and the same shards in
  s3:// (byte ranges through olmax.storage), read-ahead off (data.num_workers=0)
  and on (4 threads), global batch 64 x 8192 tokens, after a warm-up batch. The
  target printed beside it is 10x what one v5p chip consumes training the 7B
  recipe at 57.4% MFU (459 TFLOP/s bf16 peak, FLOPs per token from olmax's count,
  as `olmax plan` computes them).
- checkpoint: save and restore of a state of the model's shape (float32 host numpy
  arrays: the parameters; with --parts params,mu,nu also two Adam moments, which
  for olmo3_1b is 18 GB, and a restore needs that twice on the host, more than
  a 24 GB machine has) with olmax's Checkpointer to disk,
  and to the bucket (staged on disk and uploaded with its commit marker last,
  as a run with output_dir in a bucket does; restore = download + read).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from olmax import storage
from olmax.checkpoint import Checkpointer
from olmax.config import CheckpointConfig, DataConfig, load_config
from olmax.run_dir import RunDir
from olmax.data import build_loader
from olmax.data.shards import write_shard
from olmax.model import families, flops

VOCAB, EOS, PAD = 100278, 100257, 100277
V5P_PEAK, RECIPE_MFU = 459e12, 0.574


def v5p_tokens_per_s() -> float:
    """Tokens/s one v5p chip trains the 7B recipe at 57.4% MFU."""
    cfg = load_config("olmo3_7b", [])
    return V5P_PEAK * RECIPE_MFU / flops.count(cfg.model, cfg.data.sequence_length).per_token


def write_shards(directory: Path, shards: int, tokens: int) -> list[str]:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [str(directory / f"part-{i:05d}.npy") for i in range(shards)]
    for path in paths:
        write_shard(path, rng.integers(0, VOCAB, tokens, dtype=np.uint32))
    return paths


def loader_row(paths: list[str], *, length: int, batch: int, batches: int, workers: int) -> dict:
    data = DataConfig(paths=paths, sequence_length=length, eos_id=EOS, pad_id=PAD, num_workers=workers)
    with build_loader(data, global_batch_instances=batch, vocab_size=VOCAB) as loader:
        next(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        seconds = time.perf_counter() - start
    return {"where": storage.scheme(paths[0]) or "disk", "read_ahead": workers,
            "tokens_per_s": batches * batch * length / seconds}


def _state(model: str, parts: list[str]) -> dict:
    cfg = load_config(model, [])
    rng = np.random.default_rng(0)
    shapes = families.param_shapes(cfg.model)
    return {part: {k: rng.standard_normal(s, dtype=np.float32) for k, s in _flat(shapes).items()} for part in parts}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def checkpoint_row(state: dict, local: Path, url: str | None) -> dict:
    """Seconds to save and to restore `state` on disk (url None) or in the bucket at `url`."""
    meta = {"step": 1, "config": {}}
    directory = RunDir(local).checkpoints
    checkpointer = Checkpointer(directory, CheckpointConfig())
    start = time.perf_counter()
    checkpointer.save_params(1, state, meta)
    if url:
        storage.upload_committed(directory / "1", storage.join(url, "1"))
    saved = time.perf_counter() - start
    checkpointer.close()
    if url:
        shutil.rmtree(directory)
    start = time.perf_counter()
    if url:
        storage.download(storage.join(url, "1"), directory / "1")
        (directory / "1" / storage.COMMIT_MARKER).unlink()
    reader = Checkpointer(directory, CheckpointConfig(), read_only=True)
    target = {k: {n: np.empty_like(a) for n, a in v.items()} for k, v in state.items()}
    restored, _ = reader.restore_params(1, target)
    restored_s = time.perf_counter() - start
    reader.close()
    equal = all(np.array_equal(restored[k][n], a) for k, v in state.items() for n, a in v.items())
    return {"where": storage.scheme(url) if url else "disk", "save_s": saved, "restore_s": restored_s,
            "bytes": sum(a.nbytes for v in state.values() for a in v.values()), "restored_equal": equal}


def _moto() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            urllib.request.urlopen(url).close()
            return server, url
        except urllib.error.HTTPError:
            return server, url
        except OSError:
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence-length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-tokens", type=int, default=1 << 24)
    parser.add_argument("--model", default="olmo3_1b", help="preset whose parameter shapes the checkpoint has")
    parser.add_argument("--parts", default="params", help="the state's trees, comma-separated: params,mu,nu is "
                        "a training state (three times the parameters' bytes)")
    args = parser.parse_args()
    server, endpoint = _moto()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = write_shards(Path(tmp) / "shards", args.shards, args.shard_tokens)
            storage.upload(Path(tmp) / "shards", "s3://bench/shards")
            remote = [f"s3://bench/shards/{Path(p).name}" for p in local]
            print(json.dumps({"target_tokens_per_s": 10 * v5p_tokens_per_s()}), flush=True)
            for paths in (local, remote):
                for workers in (0, 4):
                    print(json.dumps(loader_row(paths, length=args.sequence_length, batch=args.batch,
                                                batches=args.batches, workers=workers)), flush=True)
            state = _state(args.model, args.parts.split(","))
            for url in (None, RunDir("s3://bench").checkpoints):
                with tempfile.TemporaryDirectory() as work:
                    print(json.dumps(checkpoint_row(state, Path(work), url)), flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
