"""Causal attention, full or sliding-window, with grouped KV heads.

A sliding layer with window w sees keys j with i - w < j <= i. When the sequence
is longer than the window, queries are cut into blocks and each block attends only
to the key blocks its window can reach, so the cost grows with
sequence x (window + block) rather than sequence^2.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _scores_softmax_context(q, k, v, mask):
    """q [B, Q, Hkv, G, D], k/v [B, K, Hkv, D], mask broadcastable to [B, Hkv, G, Q, K]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)


def _visible(q_pos, k_pos, window):
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


def attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, block: int) -> jax.Array:
    """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> context [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    q = q.reshape(B, T, Hkv, Hq // Hkv, D)
    block = min(block, T)
    reach = 0 if window is None else math.ceil((window - 1) / block)  # earlier key blocks a query block needs
    if window is None or T % block or (reach + 1) * block >= T:
        pos = jnp.arange(T)
        out = _scores_softmax_context(q, k, v, _visible(pos, pos, window))
        return out.reshape(B, T, Hq, D)

    n = T // block
    pad = ((0, 0), (reach * block, 0), (0, 0), (0, 0))
    k_blocks = jnp.pad(k, pad).reshape(B, n + reach, block, Hkv, D)
    v_blocks = jnp.pad(v, pad).reshape(B, n + reach, block, Hkv, D)
    # Query block i sees key blocks i-reach .. i (of the padded sequence: i .. i+reach).
    k_win = jnp.concatenate([k_blocks[:, j : j + n] for j in range(reach + 1)], axis=2)
    v_win = jnp.concatenate([v_blocks[:, j : j + n] for j in range(reach + 1)], axis=2)
    q_blocks = q.reshape(B, n, block, Hkv, Hq // Hkv, D)
    q_pos = jnp.arange(T).reshape(n, block)
    k_pos = q_pos[:, :1] + jnp.arange(-reach * block, block)[None, :]
    mask = jax.vmap(lambda qp, kp: _visible(qp, kp, window) & (kp >= 0)[None, :])(q_pos, k_pos)
    out = jax.vmap(_scores_softmax_context, in_axes=(1, 1, 1, 0), out_axes=1)(
        q_blocks, k_win, v_win, mask[:, None, None, None]
    )
    return out.reshape(B, T, Hq, D)
