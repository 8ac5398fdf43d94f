"""The step-time model against every published figure the OLMo 3 reproduction and OLMo-core's MoE release rest on.

Each row compiles the step for its target on this machine (`olmax compile`, cached by program: a rerun
compiles nothing), predicts its time from the compiled program (olmax.scale.step_time) and prints the
prediction beside the published figure, however far off. No constant of the model comes from these figures:
the hardware table (olmax.scale.targets) cites its datasheets and derivations; `--constants` derives the
matmul efficiencies again.

    python benchmarks/step_model.py [--rows NAME ...] [--json OUT] [--markdown]
    python benchmarks/step_model.py --constants
    python benchmarks/step_model.py --config tiny --target tpu:v5p:2x2x1 [key=value ...]   # a row of your own

TPU rows need the aot extra, GPU rows the aot-gpu extra (a row whose extra is missing is reported as such).
Compiles take minutes each on a laptop (the 7B on 256 Ironwood chips the longest); the predictions do not
depend on the machine's load, so this may run beside other work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

# OLMo-core's OLMo-7B.py (the script behind its README's 7B H100 row): Llama-2-7B's shape (every layer global,
# 11008 hidden), 4096-token sequences, 1024 instances a step, micro-batch 2, FSDP over one host of 8 H100s,
# bf16 autocast, no activation checkpointing.
OLMO_CORE_7B = ["model.layer_pattern=[global]", "data.sequence_length=4096",
                "train.global_batch_instances=1024", "train.micro_batch_per_device=2", "impl.remat=none"]

# Its OLMo-1B.py (the README's 1B H100 row): d 2048, 18 layers, 16 heads, SwiGLU hidden 5632 (8 x 2048 / 3 rounded
# up to a multiple of 256), every layer global, 4096-token sequences, 1024 instances a step, micro-batch 4.
OLMO_CORE_1B = ["model.n_layers=18", "model.mlp_hidden=5632", "model.layer_pattern=[global]",
                "data.sequence_length=4096", "train.global_batch_instances=1024", "train.micro_batch_per_device=4",
                "impl.remat=none"]

OLMOE_B300X4 = ["mesh.expert=4", "mesh.fsdp=1", "mesh.rules.embed=[fsdp,expert]", "train.micro_batch_per_device=1"]


@dataclass
class Row:
    name: str
    config: str
    target: str
    overrides: list[str]
    published: str  # the figure as published, in words
    measure: str  # which predicted figure compares with it: mfu_all_global, tflops_per_device, tokens_per_gpu, ...
    value: float | None  # the published figure in that measure (a ratio for comparisons)
    source: str
    assumed: str = ""
    compare_to: str | None = None  # an ablation: the row it is relative to
    extra: dict = field(default_factory=dict)


ROWS = [
    Row("ironwood", "olmo3_7b", "tpu:tpu7x:4x4x4", [],
        "44.5% MFU, 510-513 TFLOP/s per device, 195 chip-s a step", "mfu_all_global", 0.445,
        "MaxText's OLMo 3 7B stage 1 reproduction (AI-Hypercomputer/maxtext pull request 3886)",
        "64 chips (128 devices; the figure is per device, the run's 256 chips had 1 x 8192 a device) at 4 x 8192 "
        "tokens a device, pure FSDP, Splash attention with its 512-token tiles, the tpu7x SparseCore flag profile; "
        "the preset's remat list (MaxText's, which saves mlpwi_0 too, needs 97.54 GiB a device in olmax's program "
        "of the 94.75 a device has)"),
    Row("ironwood-hd256", "olmo3_7b_hd256", "tpu:tpu7x:4x4x4", [],
        "+12.4% throughput (49.6% MFU) with 16 heads of 256", "speedup", 1.124,
        "the same reproduction", "as the row above, 16 heads of 256", compare_to="ironwood"),
    Row("v5p", "olmo3_7b", "tpu:v5p:4x4x8", [],
        "57.4% MFU, 263 TFLOP/s per chip (stage 2 on v5p-256)", "mfu_all_global", 0.574,
        "the same reproduction (stage 2, 47,684 steps)",
        "128 chips at 4 x 8192 tokens a chip, pure FSDP; the preset's remat list (MaxText's does not fit a v5p: "
        "99.48 GiB); the stage 2 run's own remat list is not published"),
    Row("fsdp4-dp32", "olmo3_7b", "tpu:tpu7x:4x4x4", ["mesh.fsdp=4", "mesh.data=32", "impl.shard_optimizer=true"],
        "4 FSDP x 32 DP within 1.5 TFLOP/s of pure FSDP", "tflops_delta", 0.0,
        "the same reproduction", "the Ironwood row's 128 devices and batch; the source does not say on which "
        "slice the variants ran; the Adam moments sharded over the 32 replicas (ZeRO-1): replicated there, the "
        "step needs 101.63 GiB a device of 94.75", compare_to="ironwood"),
    Row("fsdp8-dp16", "olmo3_7b", "tpu:tpu7x:4x4x4", ["mesh.fsdp=8", "mesh.data=16"],
        "8 FSDP x 16 DP within 1.5 TFLOP/s of pure FSDP", "tflops_delta", 0.0,
        "the same reproduction", "the Ironwood row's 128 devices and batch", compare_to="ironwood"),
    Row("tp2", "olmo3_7b", "tpu:tpu7x:4x4x4", ["mesh.fsdp=64", "mesh.tensor=2",
                                               "train.micro_batch_per_device=2"],
        "TP=2 worse by 1.6% MFU at half the batch a device", "mfu_delta", -0.016,
        "the same reproduction", "FSDP 64 x tensor 2 at 2 x 8192 tokens a device", compare_to="ironwood"),
    Row("h100", "olmo3_7b", "gpu:h100x8", OLMO_CORE_7B,
        "47-48% MFU, 9.7-10K tokens/s per device", "tokens_per_device", 9850.0,
        "OLMo-core's README (its 7B row, OLMo-7B.py)",
        "Llama-2-7B's shape as OLMo-7B.py trains it: 4096 tokens, 1024 instances a step, micro-batch 2, FSDP over "
        "8 H100s, no activation checkpointing; OLMo-core's MFU counts attention its own way, so tokens/s is the "
        "figure compared"),
    Row("h100-1b", "olmo3_1b", "gpu:h100x8", OLMO_CORE_1B,
        "39-40% MFU, 45-46K tokens/s per device", "tokens_per_device", 45500.0,
        "OLMo-core's README (its 1B row, OLMo-1B.py)",
        "OLMo-1B's shape as OLMo-1B.py trains it: 4096 tokens, 1024 instances a step, micro-batch 4, FSDP over 8 "
        "H100s, no activation checkpointing; tokens/s compared, as for the 7B"),
    Row("moe47b-b300", "olmo3_moe_47b", "gpu:b300x8", [],
        "52,000 tokens/s per GPU", "tokens_per_device", 52000.0,
        "OLMo-core 3's MoE release (experts resident, expert parallelism, 8 GPUs)",
        "the preset's gpu:b300x8 layout: 8-way expert parallelism (16 experts a GPU), 2 x 8192 tokens a micro-step, "
        "bf16, dropless; the release's GPU model (B200 or B300) and batch are not stated where the figure is"),
    Row("moe8e", "olmo3_moe_47b", "gpu:b300x8", ["model.moe.num_experts=8"],
        "8 -> 128 experts at top-4: under 5% slower", "slowdown", 0.05,
        "OLMo-core 3's MoE release", "the 47B shape with 8 experts (4.6B total) against the row above (128)",
        extra={"inverse_of": "moe47b-b300"}),
    Row("mxfp8", "olmoe_1b_7b", "gpu:b300x4", [*OLMOE_B300X4, "impl.fp8=mxfp8"],
        "MXFP8 against bf16 on 4 GPUs: +21% throughput", "speedup", 1.21,
        "OLMo-core 3's MoE release", "OLMoE 1B-7B on 4 B300s, 4-way expert parallelism (16 experts a GPU), "
        "4096-token sequences, 1 a micro-step: the release does not name its model on 4 GPUs (its peak memory, "
        "103 -> 95 GiB, says a model of this order)", compare_to="bf16-b300x4"),
    Row("bf16-b300x4", "olmoe_1b_7b", "gpu:b300x4", OLMOE_B300X4,
        "(the bf16 reference of the row above)", "tokens_per_device", None, "", "as above, bf16"),
    Row("moe1t", "olmo_moe_1t", "gpu:b300x512", [],
        "up to 858 TFLOP/s per GPU (1.2T MoE, 58B active, 512 GPUs)", "tflops_per_device", 858.0,
        "OLMo-core 3's MoE release (its capacity test)",
        "64 hosts of 8 B300s in the preset's gpu:b300x512 layout (`olmax tune`'s best: 2 stages, circular at 8 chunks "
        "a stage, 64-way expert parallelism x 4-way FSDP, ZeRO-1), random routing (the capacity test's); the "
        "release's parallel layout is not published"),
]


def predict_row(row: Row) -> dict:
    from olmax.config import load_config
    from olmax.errors import DoesNotFit
    from olmax.scale.compile import compile_train_step
    from olmax.scale.targets import aot_missing, parse_target

    target = parse_target(row.target)
    if reason := aot_missing(target.platform):
        return {"row": row.name, "error": reason}
    cfg = load_config(row.config, row.overrides, target.name)
    start = time.perf_counter()
    try:
        report = compile_train_step(cfg, target, progress=lambda line: print(f"  {row.name}: {line}", file=sys.stderr,
                                                                              flush=True))
        fits = True
    except DoesNotFit as err:
        report, fits = err.report, False
    prediction = report.get("step_time")
    if prediction is None:
        return {"row": row.name, "error": f"does not fit and did not compile: {report.get('compiler_error')}"}
    seq = cfg.data.sequence_length
    tokens = cfg.train.global_batch_instances * seq
    step = prediction["step_seconds"]
    plan = report["plan"]
    return {
        "row": row.name, "config": row.config, "target": row.target, "overrides": row.overrides, "fits": fits,
        "peak_gib": report["peak"] / 2**30, "compile_seconds": report["compile_seconds"],
        "cached": report.get("compile_cached"), "wall_seconds": time.perf_counter() - start,
        "step_seconds": step, "mfu": prediction["mfu"], "mfu_all_global": prediction["mfu_all_global"],
        "tflops_per_device": plan["all_global"]["tflop_per_device_step"] / step,
        "tokens_per_device": tokens / step / target.devices,
        "chip_seconds": step * target.chips,
        "seconds": prediction["seconds"], "collectives": prediction["collectives"],
        "loops": prediction["loops"], "warnings": prediction["warnings"], "costliest": prediction["costliest"],
        "libtpu_estimate": prediction.get("libtpu_estimate"), "step_range": prediction.get("step_range"),
        "kernel_range": prediction.get("kernel_range"),
    }


def step_range(result: dict) -> str:
    """A prediction's range where its two predictions give steps more than 10% apart (the step and the MFU, every
    layer global, at each end), and which the point figure follows; empty where it has none. On a TPU: libtpu's
    estimate and the roofline; on a GPU: the grouped kernels' tiles re-read from L2 at cuBLAS's rate, or loaded
    from HBM at their designs' rates."""
    if not result.get("step_range"):
        return ""
    low, high = result["step_range"]
    flops = result["mfu_all_global"] * result["step_seconds"]
    ends = ("the point figure is libtpu's estimate, the range's other end the roofline" if result.get("libtpu_estimate")
            else "the point figure has the grouped kernels' re-reads from L2 at cuBLAS's rate, the other end every "
                 "tile load from HBM at their designs' rates")
    return f" (range {low:.3g}-{high:.3g} s, {flops / high:.1%}-{flops / low:.1%}: {ends})"


