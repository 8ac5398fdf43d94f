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


def _visible(q_pos, k_pos, window):
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok

def attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, block: int) -> jax.Array:
    """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> context [B, T, Hq, D]; softmax in float32."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    block = min(block, T)
    reach = 0 if window is None else math.ceil((window - 1) / block)  # earlier key blocks a query block needs
    if window is None or T % block or (reach + 1) * block >= T:
        block, reach = T, 0  # one block: plain masked attention
    n = T // block
    # [B, Hkv, n, G * block, D]: standard batched matmuls with the batch dims leading.
    qb = q.reshape(B, n, block, Hkv, G, D).transpose(0, 3, 1, 4, 2, 5).reshape(B, Hkv, n, G * block, D)
    def windows(x):  # [B, T, Hkv, D] -> [B, Hkv, n, (reach + 1) * block, D]: the keys each query block sees
        x = jnp.pad(x.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (reach * block, 0), (0, 0)))
        x = x.reshape(B, Hkv, n + reach, block, D)
        return jnp.concatenate([x[:, :, j : j + n] for j in range(reach + 1)], axis=3)
    kw, vw = windows(k), windows(v)
    q_pos = jnp.arange(T).reshape(n, block)
    k_pos = q_pos[:, :1] + jnp.arange(-reach * block, block)[None, :]
    mask = jax.vmap(lambda qp, kp: _visible(qp, kp, window) & (kp >= 0)[None, :])(q_pos, k_pos)
    scores = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kw, preferred_element_type=jnp.float32) / math.sqrt(D)
    scores = scores.reshape(B, Hkv, n, G, block, -1)
    scores = jnp.where(mask[None, None, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, Hkv, n, G * block, -1)
    out = jnp.einsum("bhnqk,bhnkd->bhnqd", probs, vw)
    return out.reshape(B, Hkv, n, G, block, D).transpose(0, 2, 4, 1, 3, 5).reshape(B, T, Hq, D)
