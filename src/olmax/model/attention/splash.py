"""Splash attention (Pallas, TPU): FlashAttention-style kernels that skip the blocks a mask hides.

The kernel works on one example's heads-first [heads, T, head_dim] and takes grouped KV heads as they
are (query head h reads KV head h // (Hq / Hkv)); it does not scale q, which the block has already
scaled. A sliding layer is a LocalMask reaching window - 1 keys back (key j visible to query i iff
i - window < j <= i), a global one a CausalMask. Its residuals (output and logsumexp) carry the
checkpoint name `context`, so a remat policy that saves the context does not run the forward kernel
again in the backward pass. It runs per shard (see `attention.per_shard`), vmapped over the batch.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from olmax.config import ConfigError, SplashConfig


@functools.lru_cache(maxsize=None)
def kernel(seq: int, heads: int, window: int | None, blocks: tuple[int, int, int], interpret: bool = False):
    """The kernel for `heads` local query heads of sequences of `seq` tokens, with blocks (q, kv, kv_compute)
    (cached: its mask tables are built in numpy; `transformer` clears the cache for each forward, so a step's
    program does not depend on what the process traced before)."""
    q_block, kv_block, kv_compute = (min(b, seq) for b in blocks)
    fits = fitted(seq, SplashConfig(block_q=blocks[0], block_kv=blocks[1], block_kv_compute=blocks[2]))
    for name, size in zip(("block_q", "block_kv", "block_kv_compute"), (q_block, kv_block, kv_compute)):
        if seq % size or size % 128:
            fix = (f"set impl.attention.splash.{name}={getattr(fits, name)}" if fits else
                   "Splash needs a sequence length that is a multiple of 128: set impl.attention.implementation=xla")
            raise ConfigError(f"impl.attention.splash.{name} {size}: Splash needs a multiple of 128 that divides "
                              f"the sequence length {seq}; {fix} (or auto)")
    if window is None:
        mask = splash.CausalMask(shape=(seq, seq))
    else:
        mask = splash.LocalMask(shape=(seq, seq), window_size=(window - 1, 0), offset=0)
    sizes = splash.BlockSizes(
        block_q=q_block, block_kv=kv_block, block_kv_compute=kv_compute,
        block_q_dkv=q_block, block_kv_dkv=kv_block, block_kv_dkv_compute=kv_compute,
        block_q_dq=q_block, block_kv_dq=kv_block,
    )
    return splash.make_splash_mha(
        splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
        residual_checkpoint_name="context", interpret=interpret,
    )


def fitted(seq: int, blocks: SplashConfig) -> SplashConfig | None:
    """The largest tiles, at most `blocks`, that Splash can cut sequences of `seq` tokens into; None where
    none can (a tile is a multiple of 128 that divides the sequence, and the key compute tile the key tile)."""
    def fit(limit: int, length: int) -> int | None:
        return max((t for t in range(128, min(limit, length) + 1, 128) if length % t == 0), default=None)

    if (q_block := fit(blocks.block_q, seq)) is None:
        return None
    kv_block = fit(blocks.block_kv, seq)
    return SplashConfig(block_q=q_block, block_kv=kv_block, block_kv_compute=fit(blocks.block_kv_compute, kv_block))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None, blocks: SplashConfig,
              interpret: bool = False) -> jax.Array:
    """q [B, T, Hq, D] (already scaled), k/v [B, T, Hkv, D] -> context [B, T, Hq, D]."""
    sizes = (blocks.block_q, blocks.block_kv, blocks.block_kv_compute)
    fn = kernel(q.shape[1], q.shape[2], window, sizes, interpret)
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    return heads_first(jax.vmap(fn)(heads_first(q), heads_first(k), heads_first(v)))