def compare(row: Row, result: dict, by_name: dict) -> tuple[float | None, str]:
    """(the prediction in the published figure's measure, how it reads against the published figure)."""
    if "error" in result:
        return None, result["error"]
    measure = row.measure
    base = by_name.get(row.compare_to or row.extra.get("inverse_of"))
    if measure in ("speedup", "slowdown", "tflops_delta", "mfu_delta"):
        if base is None or "error" in base:
            return None, "its reference row did not predict"
        if measure == "speedup":
            value = base["step_seconds"] / result["step_seconds"]
        elif measure == "slowdown":  # the bigger model's step against the smaller's, per token
            value = base["step_seconds"] / result["step_seconds"] - 1
        elif measure == "tflops_delta":
            value = result["tflops_per_device"] - base["tflops_per_device"]
        else:
            value = result["mfu_all_global"] - base["mfu_all_global"]
    else:
        value = result[measure]
    if row.value is None:
        return value, "reference"
    if measure in ("mfu_all_global", "tokens_per_device", "tflops_per_device") and result.get("step_range"):
        # a rate: at the range's ends, the point figure's rate times its step over theirs
        ends = [value * result["step_seconds"] / end for end in result["step_range"]]
        inside = "inside" if min(ends) <= row.value <= max(ends) else "outside"
        return value, f"{value / row.value - 1:+.1%}; the published figure {inside} the range"
    if measure in ("mfu_all_global", "tokens_per_device", "tflops_per_device", "speedup"):
        return value, f"{value / row.value - 1:+.1%}"
    if measure == "tflops_delta":
        return value, "sign and size right" if abs(value) <= 1.5 else f"{value:+.1f} TFLOP/s: outside 1.5"
    if measure == "mfu_delta":
        return value, "sign right" if value < 0 else "sign wrong"
    return value, "under 5%: right" if value < 0.05 else f"{value:.1%}: not under 5%"


