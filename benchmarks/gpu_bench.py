"""Train-step throughput and attention on one GPU: the Python half of benchmarks/gpu.sh.

    python benchmarks/gpu_bench.py check [--out FILE]
    python benchmarks/gpu_bench.py step --shape cpu|7b-slice [--steps 5] [--out FILE] [key=value ...]
    python benchmarks/gpu_bench.py attention [--seq 8192] [--implementation cudnn] [--out FILE]
    python benchmarks/gpu_bench.py experts [--steps 10] [--out FILE]
    python benchmarks/gpu_bench.py moe-layer [--experts 16] [--steps 5] [--out FILE]

`step` times olmax's train step (the function `olmax train` runs) at the CPU benchmark's shape
(benchmarks/train_throughput.py) or at a slice of the OLMo 3 7B shape (4 layers at d 4096, 4 x 8192
tokens, the recipe's remat), in bf16, with the attention `auto` picks (cuDNN on a GPU). `attention`
compares olmax's cuDNN attention (model/attention/cudnn.py; `--implementation xla` makes the same
`jax.nn.dot_product_attention` call without cuDNN) with olmax's blocked XLA attention on 7B-shaped
heads, sliding (4096 keys) and global, forward and gradients, and times both. MFU is against the
H200's dense bf16 peak, 989 TFLOP/s (NVIDIA's H200 datasheet); FLOPs from olmax.model.flops. `step` also gives
the step time the step-time model predicts from the compiled step for the device it runs on (its datasheet
constants from olmax.scale.targets; on a CPU, the CPU measured now), beside the measured one: the first
accelerator this runs on checks the model. `experts` times the experts' grouped-matmul kernels
(olmax.model.moe.kernels, impl.moe.dispatch=grouped) against the block loop and lax.ragged_dot on one GPU's
share of the 47B's experts; `moe-layer` a 47B-shaped MoE layer's step per dispatch, measured and predicted.
`check` runs the check a run makes before it trusts the grouped kernels (olmax.model.moe.selfcheck: against
lax.ragged_dot in float32) for every product the experts can run on this GPU, and gives each one's largest
errors against float64 (numpy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import load_config
from olmax.model import flops
from olmax.model.attention import cudnn
from olmax.model.attention.xla import attention as blocked_attention
from olmax.parallel.mesh import make_layout
from olmax.train.step import create_state, jit_train_step

PEAK_FLOPS = 989e12
SHAPES = {
    "cpu": ("tiny", [
        "model.vocab_size=8192", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8",
        "model.mlp_hidden=1536", "model.sliding_window=256", "data.sequence_length=1024",
        "train.global_batch_instances=4", "data.eos_id=0", "data.pad_id=1", "impl.attention.block=128",
    ]),
    "7b-slice": ("olmo3_7b", ["model.n_layers=4", "train.global_batch_instances=4", "impl.attention.block=512"]),
}


def timed(fn, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def peak_device_memory() -> int | None:
    stats = jax.devices()[0].memory_stats()  # None on CPU
    return stats and stats.get("peak_bytes_in_use")


def step_benchmark(shape: str, steps: int, overrides: list[str] = ()) -> dict:
    preset, shape_overrides = SHAPES[shape]
    fixed = ["train.micro_batch_per_device=null", "mesh.fsdp=1", "impl.compute_dtype=bfloat16"]
    cfg = load_config(preset, [*shape_overrides, *fixed, *overrides])
    layout = make_layout(cfg.mesh, jax.devices()[:1])
    rows, seq = cfg.train.global_batch_instances, cfg.data.sequence_length
    tokens = np.random.default_rng(0).integers(2, cfg.model.vocab_size, (1, rows, seq)).astype(np.int32)
    batch = {"input_ids": tokens, "instance_mask": np.ones((1, rows), bool)}
    state = [create_state(cfg, layout, jax.random.key(0))]
    step = jit_train_step(cfg, layout, rows)

    def one():
        state[0], metrics = step(state[0], batch)
        jax.block_until_ready(metrics)

    start = time.perf_counter()
    one()
    first = time.perf_counter() - start  # compile + one step
    predicted = predicted_step(cfg, step.lower(state[0], batch).compile().as_text())
    times = timed(one, 1, steps)
    step_s = statistics.median(times)
    per_token = flops.count(cfg.model, seq)
    tps = rows * seq / step_s
    return {
        "shape": shape, "overrides": [*shape_overrides, *fixed, *overrides], "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "params": per_token.params, "tokens_per_step": rows * seq,
        "first_step_s": first, "step_s": times, "median_step_s": step_s, "tokens_per_s": tps,
        "mfu_exact_window": tps * per_token.per_token / PEAK_FLOPS,
        "mfu_all_global": tps * per_token.per_token_all_global / PEAK_FLOPS,
        "peak_device_memory_bytes": peak_device_memory(), **predicted,
    }


def predicted_step(cfg, text: str) -> dict:
    """The step-time model's prediction for this device: a GPU by its datasheet row, a CPU measured now."""
    from olmax.scale import hardware, op_cost, step_time
    from olmax.scale.targets import parse_target, running_target

    name = running_target(jax.devices()[:1])
    device = hardware.target_hardware(parse_target(name)) if name else hardware.measure_cpu()
    windows = {kind: (cfg.model.sliding_window if kind == "sliding" else None) for kind in set(cfg.model.layer_pattern)}
    block = 128 if name else cfg.impl.attention.block  # cuDNN's tiles on a GPU, olmax's blocks on a CPU
    attention = op_cost.AttentionInfo(cfg.data.sequence_length, windows, block, block)
    prediction = step_time.predict(text, device, None, attention)
    return {"predicted_hardware": device.name, "predicted_step_s": prediction["step_seconds"],
            "predicted_seconds": prediction["seconds"]}


