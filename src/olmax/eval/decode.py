"""The OLMo 3 forward pass with a KV cache, for greedy generation.

The same math as model/olmo3.py (reordered norm, whole-projection QK-norm,
rotate-half RoPE in float32, sliding/global layers), written for new tokens at
per-row positions against a cache of every layer's keys and values. One
function serves prefill (many tokens) and decode (one token): the new keys and
values are written at each row's position, and a query at position p sees the
cached keys j with p - window < j <= p. Rows of different prompt lengths share
a batch: prompts are right-padded, and a row's padding in the cache is
overwritten by its own generated tokens before any query can see it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmax.config import ModelConfig
from olmax.model import olmo3


class Cache(NamedTuple):
    k: jax.Array  # [layers, B, S, kv_heads, head_dim]
    v: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int) -> Cache:
    shape = (cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_size)
    dtype = olmo3.compute_dtype(cfg)
    return Cache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """olmo3.apply_rope with per-row positions: x [B, T, H, D], cos/sin [B, T, D]."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [B, S, H, D] with new [B, T, H, D] written at each row's position."""
    return jax.vmap(lambda c, n, p: jax.lax.dynamic_update_slice(c, n, (p, 0, 0)))(cache, new, positions)


def _block(cfg: ModelConfig, p: dict, x, cos, sin, query_pos, k_cache, v_cache, positions, window):
    B, T, _ = x.shape
    Dh, Hkv = cfg.head_size, cfg.kv_heads
    G = cfg.n_heads // Hkv
    dense = lambda h, w: h @ w.astype(h.dtype)
    q = olmo3.rms_norm(dense(x, p["q_proj"]), p["q_norm"], cfg.norm_eps)
    k = olmo3.rms_norm(dense(x, p["k_proj"]), p["k_norm"], cfg.norm_eps)
    v = dense(x, p["v_proj"])
    q = _rope(q.reshape(B, T, cfg.n_heads, Dh), cos, sin)
    k_cache = _write(k_cache, _rope(k.reshape(B, T, Hkv, Dh), cos, sin), positions)
    v_cache = _write(v_cache, v.reshape(B, T, Hkv, Dh), positions)
    key_pos = jnp.arange(k_cache.shape[1])
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] > query_pos[:, :, None] - window)
    qg = q.reshape(B, T, Hkv, G, Dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32) / math.sqrt(Dh)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    context = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(B, T, cfg.n_heads * Dh)
    h = x + olmo3.rms_norm(dense(context, p["o_proj"]), p["attn_norm"], cfg.norm_eps)
    mlp = dense(jax.nn.silu(dense(h, p["w1"])) * dense(h, p["w3"]), p["w2"])
    return h + olmo3.rms_norm(mlp, p["mlp_norm"], cfg.norm_eps), k_cache, v_cache


def forward_cached(cfg: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array,
                   cache: Cache) -> tuple[jax.Array, Cache]:
    """Logits [B, T, padded_vocab] (float32) of tokens [B, T] whose row b starts at positions[b]; the cache
    with their keys and values written in."""
    dtype = olmo3.compute_dtype(cfg)
    length = cache.k.shape[2]
    query_pos = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
    cos_table, sin_table = olmo3.rope_tables(length, cfg.head_size, cfg.rope_theta)
    cos, sin = jnp.asarray(cos_table)[query_pos], jnp.asarray(sin_table)[query_pos]
    windows = jnp.array([length if cfg.is_global(i) else cfg.sliding_window for i in range(cfg.n_layers)])
    x = params["embed"].astype(dtype)[tokens]

    def layer(x, inputs):
        p, k_cache, v_cache, window = inputs
        x, k_cache, v_cache = _block(cfg, p, x, cos, sin, query_pos, k_cache, v_cache, positions, window)
        return x, (k_cache, v_cache)

    x, (k, v) = jax.lax.scan(layer, x, (params["blocks"], cache.k, cache.v, windows))
    h = olmo3.rms_norm(x, params["final_norm"], cfg.norm_eps)
    return olmo3.logits_from_hidden(params, h), Cache(k, v)
