"""Ahead-of-time compilation of the real train step for a TPU slice or a GPU host, on any machine.

The step is `olmax.train.step.jit_train_step`, the function `olmax train` runs, built over a mesh of the
target's compile-only devices with the config's mesh, remat and micro-batch; its inputs are shapes
with shardings, so nothing is allocated. XLA's buffer assignment then says what one device holds at
its peak. The TPU compiler refuses a program whose peak exceeds the chip's HBM (its message gives the
figures); the GPU compiler does not check, so the peak is compared with the GPU's memory here.

FLOPs come from olmax's own count, not from XLA's cost analysis, which counts a scanned layer body
once and does not see into Pallas kernels. The report also counts what the compiled program runs: its
attention kernels (Splash, cuDNN; Splash's tiles), the experts' grouped matmul kernels (`ragged-dot-*` on TPU,
where `impl.moe.dispatch` auto takes ragged_dot), its matmuls with float8 operands (impl.fp8) and the collectives
run on the SparseCores. The compiler gets the target's XLA flag profile (`targets.XLA_FLAGS`) as compile options.
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
from olmax.model import attention, transformer
from olmax.model.moe import sublayer
from olmax.parallel.mesh import Layout, make_layout, platform
from olmax.scale.plan import plan
from olmax.scale.targets import GiB, Target, compile_only_devices
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
    for name, target in re.findall(r"%([\w.-]+) = .* custom-call\(.*custom_call_target=\"([^\"]+)\"", text):
        calls[re.sub(r"\.\d+$", "", name) if target == "tpu_custom_call" else target] += 1
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


def compile_train_step(cfg: RunConfig, target: Target, mfu: float, progress=lambda line: None) -> dict:
    """Compile the step for `target` and report per-device memory, FLOPs and time at `mfu`; `progress` is told
    each phase (tracing, lowering, compiling) as it starts, with the time so far: a big model's compile runs
    for minutes.

    Raises DoesNotFit (with the report) when the step needs more memory per device than the target has.
    """
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
        "moe_dispatch": sublayer.dispatch_for(cfg.impl.moe.dispatch, platform(layout), cfg.mesh.stage) if cfg.model.mlp == "moe"
        else None,
        "fp8": cfg.impl.fp8,
        "loss_chunk": cfg.impl.loss_chunk,
        "remat": cfg.impl.remat,
        "xla_flags": target.xla_flags,
        "memory_per_device": target.accelerator.memory_per_device,
        "parameters": params,
        "optimizer_state": optimizer,
        "batch": device_bytes(batch),
        "plan": plan(cfg, target, mfu),
    }
    progress(f"tracing the train step ({time.perf_counter() - start:.0f} s)")
    traced = jit_train_step(cfg, layout, micro_rows).trace(state, batch)
    progress(f"lowering ({time.perf_counter() - start:.0f} s)")
    lowered = traced.lower()
    progress(f"compiling ({time.perf_counter() - start:.0f} s)")
    start = time.perf_counter()
    try:
        with _without_persistent_cache():
            compiled = lowered.compile(compiler_options=target.xla_flags or None)
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        report["compile_seconds"] = time.perf_counter() - start
        report["compiler_error"] = str(err).splitlines()[0]
        report.update(_hbm_figures(str(err)))
        raise DoesNotFit(report["compiler_error"], report) from None
    report["compile_seconds"] = time.perf_counter() - start
    memory = compiled.memory_analysis()
    report["program"] = program_ops(compiled.as_text())
    report["xla_cost"] = xla_cost(compiled)
    report.update({
        # What the compiler's own out-of-memory check compares with the device: the most bytes live at
        # once, arguments included. The TPU compiler's temp_size can exceed it: not a figure to fit by.
        "peak": memory.peak_memory_in_bytes,
        "arguments": memory.argument_size_in_bytes,
        "temporaries": memory.temp_size_in_bytes,
        # The gradient is a float32 copy of the parameters, and the clip needs all of it at once.
        "gradients": params,
    })
    if report["peak"] > report["memory_per_device"]:
        raise DoesNotFit(
            f"peak {report['peak'] / GiB:.2f} GiB per device exceeds the {report['memory_per_device'] / GiB:.2f} GiB "
            f"of a {target.kind} device", report)
    return report
