"""Ahead-of-time compilation of the real train step for a TPU slice or a GPU host, on any machine.

The step is `olmax.train.step.jit_train_step`, the function `olmax train` runs, built over a mesh of the
target's compile-only devices with the config's mesh, remat and micro-batch; its inputs are shapes
with shardings, so nothing is allocated. XLA's buffer assignment then says what one device holds at
its peak. The TPU compiler refuses a program whose peak exceeds the chip's HBM (its message gives the
figures); the GPU compiler does not check, so the peak is compared with the GPU's memory here.

FLOPs come from olmax's own count, not from XLA's cost analysis, which counts a scanned layer body
once and does not see into Pallas kernels. The report also counts what the compiled program runs: its
attention kernels (Splash, cuDNN; Splash's tiles), the experts' grouped matmul kernels (`ragged-dot-*` on TPU,
where `impl.moe.dispatch` auto takes ragged_dot; olmax's Mosaic GPU kernels by name), its matmuls with float8
operands (impl.fp8) and the collectives run on the SparseCores. The compiler gets the target's XLA flag profile
(`targets.XLA_FLAGS`) as compile options.
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import time

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # its options as context managers (the public jax.config has none)
from jax.experimental.compilation_cache import compilation_cache

from olmax.config import RunConfig
from olmax.errors import DoesNotFit
from olmax.model import attention, fp8, kernel_work, transformer
from olmax.model.moe import block_loop, sublayer
from olmax.parallel import expert as expert_parallel
from olmax.parallel import moe_sizing
from olmax.parallel.schedules import schedule_for
from olmax.parallel.mesh import Layout, make_layout
from olmax.scale import anatomy, compile_cache, hardware, op_cost, step_time
from olmax.scale.plan import plan
from olmax.scale.targets import GiB, Target, check_mesh, compile_only_devices
from olmax.train.step import abstract_state, batch_shardings, jit_train_step, micro_batch_rows


def device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded shapes (the largest shard: uneven splits round up)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def abstract_inputs(cfg: RunConfig, layout: Layout, micro_rows: int):
    state = abstract_state(cfg, layout)
    seq, micro_steps = cfg.data.sequence_length, cfg.train.global_batch_instances // micro_rows
    sharding = batch_shardings(layout, seq, micro_rows)
    batch = {
        "input_ids": jax.ShapeDtypeStruct((micro_steps, micro_rows, seq), jnp.int32, sharding=sharding["input_ids"]),
        "instance_mask": jax.ShapeDtypeStruct((micro_steps, micro_rows), jnp.bool_, sharding=sharding["instance_mask"]),
    }
    return state, batch


def _hbm_figures(message: str) -> dict:
    """The TPU compiler's out-of-memory figures, in bytes: what the program needs and what the device has."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    found = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", message)
    if not found:
        return {}
    need, need_unit, have, have_unit = found.groups()
    return {"required": round(float(need) * units[need_unit]), "compiler_memory": round(float(have) * units[have_unit])}


def program_ops(text: str) -> dict:
    """What a program (its HLO text) runs: matmuls (dots; convolutions on TPU), those of them with
    float8 operands, the MXFP8 ones (cuDNN's block-scaled GEMMs, impl.fp8=mxfp8 on a GPU of compute
    capability 10.x), and the custom calls by kernel (Pallas kernels by name, the rest by target)."""
    types = dict(re.findall(r"(%?[\w.-]+) = (\w+)\[", text))
    matmuls = re.findall(r" (?:dot|convolution)\((%?[\w.-]+), (%?[\w.-]+)\)", text)
    calls = collections.Counter()
    for name, target, rest in re.findall(r"%([\w.-]+) = .* custom-call\(.*custom_call_target=\"([^\"]+)\"(.*)", text):
        if target == "tpu_custom_call":
            target = re.sub(r"\.\d+$", "", name)
        elif kernel := re.search(r'op_name="[^"]*?([^/"]+)/mpmd_map"', rest):  # a Mosaic GPU kernel, by its name
            target = f"{target} {kernel.group(1)}"
        calls[target] += 1
    return {
        "matmuls": len(matmuls),
        "float8_matmuls": sum(any(types.get(o, "").startswith("f8") for o in pair) for pair in matmuls),
        "mxfp8_matmuls": calls["__cudnn$blockScaledDot"],
        "custom_calls": dict(sorted(calls.items())),
        # collectives the TPU compiler moved onto the SparseCores (async calls on their thread)
        "sparsecore_collectives": len(re.findall(r" call-start\(.*async_execution_thread=\"sparsecore\"", text)),
    }


