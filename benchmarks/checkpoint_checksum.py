"""Cost of the checkpoint checksums: throughput of `olmax.checkpoint.checksums` on this machine's devices,
and what it comes to for an OLMo 3 7B checkpoint per host.

    .venv/bin/python benchmarks/checkpoint_checksum.py            # 4 x 512 MB of float32, 3 repeats

A training checkpoint of the 7B holds the float32 params and Adam's two float32
moments: 7,298,617,344 x 4 bytes x 3 = 87.6 GB (the skip-step history is a few
hundred bytes). Every array is checksummed where it lives, each host over the
shards on its own devices, so a host's share is 87.6 GB / hosts; the checksum
is computed once when a checkpoint is written and once when it is read.
Wall time and process CPU time are both printed: on a shared machine the CPU
time is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from olmax.checkpoint import checksums

PARAMS_7B = 7_298_617_344  # `olmax flops olmo3_7b`
CHECKPOINT_BYTES_7B = PARAMS_7B * 4 * 3  # float32 params + Adam's two float32 moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrays", type=int, default=4)
    parser.add_argument("--mb", type=int, default=512, help="MB per float32 array")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    count = args.mb * 2**20 // 4
    keys = jax.random.split(jax.random.key(0), args.arrays)
    tree = {f"a{i}": jax.random.normal(key, (count,), jnp.float32) for i, key in enumerate(keys)}
    jax.block_until_ready(tree)
    total = args.arrays * count * 4
    checksums(tree)  # compile
    runs = []
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        checksums(tree)
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
    per_host = {hosts: CHECKPOINT_BYTES_7B / hosts / (total / wall) for hosts in (1, 8, 32)}
    print(json.dumps({
        "device": str(jax.devices()[0].device_kind), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "load_average": os.getloadavg(), "bytes": total, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
        "gb_per_s_wall": round(total / wall / 1e9, 3), "gb_per_cpu_s": round(total / cpu / 1e9, 3),
        "checkpoint_7b_gb": round(CHECKPOINT_BYTES_7B / 1e9, 1),
        "seconds_per_host_per_checkpoint_7b": {hosts: round(s, 1) for hosts, s in per_host.items()},
        "cpu_seconds_7b_one_host": round(CHECKPOINT_BYTES_7B / (total / cpu), 1),
    }, indent=1))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