FORMATS = {"mfu_all_global": lambda v: f"{v:.1%} MFU", "tokens_per_device": lambda v: f"{v:,.0f} tokens/s",
           "tflops_per_device": lambda v: f"{v:,.0f} TFLOP/s", "speedup": lambda v: f"{v:.3f}x",
           "slowdown": lambda v: f"{v:+.1%}", "tflops_delta": lambda v: f"{v:+.1f} TFLOP/s",
           "mfu_delta": lambda v: f"{v:+.1%} MFU"}


def markdown(rows: list[Row], results: dict) -> str:
    from olmax.scale import step_time

    lines = ["| row | config, target | published | predicted | against it | predicted step, MFU (all global) | "
             "fits (peak GiB) | assumed |", "| --- | --- | --- | ---: | --- | ---: | --- | --- |"]
    for row in rows:
        result = results[row.name]
        value, verdict = compare(row, result, results)
        shown = FORMATS[row.measure](value) if value is not None else "-"
        step = (f"{result['step_seconds']:.3g} s, {result['mfu_all_global']:.1%}{step_range(result)}"
                if "step_seconds" in result else "-")
        fits = (f"{'yes' if result['fits'] else 'no'} ({result['peak_gib']:.1f})" if "fits" in result else "-")
        lines.append(f"| {row.name} | `{row.config}` {' '.join(row.overrides)} on `{row.target}` | {row.published} | "
                     f"{shown} | {verdict} | {step} | {fits} | {row.assumed} |")
    lines.append("")
    for row in rows:  # what each prediction assumed and could not count
        for note in step_time.notes(results[row.name]) if "step_seconds" in results[row.name] else []:
            lines.append(f"- {row.name}: {note}")
    return "\n".join(lines)


