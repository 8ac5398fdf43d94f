"""Causal attention, full or sliding-window, with grouped KV heads.

A sliding layer with window w sees keys j with i - w < j <= i. Queries are cut into
blocks; each block attends only to the keys it can see: the prefix up to its end
for a global layer (half the work of a full causal mask), and the whole blocks its
window reaches for a sliding layer, so that cost grows with
sequence x (window + block) rather than sequence^2. Softmax runs in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


def attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, block: int) -> jax.Array:
    """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> context [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    block = block if T % block == 0 else T
    q = q.reshape(B, T, Hkv, Hq // Hkv, D).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    outs = []
    for start in range(0, T, block):
        end = start + block
        first = 0 if window is None else max(0, (start - window + 1) // block * block)
        scores = jnp.einsum("bhgqd,bhkd->bhgqk", q[:, :, :, start:end], k[:, :, first:end],
                            preferred_element_type=jnp.float32) / math.sqrt(D)
        visible = _visible(jnp.arange(start, end), jnp.arange(first, end), window)
        probs = jax.nn.softmax(jnp.where(visible, scores, jnp.finfo(jnp.float32).min), axis=-1)
        outs.append(jnp.einsum("bhgqk,bhkd->bhgqd", probs.astype(v.dtype), v[:, :, first:end]))
    return jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
