"""Attention behind one interface: `make(impl, window, layout)` gives the training attention of a layer,
`q, k, v -> (context, None)`, with q [B, T, Hq, D] already scaled by 1/sqrt(head_dim) and k, v
[B, T, Hkv, D] (grouped KV heads). Decoding passes `cached.attention` instead, whose second output is the
updated KV cache. Implementations: `xla` (blocked, any platform; the CPU path), `splash` (Pallas, TPU),
`cudnn` (GPU); `auto` picks by the platform of the layout's devices, not the one JAX runs on, so an
ahead-of-time compile on a CPU builds the accelerator's attention.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from olmax.config import ConfigError, ImplConfig, SplashConfig
from olmax.model.attention import cudnn, splash, xla
from olmax.parallel.mesh import Layout, platform

KERNEL_PLATFORM = {"splash": "tpu", "cudnn": "gpu"}


def platform_kernel(impl: ImplConfig, layout: Layout | None) -> str:
    """The attention implementation `impl` means on the layout's devices, whatever the shapes."""
    chosen, where = impl.attention.implementation, platform(layout)
    if chosen == "auto":
        return {"tpu": "splash", "gpu": "cudnn"}.get(where, "xla")
    if chosen in KERNEL_PLATFORM and KERNEL_PLATFORM[chosen] != where:
        raise ConfigError(f"impl.attention.implementation={chosen} runs on {KERNEL_PLATFORM[chosen].upper()} only, "
                          f"these devices are {where}; use auto or xla")
    return chosen


def implementation(impl: ImplConfig, layout: Layout | None, seq_len: int) -> str:
    """The attention implementation for sequences of `seq_len` tokens: `auto` takes XLA's on a TPU where no
    Splash tile fits the sequence."""
    chosen = platform_kernel(impl, layout)
    return "xla" if chosen == "splash" and splash_blocks(impl, seq_len) is None else chosen


def splash_blocks(impl: ImplConfig, seq_len: int) -> SplashConfig | None:
    """Splash's tiles for this sequence length: as configured for an explicit `splash` (its kernel says what
    is wrong with them), for `auto` the largest that fit, at most the configured ones (None: none fits)."""
    blocks = impl.attention.splash
    return blocks if impl.attention.implementation == "splash" else splash.fitted(seq_len, blocks)


def per_shard(layout: Layout | None, fn):
    """fn(q, k, v) on each device's share: batch split as the layout splits it, heads too where query and KV
    heads split alike, the sequence whole. A kernel call (Pallas, cuDNN) is opaque to the partitioner, so
    it runs inside shard_map."""
    if layout is None:
        return fn

    def call(q, k, v):
        q_spec = layout.spec(("batch", "length", "q_heads"), q.shape[:3])
        kv_spec = layout.spec(("batch", "length", "kv_heads"), k.shape[:3])
        heads = q_spec[2] if q_spec[2] == kv_spec[2] else None
        spec = PartitionSpec(q_spec[0], None, heads, None)
        return jax.shard_map(fn, mesh=layout.mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)

    return call


def make(impl: ImplConfig, window: int | None, layout: Layout | None = None):
    """The attention of a layer with this window (None: global), as the block calls it."""
    platform_kernel(impl, layout)  # refuse a kernel for other devices now, not when the step is traced

    def attend(q, k, v):
        seq_len = q.shape[1]
        name = implementation(impl, layout, seq_len)
        if name == "splash":
            blocks = splash_blocks(impl, seq_len)
            kernel = per_shard(layout, functools.partial(splash.attention, window=window, blocks=blocks))
        elif name == "cudnn":
            kernel = per_shard(layout, functools.partial(cudnn.attention, window=window))
        else:
            kernel = functools.partial(xla.attention, window=window, block=impl.attention.block)
        return kernel(q, k, v), None

    return attend
