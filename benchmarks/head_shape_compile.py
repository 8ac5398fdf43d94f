"""OLMo 3 7B with 32 heads of 128 and with 16 heads of 256 (`olmo3_7b_hd256`: same parameters and FLOPs) compiled
for one TPU slice, side by side: per-device peak memory, the attention kernel and its tiles, the kernels and the
collectives the compiled step runs, XLA's cost analysis, the XLA flag profile the compiler got, compile time.
Each row is one `olmax compile --json` in a fresh process; nothing runs on a TPU.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/head_shape_compile.py [overrides ...] [--target tpu:tpu7x:4x4x8]

Compiling says what fits and what the compiler builds, not how fast it runs: the throughput of the two shapes
is for a run on the chips.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = ("olmo3_7b", "olmo3_7b_hd256")


def row(config: str, target: str, extra: list[str]) -> dict:
    env = os.environ | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "olmax.cli", "compile", config, *extra, "--target", target, "--json"],
                          capture_output=True, text=True, env=env)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{config}: exit {done.returncode}: {done.stderr[-2000:]}")
    r = json.loads(done.stdout)
    program = r.get("program", {})
    return {"config": config, "target": r["target"], "fits": done.returncode == 0,
            "peak_gib": r.get("peak", 0) / 2**30, "device_gib": r["memory_per_device"] / 2**30,
            "required_gib": r.get("required", 0) / 2**30,
            "instances_per_device": r["instances_per_device_micro_step"], "micro_steps": r["micro_steps"],
            "attention": r["attention"], "attention_tiles": r["attention_tiles"],
            "kernels": program.get("custom_calls"), "sparsecore_collectives": program.get("sparsecore_collectives"),
            "xla_flops": r.get("xla_cost", {}).get("flops"), "xla_bytes": r.get("xla_cost", {}).get("bytes_accessed"),
            "xla_flags": len(r["xla_flags"]), "compile_s": r["compile_seconds"],
            "olmax_tflop_per_device_step": r["plan"]["exact_window"]["tflop_per_device_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tpu:tpu7x:4x4x8")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("extra", nargs="*", help="config overrides for both")
    args = parser.parse_args()
    for config in args.configs:
        print(json.dumps(row(config, args.target, args.extra)), flush=True)


if __name__ == "__main__":
    main()