def attention_benchmark(seq: int, heads: int, kv_heads: int, head_dim: int, window: int | None, block: int,
                        implementation: str, steps: int, dtype=jnp.bfloat16) -> dict:
    """Forward and gradients of both attentions on the same random q, k, v; their largest differences and times."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (1, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (1, seq, kv_heads, head_dim), dtype)
    cotangent = jax.random.normal(keys[3], q.shape, dtype)

    def loss_and_grads(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent.astype(jnp.float32))  # noqa: E731
        return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))

    scale = jnp.asarray(head_dim**-0.5, dtype)  # olmax's block scales q before its attention
    ours = loss_and_grads(lambda q, k, v: blocked_attention(q * scale, k, v, window=window, block=block))
    theirs = loss_and_grads(lambda q, k, v: cudnn.attention(q * scale, k, v, window=window,
                                                            implementation=implementation))
    out_a, grads_a = ours(q, k, v)
    out_b, grads_b = theirs(q, k, v)

    def max_diff(a, b):
        return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

    attended = flops.attended_positions(seq, window)
    train_flops = 12 * heads * head_dim * attended * seq  # forward + backward, as olmax.model.flops counts it
    report = {"seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "window": window,
              "implementation": implementation, "dtype": jnp.dtype(dtype).name,
              "max_abs_diff_out": max_diff(out_a, out_b),
              "max_abs_diff_grads": [max_diff(a, b) for a, b in zip(grads_a, grads_b)],
              "max_abs_out": float(jnp.max(jnp.abs(out_a.astype(jnp.float32))))}
    for name, fn in (("xla_blocked", ours), (implementation, theirs)):
        step_s = statistics.median(timed(lambda: jax.block_until_ready(fn(q, k, v)), 1, steps))
        report[name] = {"median_s": step_s, "tflops": train_flops / step_s / 1e12,
                        "fraction_of_peak": train_flops / step_s / PEAK_FLOPS}
    return report


EXPERT_SHAPE = dict(rows=8192 * 4, d=3584, f=1024, groups=16)  # the 47B's experts on one of 8 GPUs: 16 resident


def _interpreted(interpret: bool):
    """Pallas' GPU interpreter around a call where `interpret` (the CPU checks of this script), else nothing."""
    if not interpret:
        return contextlib.nullcontext()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
    return force_gpu_interpret_mode(InterpretGPUParams())


