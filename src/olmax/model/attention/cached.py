"""Attention over a KV cache, for decoding: one function for prefill (many tokens) and decode (one).

Each layer keeps a ring of key/value slots: every position for a global layer, the last `window` for
a sliding one, so a sliding layer's cache does not grow with the context. Position p lives in slot
p % slots. New tokens attend to the positions already cached and to each other, with the same masked
float32 softmax as training; then those still inside the ring's span are written in. Rows of a batch
may sit at different positions and carry right padding (`lengths`: real new tokens per row); padding
is never written, so it is never seen.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmax.model.attention.xla import scores_softmax, visible


class LayerCache(NamedTuple):
    k: jax.Array  # [B, slots, Hkv, D]
    v: jax.Array


def slot_positions(end: jax.Array, slots: int) -> jax.Array:
    """[B, slots] the position each slot holds once positions < end[b] are written (negative: empty)."""
    last = end[:, None] - 1
    return last - jnp.mod(last - jnp.arange(slots), slots)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, cache: LayerCache, positions: jax.Array,
              lengths: jax.Array, window: int | None) -> tuple[jax.Array, LayerCache]:
    """q [B, T, Hq, D] (already scaled by 1/sqrt(D)) at positions[b] + t; k, v [B, T, Hkv, D] the new keys and
    values -> (context [B, T, Hq, D], the cache with the new positions written)."""
    B, T, Hq, D = q.shape
    Hkv, slots = k.shape[2], cache.k.shape[1]
    q_pos = positions[:, None] + jnp.arange(T)  # [B, T]
    cached_pos = slot_positions(positions, slots)
    k_pos = jnp.concatenate([cached_pos, q_pos], axis=1)  # [B, slots + T]
    empty = jnp.concatenate([cached_pos < 0, jnp.zeros_like(q_pos, bool)], axis=1)
    mask = visible(q_pos, k_pos, window) & ~empty[:, None, :]  # [B, T, slots + T]
    keys = jnp.concatenate([cache.k, k], axis=1).transpose(0, 2, 1, 3)  # [B, Hkv, slots + T, D]
    values = jnp.concatenate([cache.v, v], axis=1).transpose(0, 2, 1, 3)
    grouped_q = q.reshape(B, T, Hkv, Hq // Hkv, D).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    probs = scores_softmax(grouped_q, keys, mask[:, None, None])
    context = jnp.einsum("bhgqk,bhkd->bhgqd", probs.astype(values.dtype), values)
    context = context.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D)

    end = positions + lengths
    written = (jnp.arange(T) < lengths[:, None]) & (q_pos >= end[:, None] - slots)
    slot = jnp.where(written, q_pos % slots, slots)  # out of range: dropped
    rows = jnp.arange(B)[:, None]
    new = LayerCache(cache.k.at[rows, slot].set(k.astype(cache.k.dtype), mode="drop"),
                     cache.v.at[rows, slot].set(v.astype(cache.v.dtype), mode="drop"))
    return context, new
