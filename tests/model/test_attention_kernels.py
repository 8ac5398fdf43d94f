"""Accelerator attention behind the attention interface: Splash's wrapping (masks, grouped KV heads, layout,
per-shard call) checked against the blocked XLA attention by running the very kernels in Pallas' interpreter
on the CPU; the choice of implementation by the devices' platform; the kernels' configuration errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ConfigError, ImplConfig, load_config
from olmax.model import attention
from olmax.model.attention import splash, xla
from olmax.parallel.mesh import make_layout
from olmax.scale.targets import aot_missing, compile_only_devices, parse_target

BLOCKS = load_config("tiny", ["impl.attention.splash.block_q=128", "impl.attention.splash.block_kv=128",
                              "impl.attention.splash.block_kv_compute=128"]).impl.attention.splash


def _qkv(batch, seq, heads, kv_heads, head_dim=128):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim)) * head_dim**-0.5  # the block scales q
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim))
    cotangent = jax.random.normal(keys[3], q.shape)
    return q, k, v, cotangent


def _output_and_grads(fn, q, k, v, cotangent):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(cotangent)


@pytest.mark.parametrize("window", [None, 100])  # a window that is not a multiple of the tiles
def test_splash_matches_blocked_xla_attention(window):
    """Forward and all three gradients, grouped KV heads (4 query heads on 2 KV heads), two tiles of keys."""
    q, k, v, cotangent = _qkv(batch=2, seq=256, heads=4, kv_heads=2)
    ours = functools.partial(splash.attention, window=window, blocks=BLOCKS, interpret=True)
    reference = functools.partial(xla.attention, window=window, block=64)
    out, grads = _output_and_grads(ours, q, k, v, cotangent)
    out_ref, grads_ref = _output_and_grads(reference, q, k, v, cotangent)
    np.testing.assert_allclose(out, out_ref, atol=2e-5)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, atol=5e-5)


def test_kernel_runs_per_shard_of_the_batch():
    """Inside shard_map over 8 devices (batch split 8 ways), the same result as unsharded."""
    q, k, v, _ = _qkv(batch=8, seq=128, heads=2, kv_heads=1)
    layout = make_layout(load_config("tiny").mesh)
    assert layout.data_parallel_size == 8
    kernel = functools.partial(splash.attention, window=None, blocks=BLOCKS, interpret=True)
    sharded = jax.jit(attention.per_shard(layout, kernel))(q, k, v)
    np.testing.assert_allclose(sharded, xla.attention(q, k, v, window=None, block=64), atol=2e-5)


def test_auto_is_xla_on_cpu_and_named_kernels_refuse_it():
    layout = make_layout(load_config("tiny").mesh)
    assert attention.implementation(ImplConfig(), layout, 4096) == "xla"
    for kernel, where in (("splash", "TPU"), ("cudnn", "GPU")):
        impl = ImplConfig(attention={"implementation": kernel})
        with pytest.raises(ConfigError, match=f"impl.attention.implementation={kernel} runs on {where} only"):
            attention.make(impl, None, layout)


@pytest.mark.parametrize("platform, target, chosen", [("tpu", "tpu:v5p:2x2x2", "splash"), ("gpu", "gpu:h100x8", "cudnn")])
def test_auto_follows_the_devices_not_the_host(platform, target, chosen):
    """Compile-only accelerator devices on this CPU host: `auto` picks their kernel and bfloat16."""
    if reason := aot_missing(platform):
        pytest.skip(reason)
    from olmax.model import transformer

    layout = make_layout(load_config("tiny").mesh, compile_only_devices(parse_target(target)))
    assert jax.default_backend() == "cpu"
    assert attention.implementation(ImplConfig(), layout, 4096) == chosen
    assert transformer.compute_dtype(ImplConfig(), layout) == jnp.bfloat16
    assert transformer.compute_dtype(ImplConfig(), None) == jnp.float32


@pytest.mark.parametrize("override, says", [
    ("impl.attention.splash.block_q=100", "multiple of 128"),
    ("impl.attention.splash.block_kv_compute=384", "block_kv 512 must be a multiple of block_kv_compute 384"),
])
def test_bad_splash_tiles_are_named(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config("tiny", [override])


def test_sequence_the_tiles_do_not_divide_is_named():
    q, k, v, _ = _qkv(batch=1, seq=384, heads=2, kv_heads=2)
    blocks = load_config("tiny", ["impl.attention.splash.block_q=256"]).impl.attention.splash
    with pytest.raises(ConfigError, match="impl.attention.splash.block_q 256: .* divides the sequence length 384"):
        splash.attention(q, k, v, window=None, blocks=blocks, interpret=True)


def test_auto_fits_splash_tiles_to_the_sequence():
    """The largest tiles, at most the configured ones, that are multiples of 128 dividing the sequence."""
    blocks = load_config("tiny").impl.attention.splash  # 512 each
    assert splash.fitted(4096, blocks) == blocks
    tiles = splash.fitted(384, blocks)
    assert (tiles.block_q, tiles.block_kv, tiles.block_kv_compute) == (384, 384, 384)
    tiles = splash.fitted(640, blocks)
    assert (tiles.block_q, tiles.block_kv, tiles.block_kv_compute) == (128, 128, 128)
    assert splash.fitted(64, blocks) is None and splash.fitted(200, blocks) is None


def test_auto_on_tpu_takes_xla_where_no_splash_tile_fits_and_explicit_splash_names_the_fix():
    if reason := aot_missing("tpu"):
        pytest.skip(reason)
    layout = make_layout(load_config("tiny").mesh, compile_only_devices(parse_target("tpu:v5p:2x2x2")))
    assert attention.implementation(ImplConfig(), layout, 64) == "xla"
    assert attention.implementation(ImplConfig(), layout, 640) == "splash"
    explicit = ImplConfig(attention={"implementation": "splash"})
    assert attention.implementation(explicit, layout, 64) == "splash"
    q, k, v, _ = _qkv(batch=1, seq=64, heads=2, kv_heads=2)
    with pytest.raises(ConfigError, match="sequence length 64; Splash needs a sequence length that is a multiple of "
                                          "128: set impl.attention.implementation=xla"):
        splash.attention(q, k, v, window=None, blocks=explicit.attention.splash, interpret=True)
    q, k, v, _ = _qkv(batch=1, seq=640, heads=2, kv_heads=2)
    with pytest.raises(ConfigError, match="block_q 512: .* length 640; set impl.attention.splash.block_q=128"):
        splash.attention(q, k, v, window=None, blocks=explicit.attention.splash, interpret=True)
