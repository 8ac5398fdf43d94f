"""cuDNN's fused flash attention (GPU), through `jax.nn.dot_product_attention`.

It takes olmax's [B, T, H, D] layout and grouped KV heads as they are. q comes already scaled, so the
scale is 1; a sliding layer's window is `local_window_size=(window - 1, 0)`: key j visible to query i
iff i - window < j <= i. It runs per shard (see `attention.per_shard`).
"""

from __future__ import annotations

import jax


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None, implementation: str = "cudnn"
              ) -> jax.Array:
    """q [B, T, Hq, D] (already scaled), k/v [B, T, Hkv, D] -> context [B, T, Hq, D]. implementation="xla" makes
    the same call on any platform: how a CPU checks these arguments, and what the GPU benchmark compares."""
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, local_window_size=local,
                                        implementation=implementation)