def _attention_tiles(cfg: RunConfig, layout: Layout) -> dict | None:
    """Splash's tiles: tokens per query and key tile, each tile `head_dim` wide (the kernels' last dimension)."""
    if attention.implementation(cfg.impl, layout, cfg.data.sequence_length) != "splash":
        return None
    return {**attention.splash_blocks(cfg.impl, cfg.data.sequence_length).model_dump(), "head_dim": cfg.model.head_size}


def xla_cost(compiled) -> dict:
    """XLA's cost analysis of the compiled program, per device: FLOPs and HBM bytes accessed. It counts a
    scanned or looped body once and a kernel (custom call) not at all: a figure to compare like with like
    (the same config with one setting changed), not a count of the step's work."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}


def attention_info(cfg: RunConfig, layout: Layout) -> op_cost.AttentionInfo:
    """What the step-time model needs to know of the attention kernels: each layer kind's window, Splash's tiles
    (cuDNN's kernels are costed at 128-token tiles, their own)."""
    seq = cfg.data.sequence_length
    windows = {kind: (cfg.model.sliding_window if kind == "sliding" else None) for kind in set(cfg.model.layer_pattern)}
    tiles = _attention_tiles(cfg, layout)
    if tiles:
        return op_cost.AttentionInfo(seq, windows, tiles["block_q"], tiles["block_kv"])
    return op_cost.AttentionInfo(seq, windows, 128, 128)


def expert_rows(cfg: RunConfig, layout: Layout, micro_rows: int) -> moe_sizing.LayerRows:
    """An MoE layer's rows on one device of the layout (olmax.parallel.moe_sizing): a micro-step's, or with
    pipeline stages one pipeline micro-batch's."""
    sched = schedule_for(cfg)
    return moe_sizing.config_rows(cfg, layout.mesh.shape.get("expert", 1), micro_rows // layout.data_parallel_size,
                                  sched.microbatches if sched else 1)


def expert_blocks(cfg: RunConfig, layout: Layout, micro_rows: int) -> op_cost.ExpertBlocks | None:
    """What the step-time model needs to know of the experts' block loops (impl.moe.dispatch blocks) and of the
    grouped kernels, which run the rows routed: the rows each of a device's experts gets a micro-step under the
    routing's expectation (a device's tokens x top_k, spread evenly over the experts it holds; dropless, one
    part's of impl.moe.exchange_chunks), the block the model picks for them and the rows a ragged exchange sends
    (`expert_rows`); for the kernels, the routing's distribution of those rows over the experts and devices."""
    if cfg.model.mlp != "moe":
        return None
    rows = expert_rows(cfg, layout, micro_rows)
    block = rows.block(cfg.impl.moe.block, fp8.MX_BLOCK if cfg.impl.fp8 == "mxfp8" else 16)
    return op_cost.ExpertBlocks(rows.rows_per_expert, block, cfg.model.moe.routing, block_loop.BLOCK_LOOP,
                                rows.exchanged, rows.routed, rows.slots, expert_parallel.OVERFLOW_SCOPE,
                                kernel_work.RoutedRows(rows.num_experts, rows.top_k, rows.ep, rows.tokens))


def expert_exchange(cfg: RunConfig, layout: Layout, micro_rows: int) -> dict | None:
    """What expert parallelism's exchange holds a layer on a device: the rows its receive buffer is sized for
    (dropless: the worst case, every token of the expert group, or impl.moe.ep_buffer's bound; with a capacity:
    the capacity of each peer) and their bytes in the compute dtype, and the rows the routing is expected to fill
    (`expert_rows`)."""
    if cfg.model.mlp != "moe" or layout.mesh.shape.get("expert", 1) == 1:
        return None
    rows, moe = expert_rows(cfg, layout, micro_rows), cfg.impl.moe
    if rows.capacity is not None:
        kind, expected = f"capacity {moe.ep_capacity:g} a peer (drops beyond it)", min(rows.received, rows.routed)
    else:
        kind, expected = "dropless, ragged", rows.exchanged
        if moe.ep_buffer is not None:
            kind = f"dropless, ragged, rounds of {moe.ep_buffer:g} x the {rows.routed:,} assignments expected"
    width = jnp.dtype(transformer.compute_dtype(cfg.impl, layout)).itemsize * cfg.model.d_model
    return {"kind": kind, "parts": moe.exchange_chunks if moe.ep_capacity is None else 1,
            "receive_rows": rows.received, "receive_bytes": rows.received * width, "expected_rows": expected}


def compiled_program(lowered, target: Target) -> dict:
    """The compiled program of `lowered` for `target`: its optimized HLO text, memory figures and compile time,
    from the compile cache when the same program was compiled for the same target, compiler flags and JAX before
    (an entry that cannot prove it is this program's, stored whole, with valid figures is compiled again, with a
    warning naming it: olmax.scale.compile_cache). A compile the compiler refuses for memory is cached too (its
    error); other failures raise."""
    key = compile_cache.key(lowered.as_text(), target)
    if (stored := compile_cache.lookup(key)) is not None:
        return {**stored, "cached": True}
    start = time.perf_counter()
    try:
        with _without_persistent_cache():
            compiled = lowered.compile(compiler_options=target.xla_flags or None)
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        result = {"compile_seconds": time.perf_counter() - start, "error": str(err)}
    else:
        memory = compiled.memory_analysis()
        result = {"compile_seconds": time.perf_counter() - start, "text": compiled.as_text(),
                  "peak": memory.peak_memory_in_bytes, "arguments": memory.argument_size_in_bytes,
                  "temporaries": memory.temp_size_in_bytes, "xla_cost": xla_cost(compiled)}
    compile_cache.store(key, result)
    return {**result, "cached": False}


def predicted_step(cfg: RunConfig, target: Target, layout: Layout, text: str) -> dict:
    """The step-time model's prediction for the compiled program `text` of this config on this target."""
    from olmax.model import flops

    seq = cfg.data.sequence_length
    count = flops.count(cfg.model, seq)
    tokens = cfg.train.global_batch_instances * seq
    coords = [c["at"] for c in anatomy.chip_grid(layout)]
    micro_rows = micro_batch_rows(cfg, layout.data_parallel_size)
    prediction = step_time.predict(text, hardware.target_hardware(target), coords, attention_info(cfg, layout),
                                   count.per_token * tokens / target.devices, expert_blocks(cfg, layout, micro_rows))
    prediction["mfu_all_global"] = count.per_token_all_global * tokens / target.devices / (
        prediction["step_seconds"] * prediction["constants"]["peak_flops_per_device"])
    return prediction


@contextlib.contextmanager
def _without_persistent_cache():
    """JAX's persistent compilation cache off for a compile-only executable, which cannot be loaded back from it
    (there is no client to load it into: JAX warned on every hit). JAX decides once per process whether it uses
    the cache, so the decision is reset on the way in and out."""
    with jax_config.enable_compilation_cache(False):
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            compilation_cache.reset_cache()


def compile_train_step(cfg: RunConfig, target: Target, mfu: float | None = None, progress=lambda line: None) -> dict:
    """Compile the step for `target` and report per-device memory, FLOPs, the step-time model's prediction, and
    the run's cost at that prediction (or at `mfu` where one is given); `progress` is told each phase (tracing,
    lowering, compiling) as it starts, with the time so far.

    Raises DoesNotFit (with the report) when the step needs more memory per device than the target has, and
    ConfigError before anything is compiled when the compile cache cannot be used (`compile_cache.usable_cache_dir`).
    """
    compile_cache.usable_cache_dir()  # refused before the compile it would keep
    check_mesh(cfg.mesh, target)
    start = time.perf_counter()
    progress(f"{cfg.name} for {target.name}: loading the target's devices")
    layout = make_layout(cfg.mesh, compile_only_devices(target))
    mesh = layout.mesh
    micro_rows = micro_batch_rows(cfg, layout.data_parallel_size)
    state, batch = abstract_inputs(cfg, layout, micro_rows)
    params, optimizer = device_bytes(state.params), device_bytes(state.opt_state)
    report = {
        "config": cfg.name,
        "target": target.name,
        "device_kind": mesh.devices.flat[0].device_kind,
        "devices": target.devices,
        "mesh": dict(mesh.shape),
        "instances_per_device_micro_step": micro_rows // layout.data_parallel_size,
        "micro_steps": cfg.train.global_batch_instances // micro_rows,
        "sequence_length": cfg.data.sequence_length,
        # `auto` settings as the model resolves them for the target's devices, not for this host
        "compute_dtype": jnp.dtype(transformer.compute_dtype(cfg.impl, layout)).name,
        "attention": attention.implementation(cfg.impl, layout, cfg.data.sequence_length),
        "attention_tiles": _attention_tiles(cfg, layout),
        "moe_dispatch": sublayer.dispatch_for_layout(cfg.model, cfg.impl, layout) if cfg.model.mlp == "moe" else None,
        "expert_exchange": expert_exchange(cfg, layout, micro_rows),
        "fp8": cfg.impl.fp8,
        "loss_chunk": cfg.impl.loss_chunk,
        "remat": cfg.impl.remat,
        "xla_flags": target.xla_flags,
        "memory_per_device": target.accelerator.memory_per_device,
        "parameters": params,
        "optimizer_state": optimizer,
        "batch": device_bytes(batch),
        "mesh_axes": anatomy.mesh_axes(layout),
        "chips": anatomy.chip_grid(layout),
        "parameter_table": anatomy.parameter_table(state.params),
        "saved_activations_estimate": anatomy.saved_activation_bytes(
            cfg, micro_rows // layout.data_parallel_size * cfg.data.sequence_length,
            jnp.dtype(transformer.compute_dtype(cfg.impl, layout)).itemsize),
    }
    progress(f"tracing the train step ({time.perf_counter() - start:.0f} s)")
    traced = jit_train_step(cfg, layout, micro_rows).trace(state, batch)
    progress(f"lowering ({time.perf_counter() - start:.0f} s)")
    lowered = traced.lower()
    progress(f"compiling ({time.perf_counter() - start:.0f} s)")
    result = compiled_program(lowered, target)
    report["compile_seconds"] = result["compile_seconds"]
    report["compile_cached"] = result["cached"]
    if "error" in result:
        report["compiler_error"] = result["error"].splitlines()[0]
        report.update(_hbm_figures(result["error"]))
        report["plan"] = plan(cfg, target, mfu)
        raise DoesNotFit(report["compiler_error"], report)
    text = result["text"]
    report["program"] = program_ops(text)
    report["collectives"] = anatomy.collectives(text, dict(mesh.shape))
    report["xla_cost"] = result["xla_cost"]
    report.update({
        # What the compiler's own out-of-memory check compares with the device: the most bytes live at
        # once, arguments included. The TPU compiler's temp_size can exceed it: not a figure to fit by.
        "peak": result["peak"],
        "arguments": result["arguments"],
        "temporaries": result["temporaries"],
        # The gradient is a float32 copy of the parameters, and the clip needs all of it at once.
        "gradients": params,
        **anatomy.program_memory(text),
    })
    report["step_time"] = predicted_step(cfg, target, layout, text)
    report["plan"] = plan(cfg, target, mfu, prediction=report["step_time"])
    report["memory_stack"] = anatomy.memory_stack(report)
    if report["peak"] > report["memory_per_device"]:
        raise DoesNotFit(
            f"peak {report['peak'] / GiB:.2f} GiB per device exceeds the {report['memory_per_device'] / GiB:.2f} GiB "
            f"of a {target.kind} device", report)
    return report