def derive_constants() -> None:
    """The matmul efficiencies' derivations: libtpu's estimated cycles for the 7B's MLP matmul on v5p."""
    import re

    import jax
    import jax.numpy as jnp

    from olmax.scale.targets import ACCELERATORS, compile_only_devices, gemm_table, parse_target

    target = parse_target("tpu:v5p:2x2x1")
    device = compile_only_devices(target)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((32768, 4096), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((4096, 11008), jnp.bfloat16, sharding=sharding)
    text = jax.jit(jnp.matmul).trace(x, w).lower().compile().as_text()
    cycles = max(int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', text))
    peak = ACCELERATORS["v5p"].peak_flops_per_chip
    clock = peak / (2 * 4 * 128 * 128 * 2)  # 2 TensorCores x 4 MXUs of 128 x 128, 2 FLOP a multiply-add
    flops = 2 * 32768 * 4096 * 11008
    print(f"v5p: libtpu estimates the 32768 x 4096 x 11008 bf16 matmul at {cycles:,} cycles = "
          f"{cycles / clock * 1e3:.2f} ms at {clock / 1e9:.3f} GHz; {flops / (cycles / clock) / peak:.1%} of peak")
    table = gemm_table()
    for architecture, kind in (("sm_90", "h100"), ("sm_100", "b200")):
        rate, small = table[architecture]["bf16"][-1][-1][-1], table[architecture]["bf16"][0][2][-1]
        peak = ACCELERATORS[kind].peak_flops_per_chip / 1e12
        print(f"{architecture} ({kind}): XLA's GEMM table, bf16 4096^3: {rate:,.0f} TFLOP/s of {peak:,.0f} = "
              f"{rate / peak:.1%}; 256 x 1024 x 4096: {small:,.0f} = {small / peak:.1%}")
    print(f"(the table: {table['source']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", choices=[r.name for r in ROWS], help="only these rows (and their references)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", action="store_true", help="print BENCHMARKS.md's table")
    parser.add_argument("--constants", action="store_true", help="derive the matmul efficiencies again and stop")
    parser.add_argument("--config", help="predict this config instead of the table (with --target and overrides)")
    parser.add_argument("--target", help="the target of --config")
    parser.add_argument("overrides", nargs="*", help="key=value for --config")
    args = parser.parse_args()
    if args.constants:
        derive_constants()
        return
    if args.config:
        result = predict_row(Row("own", args.config, args.target, args.overrides, "", "mfu_all_global", None, ""))
        print(json.dumps(result, indent=2))
        sys.exit(0 if "error" not in result else 1)
    wanted = set(args.rows or [r.name for r in ROWS])
    for row in ROWS:  # a comparison needs its reference
        if row.name in wanted and (row.compare_to or row.extra.get("inverse_of")):
            wanted.add(row.compare_to or row.extra["inverse_of"])
    rows = [r for r in ROWS if r.name in wanted]
    results = {}
    for row in rows:
        print(f"{row.name}: {row.config} {' '.join(row.overrides)} on {row.target}", file=sys.stderr, flush=True)
        results[row.name] = predict_row(row)
        print(json.dumps(results[row.name]), file=sys.stderr, flush=True)
    for row in rows:
        value, verdict = compare(row, results[row.name], results)
        shown = FORMATS[row.measure](value) if value is not None else "-"
        print(f"{row.name:16} published {row.published:60.60} predicted {shown:>18}  {verdict}"
              f"{step_range(results[row.name])}")
    if args.markdown:
        print(markdown(rows, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [r.__dict__ for r in rows], "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
