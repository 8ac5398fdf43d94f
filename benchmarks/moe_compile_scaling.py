"""The 47B-shaped MoE compiled for one TPU slice at 8, 32 and 128 experts (top-4: the same active parameters and
useful FLOPs per token), side by side: per-chip peak memory, XLA's cost analysis (FLOPs and HBM bytes
accessed), the experts' dispatch and its kernels, compile time. Each row is one `olmax compile --json` in a
fresh process; nothing runs on a TPU.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/moe_compile_scaling.py [extra overrides ...]
        [--experts 8 32 128] [--target tpu:v5p:4x4x4] [--dispatch auto]

(overrides first: --experts takes every number after it), e.g. `mesh.expert=64 mesh.fsdp=1 --experts 128`.

XLA's cost analysis counts a scanned layer body once and a kernel (the TPU's ragged-dot) not at all: its
FLOPs and bytes compare the rows' non-expert work and data movement, not the whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BASE = ["mesh.expert=8", "mesh.fsdp=8", "mesh.rules.embed=[fsdp,expert]", "impl.moe.ep_capacity=1.25",
        "impl.remat=[qkv_proj,out_proj,context]"]


def row(experts: int, target: str, dispatch: str, extra: list[str]) -> dict:
    overrides = [*BASE, f"model.moe.num_experts={experts}", f"impl.moe.dispatch={dispatch}", *extra]
    env = os.environ | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "olmax.cli", "compile", "olmo3_moe_47b", *overrides, "--target",
                           target, "--json"], capture_output=True, text=True, env=env)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{experts} experts: exit {done.returncode}: {done.stderr[-2000:]}")
    r = json.loads(done.stdout)
    kernels = {k: v for k, v in r.get("program", {}).get("custom_calls", {}).items() if "ragged" in k}
    return {"experts": experts, "dispatch": r["moe_dispatch"], "fits": done.returncode == 0,
            "peak_gib": r.get("peak", 0) / 2**30, "arguments_gib": (r["parameters"] + r["optimizer_state"]) / 2**30,
            "xla_flops": r.get("xla_cost", {}).get("flops"), "xla_bytes": r.get("xla_cost", {}).get("bytes_accessed"),
            "expert_kernels": kernels, "compile_s": r["compile_seconds"],
            "olmax_tflop_per_device_step": r["plan"]["exact_window"]["tflop_per_device_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--target", default="tpu:v5p:4x4x4")
    parser.add_argument("--dispatch", default="auto")
    parser.add_argument("extra", nargs="*", help="more config overrides")
    args = parser.parse_args()
    for experts in args.experts:
        print(json.dumps(row(experts, args.target, args.dispatch, args.extra)), flush=True)


if __name__ == "__main__":
    main()
