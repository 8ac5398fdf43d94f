"""Shuffled loading, tokens/s: olmax next to ai2-olmo-core's NumpyFSLDataLoader on the same shards, one process.

    .venv/bin/python benchmarks/data_loader.py            # 4 shards x 16M uint32 tokens, sequence 8192

Each loader reads one whole epoch of the page-cached shards, shuffle
included, with and without the repetition filter (periods 1..13, 32
repeats). The shards hold a seeded random bigram language over the dolma2
vocabulary (olmax.data.synthetic) with a repeated stretch planted every 8192
tokens on average, so the filter has work to do. Times run from each epoch's
first batch on (worker startup and shuffle apart). Rows:

- olmo-core: its defaults (in-process, 4 reader threads).
- olmax: in-process (data.num_workers=0) and with 2 prefetch threads.
- olmax via Grain: the same batch function behind Grain's `mp_prefetch` with 2
  worker processes: the alternative the loader's thread prefetch is measured
  against (Grain comes with the `bench` extra: `pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from olmax.config import DataConfig, RepetitionFilterConfig
from olmax.data import build_loader
from olmax.data.synthetic import generate_tokens

VOCAB, EOS, PAD, SEED = 100278, 100257, 100277, 34521


def make_shards(directory: Path, shards: int, tokens: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(shards):
        path = directory / f"part-{index:05d}.npy"
        if not path.exists() or path.stat().st_size != 4 * tokens:
            with_repeats(generate_tokens(vocab_size=VOCAB, eos_id=EOS, n_tokens=tokens, seed=index), index).astype(
                np.uint32).tofile(path)
        paths.append(str(path))
    for path in paths:  # into the page cache
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    return paths


def with_repeats(tokens: np.ndarray, seed: int) -> np.ndarray:
    """One repeated stretch per 8192 tokens on average (period 1..13, 2..40 times): the filter has work to do."""
    rng = np.random.default_rng(seed)
    for start in rng.integers(0, len(tokens) - 13 * 40, size=len(tokens) // 8192):
        period, times = int(rng.integers(1, 14)), int(rng.integers(2, 41))
        tokens[start : start + period * times] = np.tile(rng.integers(0, EOS, size=period), times)
    return tokens


def data_config(paths, length, filtered, workers=0) -> DataConfig:
    return DataConfig(paths=paths, sequence_length=length, eos_id=EOS, pad_id=PAD, token_dtype="uint32", seed=SEED,
                      num_workers=workers, repetition_filter=RepetitionFilterConfig(enabled=filtered))


def time_olmax(paths, length, batch, filtered, workers):
    loader = build_loader(data_config(paths, length, filtered, workers), global_batch_instances=batch,
                          vocab_size=VOCAB)
    result = measure(itertools.islice(loader, loader.batches_per_epoch), lambda out: (out["input_ids"].size, out["instance_mask"]))
    loader.close()
    return result


class ReadBatch:
    """Picklable step -> batch for Grain's worker processes; each builds its own reader on first use."""

    def __init__(self, paths, length, batch, filtered):
        self.args = (paths, length, batch, filtered)
        self.reader = None

    def __call__(self, step):
        if self.reader is None:
            paths, length, batch, filtered = self.args
            self.reader = build_loader(data_config(paths, length, filtered), global_batch_instances=batch,
                                       vocab_size=VOCAB).reader
        return self.reader.read(step)


def time_grain(paths, length, batch, filtered, workers):
    import grain
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # Grain reads absl flags, which only an absl main parses
    batches = build_loader(data_config(paths, length, False), global_batch_instances=batch,
                           vocab_size=VOCAB).batches_per_epoch
    dataset = grain.MapDataset.range(batches).map(ReadBatch(paths, length, batch, filtered))
    iterator = iter(dataset.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)))
    result = measure(iterator, lambda out: (out["input_ids"].size, out["instance_mask"]))
    iterator.close()
    return result


def time_olmo_core(paths, length, batch, filtered, work_dir):
    from olmo_core.data import DataCollator, NumpyFSLDataLoader, NumpyFSLDataset
    from olmo_core.data.numpy_dataset import InstanceFilterConfig

    dataset = NumpyFSLDataset(*paths, sequence_length=length, pad_token_id=PAD, eos_token_id=EOS, vocab_size=VOCAB,
                              dtype=np.uint32, instance_filter_config=InstanceFilterConfig() if filtered else None)
    dataset.work_dir = work_dir
    dataset.prepare()
    loader = NumpyFSLDataLoader(dataset, collator=DataCollator(pad_token_id=PAD), global_batch_size=batch * length,
                                work_dir=work_dir, seed=SEED, fs_local_rank=0)
    loader.reshuffle(epoch=1, in_memory=True)
    result = measure(iter(loader), lambda out: (
        out["input_ids"].numel(), out["instance_mask"].numpy() if filtered else np.ones(0, dtype=bool)))
    loader.reset()
    return result


def measure(batches, size_and_mask):
    """(tokens, seconds, masked instances) of an epoch, timed from its first batch on (startup and shuffle apart)."""
    size, mask = size_and_mask(next(batches))
    masked = int((~mask).sum())
    started = time.perf_counter()
    tokens = 0
    for out in batches:
        size, mask = size_and_mask(out)
        tokens += size
        masked += int((~mask).sum())
    return tokens, time.perf_counter() - started, masked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "olmax-bench-shards"))
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--tokens-per-shard", type=int, default=16 << 20)
    parser.add_argument("--sequence-length", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=64, help="instances")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many epochs per row")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    paths = make_shards(Path(args.dir), args.shards, args.tokens_per_shard)
    length, batch = args.sequence_length, args.global_batch
    rows = {
        "olmo-core (4 threads)": lambda f: time_olmo_core(paths, length, batch, f, args.dir),
        "olmax (num_workers=0)": lambda f: time_olmax(paths, length, batch, f, 0),
        "olmax (num_workers=2, threads)": lambda f: time_olmax(paths, length, batch, f, 2),
        "olmax via Grain mp_prefetch (2 processes)": lambda f: time_grain(paths, length, batch, f, 2),
    }
    results = []
    for filtered in (False, True):
        for name, run in rows.items():
            best = min((run(filtered) for _ in range(args.repeats)), key=lambda r: r[1])
            tokens, seconds, masked = best
            results.append({"loader": name, "filter": filtered, "tokens": tokens, "seconds": seconds,
                            "tokens_per_s": tokens / seconds, "masked_instances": masked})
    machine = {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
               "shards": args.shards, "tokens_per_shard": args.tokens_per_shard, "sequence_length": length,
               "global_batch": batch}
    if args.json:
        print(json.dumps({"machine": machine, "results": results}, indent=1))
        return
    print(f"{args.shards} shards x {args.tokens_per_shard / 2**20:.0f}M uint32 tokens, sequence {length}, "
          f"global batch {batch}, one epoch, best of {args.repeats}; {os.cpu_count()} CPUs")
    print(f"{'loader':44} {'filter':>6} {'M tokens/s':>11} {'masked':>7}")
    for r in results:
        print(f"{r['loader']:44} {'on' if r['filter'] else 'off':>6} {r['tokens_per_s'] / 1e6:11.1f} "
              f"{r['masked_instances']:7d}")


if __name__ == "__main__":
    main()
