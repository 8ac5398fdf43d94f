"""Configs compiled for one TPU slice, side by side: each row is one `olmax compile --json` in a fresh process;
nothing runs on a TPU. Compiling says what fits and what the compiler builds, not how fast it runs.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/compile_compare.py heads [overrides ...] [--target tpu:tpu7x:4x4x8]
        [--configs olmo3_7b olmo3_7b_hd256]

OLMo 3 7B with 32 heads of 128 and with 16 heads of 256 (`olmo3_7b_hd256`: same parameters and FLOPs): per-device
peak memory, the attention kernel and its tiles, the kernels and the collectives the compiled step runs, XLA's
cost analysis, the XLA flag profile the compiler got, compile time. The throughput of the two shapes is for a
run on the chips.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/compile_compare.py experts [overrides ...]
        [--experts 8 32 128] [--target tpu:v5p:4x4x4] [--dispatch auto]

The 47B-shaped MoE at 8, 32 and 128 experts (top-4: the same active parameters and useful FLOPs per token):
per-chip peak memory, XLA's cost analysis (FLOPs and HBM bytes accessed), the experts' dispatch and its
kernels, compile time. Overrides come first: --experts takes every number after it, e.g. `mesh.expert=64
mesh.fsdp=1 --experts 128`. XLA's cost analysis counts a scanned layer body once and a kernel (the TPU's
ragged-dot) not at all: its FLOPs and bytes compare the rows' non-expert work and data movement, not the whole
step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HEAD_SHAPES = ("olmo3_7b", "olmo3_7b_hd256")
MOE_BASE = ["mesh.expert=8", "mesh.fsdp=8", "mesh.rules.embed=[fsdp,expert]", "impl.moe.ep_capacity=1.25",
            "impl.remat=[qkv_proj,out_proj,context]"]


def compile_report(config: str, overrides: list[str], target: str, label: str) -> tuple[dict, bool]:
    """(`olmax compile --json`'s report, whether the step fits); `label` names the row in an error."""
    env = os.environ | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "olmax.cli", "compile", config, *overrides, "--target", target,
                           "--json"], capture_output=True, text=True, env=env)
    if done.returncode not in (0, 1):  # 1: it does not fit, and says how much it needs
        raise SystemExit(f"{label}: exit {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout), done.returncode == 0


def _common(r: dict) -> dict:
    return {"xla_flops": r.get("xla_cost", {}).get("flops"), "xla_bytes": r.get("xla_cost", {}).get("bytes_accessed")}


def head_shape_row(config: str, target: str, extra: list[str]) -> dict:
    r, fits = compile_report(config, extra, target, config)
    program = r.get("program", {})
    return {"config": config, "target": r["target"], "fits": fits,
            "peak_gib": r.get("peak", 0) / 2**30, "device_gib": r["memory_per_device"] / 2**30,
            "required_gib": r.get("required", 0) / 2**30,
            "instances_per_device": r["instances_per_device_micro_step"], "micro_steps": r["micro_steps"],
            "attention": r["attention"], "attention_tiles": r["attention_tiles"],
            "kernels": program.get("custom_calls"), "sparsecore_collectives": program.get("sparsecore_collectives"),
            **_common(r), "xla_flags": len(r["xla_flags"]), "compile_s": r["compile_seconds"],
            "olmax_tflop_per_device_step": r["plan"]["exact_window"]["tflop_per_device_step"]}


def experts_row(experts: int, target: str, dispatch: str, extra: list[str]) -> dict:
    overrides = [*MOE_BASE, f"model.moe.num_experts={experts}", f"impl.moe.dispatch={dispatch}", *extra]
    r, fits = compile_report("olmo3_moe_47b", overrides, target, f"{experts} experts")
    kernels = {k: v for k, v in r.get("program", {}).get("custom_calls", {}).items() if "ragged" in k}
    return {"experts": experts, "dispatch": r["moe_dispatch"], "fits": fits,
            "peak_gib": r.get("peak", 0) / 2**30, "arguments_gib": (r["parameters"] + r["optimizer_state"]) / 2**30,
            **_common(r), "expert_kernels": kernels, "compile_s": r["compile_seconds"],
            "olmax_tflop_per_device_step": r["plan"]["exact_window"]["tflop_per_device_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    comparisons = parser.add_subparsers(dest="comparison", required=True)
    heads = comparisons.add_parser("heads", help="OLMo 3 7B: 32 heads of 128 and 16 heads of 256")
    heads.add_argument("--target", default="tpu:tpu7x:4x4x8")
    heads.add_argument("--configs", nargs="+", default=list(HEAD_SHAPES))
    heads.add_argument("extra", nargs="*", help="config overrides for every row")
    experts = comparisons.add_parser("experts", help="the 47B-shaped MoE at several expert counts")
    experts.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    experts.add_argument("--target", default="tpu:v5p:4x4x4")
    experts.add_argument("--dispatch", default="auto")
    experts.add_argument("extra", nargs="*", help="more config overrides")
    args = parser.parse_args()
    if args.comparison == "heads":
        rows = (head_shape_row(config, args.target, args.extra) for config in args.configs)
    else:
        rows = (experts_row(n, args.target, args.dispatch, args.extra) for n in args.experts)
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