def experts_benchmark(rows: int, d: int, f: int, groups: int, steps: int, chip=None, interpret: bool = False) -> dict:
    """One expert matmul, x [rows, d] times w[g] [d, f] for `groups` groups of random (multinomial) sizes, forward
    and forward + both gradients, by the grouped kernels (impl.moe.dispatch=grouped, for `chip`, default this
    GPU's), the block loop (blocks) and lax.ragged_dot; times and the largest differences from the block loop."""
    from olmax.model.moe import block_loop
    from olmax.model.moe.kernels import grouped
    from olmax.model.moe.kernels.chip import Chip

    chip = chip or Chip.of(jax.devices()[0])
    keys = jax.random.split(jax.random.key(0), 4)
    sizes = np.random.default_rng(0).multinomial(rows, np.ones(groups) / groups)
    block = chip.block
    blocks = -(-sizes // block)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(blocks)]), jnp.int32)
    padded = int(blocks.sum()) * block
    used = np.zeros(padded, bool)
    for g in range(groups):
        used[int(starts[g]) * block:][: sizes[g]] = True
    x = jnp.where(jnp.asarray(used)[:, None], jax.random.normal(keys[0], (padded, d), jnp.bfloat16), 0)
    w = (jax.random.normal(keys[1], (groups, d, f)) * d**-0.5).astype(jnp.bfloat16)
    cotangent = jnp.where(jnp.asarray(used)[:, None], jax.random.normal(keys[2], (padded, f), jnp.bfloat16), 0)
    order = jnp.argsort(~jnp.asarray(used), stable=True)  # ragged_dot's rows: the groups' rows packed
    counts = jnp.asarray(sizes, jnp.int32)
    products = {
        "grouped": lambda x, w: grouped.matmul(x, w, starts, block, chip),
        "blocks": lambda x, w: block_loop.matmul(x, w, starts, block),
        "ragged_dot": lambda x, w: jnp.take(jax.lax.ragged_dot(x[order], w, counts), jnp.argsort(order), axis=0),
    }
    train_flops = 3 * 2 * rows * d * f
    report = {"rows": rows, "d": d, "f": f, "groups": groups, "group_sizes": sizes.tolist(), "chip": str(chip)}
    results = {}
    for name, product in products.items():
        forward = jax.jit(product)
        train = jax.jit(lambda x, w, product=product: jax.vjp(product, x, w)[1](cotangent))
        with _interpreted(interpret and name == "grouped"):
            results[name] = (forward(x, w), train(x, w))
            report[name] = {
                "forward_s": statistics.median(timed(lambda: jax.block_until_ready(forward(x, w)), 1, steps)),
                "train_s": statistics.median(timed(lambda: jax.block_until_ready(train(x, w)), 1, steps))}
        report[name]["train_tflops"] = train_flops / report[name]["train_s"] / 1e12

    def max_diff(a, b):
        return max(float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
                   for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    for name in ("grouped", "ragged_dot"):
        report[name]["max_abs_diff_from_blocks"] = max_diff(results[name], results["blocks"])
    return report


def kernel_checks(products: dict, chip, dtypes=(jnp.bfloat16, jnp.float32)) -> dict:
    """Each of `products` (name: product with grouped.matmul's arguments, on the layout of `chip`'s blocks) in each
    dtype: the run's check's verdict ("passed" or its line) on its problem for `chip`, and the largest errors of y,
    dx and dw against float64, each a fraction of the reference's largest value."""
    from olmax.model.moe import selfcheck

    report, shape = {}, selfcheck.Shape.of(chip)
    for name, product in products.items():
        for dtype in map(jnp.dtype, dtypes):
            line = selfcheck.verdict(product, name, dtype, chip.block, shape)
            try:
                found = selfcheck.errors(product, dtype, chip.block, shape, selfcheck.float64)
            except Exception as e:  # the verdict says what it raised
                found = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"}
            report[f"{name} {dtype.name}"] = {"verdict": line or "passed", "error_vs_float64": found}
            print(f"{name} {dtype.name}: {line or 'passed'}; against float64 {found}", file=sys.stderr)
    return report


def moe_layer_benchmark(tokens: int, d: int, f: int, experts: int, top_k: int, dispatches: list[str],
                        steps: int) -> dict:
    """A 47B-shaped MoE layer on one GPU (by default its share under 8-way expert parallelism: 16 experts, 8192
    tokens, top-4), forward and gradients for each dispatch: measured, and predicted by the step-time model
    from the compiled program (for this GPU by its datasheet row, a CPU measured now)."""
    from olmax.config import MoEConfig
    from olmax.model import kernel_work
    from olmax.model.moe import block_loop, sublayer
    from olmax.model.moe.kernels.chip import Chip
    from olmax.parallel import moe_sizing
    from olmax.scale import hardware, op_cost, step_time
    from olmax.scale.targets import parse_target, running_target

    cfg = MoEConfig(num_experts=experts, top_k=top_k, expert_hidden=f)
    keys = jax.random.split(jax.random.key(0), 3)
    p = {"router": jax.random.normal(keys[0], (d, experts)) * 0.02,
         **{name: jax.random.normal(k, shape) * 0.02 for name, k, shape in
            (("w1", keys[1], (experts, d, f)), ("w3", keys[2], (experts, d, f)), ("w2", keys[0], (experts, f, d)))}}
    x = jax.random.normal(keys[1], (1, tokens, d), jnp.bfloat16)
    name = running_target(jax.devices()[:1])
    device = hardware.target_hardware(parse_target(name)) if name else hardware.measure_cpu()
    chip = Chip.of(jax.devices()[0]) if jax.default_backend() == "gpu" else None
    report = {"tokens": tokens, "d": d, "f": f, "experts": experts, "top_k": top_k, "predicted_hardware": device.name}
    for dispatch in dispatches:
        def loss(p, x, dispatch=dispatch):
            out, aux = sublayer.moe_mlp(cfg, p, x, dispatch=dispatch, chip=chip)
            return jnp.sum(out.astype(jnp.float32)) + aux["load_balancing_loss"]

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        compiled = step.lower(p, x).compile()
        rows = tokens * top_k / experts
        block = chip.block if dispatch == "grouped" else moe_sizing.auto_block_size(tokens * top_k, experts)
        loops = op_cost.ExpertBlocks(rows, block, cfg.routing, block_loop.BLOCK_LOOP,
                                     routed=kernel_work.RoutedRows(experts, top_k, 1, tokens))
        predicted = step_time.predict(compiled.as_text(), device, None, None, experts=loops)
        measured = statistics.median(timed(lambda: jax.block_until_ready(compiled(p, x)), 1, steps))
        report[dispatch] = {"measured_s": measured, "predicted_s": predicted["step_seconds"],
                            "predicted_ops": predicted["executed_ops"], "warnings": predicted["warnings"]}
    return report


def experts_prediction(target: str, dispatch: str, rows: int, routed: int, d: int, f: int, groups: int) -> dict:
    """The step-time model's prediction for one GPU of `target` of what one MoE layer's experts do there a
    micro-step under expert parallelism, forward and both gradients: `rows` received after the all-to-all (the
    buffer), `routed` of them to its `groups` resident experts (balanced), the rest to none. Compiled for the
    target's device without the hardware (a GPU generation a process: Mosaic GPU's compiler keeps the first)."""
    from olmax.model import kernel_work
    from olmax.model.moe import block_loop
    from olmax.model.moe.experts import grouped_swiglu
    from olmax.model.moe.kernels import grouped
    from olmax.model.moe.kernels.chip import Chip
    from olmax.parallel import moe_sizing
    from olmax.scale import hardware, op_cost, step_time
    from olmax.scale.targets import compile_only_devices, parse_target

    device = compile_only_devices(parse_target(target))[0]
    chip = Chip.of(device)
    block = chip.block if dispatch == "grouped" else moe_sizing.auto_block_size(rows, groups)
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = {"x": (rows, d), "w1": (groups, d, f), "w3": (groups, d, f), "w2": (groups, f, d)}
    args = {k: jax.ShapeDtypeStruct(v, jnp.bfloat16, sharding=sharding) for k, v in spec.items()}
    ids = jax.ShapeDtypeStruct((rows, 1), jnp.int32, sharding=sharding)

    def loss(p, ids):
        product = (lambda a, w, starts, b: grouped.matmul(a, w, starts, b, chip)) if dispatch == "grouped" else None
        y = grouped_swiglu(p["x"], ids, p["w1"], p["w3"], p["w2"], dispatch="blocks", block=block, product=product)
        return jnp.sum(y.astype(jnp.float32))

    text = jax.jit(jax.grad(loss)).lower(args, ids).compile().as_text()
    # its `routed` rows spread over its experts as routing spreads them (one assignment each)
    loops = op_cost.ExpertBlocks(routed / groups, block, "balanced", block_loop.BLOCK_LOOP,
                                 routed=kernel_work.RoutedRows(groups, 1, 1, routed))
    predicted = step_time.predict(text, hardware.target_hardware(parse_target(target)), None, None, experts=loops)
    return {"target": target, "dispatch": dispatch, "rows": rows, "routed": routed, "d": d, "f": f, "groups": groups,
            "block": block, "predicted_s": predicted["step_seconds"], "ops": predicted["executed_ops"],
            "seconds": predicted["seconds"], "warnings": predicted["warnings"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    check = sub.add_parser("check")
    step = sub.add_parser("step")
    step.add_argument("--shape", choices=SHAPES, required=True)
    step.add_argument("--steps", type=int, default=5)
    step.add_argument("overrides", nargs="*")
    attention = sub.add_parser("attention")
    attention.add_argument("--seq", type=int, default=8192)
    attention.add_argument("--implementation", default="cudnn", help="cudnn, or xla (the same call without cuDNN)")
    attention.add_argument("--steps", type=int, default=5)
    experts = sub.add_parser("experts")
    experts.add_argument("--steps", type=int, default=10)
    layer = sub.add_parser("moe-layer")
    layer.add_argument("--steps", type=int, default=5)
    layer.add_argument("--experts", type=int, default=16)
    predict = sub.add_parser("predict-experts", help="no GPU needed: the step-time model's prediction")
    predict.add_argument("--target", required=True)
    predict.add_argument("--dispatch", default="grouped")
    predict.add_argument("--experts", type=int, default=128, help="the model's experts (8 GPUs hold them)")
    for p in (check, step, attention, experts, layer, predict):
        p.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    if args.what == "step":
        report = step_benchmark(args.shape, args.steps, args.overrides)
        print(f"step-time model on {report['predicted_hardware']}: predicted {report['predicted_step_s']:.4g} s, "
              f"measured {report['median_step_s']:.4g} s ({report['predicted_step_s'] / report['median_step_s'] - 1:+.1%})",
              file=sys.stderr)
    elif args.what == "check":  # the kernels of this GPU, then the block loop they fall back to
        from olmax.model.moe import block_loop, selfcheck
        from olmax.model.moe.kernels import grouped
        from olmax.model.moe.kernels.chip import Chip

        chip = Chip.of(jax.devices()[0])
        report = kernel_checks({selfcheck.kernel_name(chip): lambda x, w, s, b: grouped.matmul(x, w, s, b, chip),
                                "block loop": lambda x, w, s, b: block_loop.matmul(x, w, s, b)}, chip)
    elif args.what == "experts":
        report = experts_benchmark(**EXPERT_SHAPE, steps=args.steps)
    elif args.what == "predict-experts":  # the 47B preset's layout: 8-way EP, 8192 tokens a GPU, capacity 1.25
        received = 8 * -(-int(1.25 * 8192 * 4) // 8)
        report = experts_prediction(args.target, args.dispatch, received, 8192 * 4, EXPERT_SHAPE["d"],
                                    EXPERT_SHAPE["f"], args.experts // 8)
    elif args.what == "moe-layer":
        report = moe_layer_benchmark(8192, EXPERT_SHAPE["d"], EXPERT_SHAPE["f"], args.experts, 4,
                                     ["grouped", "blocks"], args.steps)
    else:  # OLMo 3 7B heads: 32 x 128, sliding layers see 4096 keys
        report = [attention_benchmark(args.seq, 32, 32, 128, window, 512, args.implementation, args.steps)
                  for window in (4096, None)]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
