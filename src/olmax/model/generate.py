"""Greedy decoding with the KV cache, as pure functions to jit: the prompts in one call (`prefill`), then one
token per row per call (`step`). The loop around them (stop strings, EOS, batching) is the caller's: the demo's
samples and the evaluation harness's generation tasks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olmax.config import ImplConfig, ModelConfig
from olmax.model import transformer


def next_token(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """The most likely token [...] over the real vocabulary, from final hidden states [..., d_model]."""
    return jnp.argmax(transformer.logits(params, hidden)[..., : cfg.vocab_size], axis=-1)


def prefill(cfg: ModelConfig, impl: ImplConfig, params: dict, tokens: jax.Array, lengths: jax.Array,
            length: int) -> tuple[jax.Array, transformer.Cache]:
    """(each row's next token [B], the cache) after prompts tokens [B, T], right-padded: row b holds
    lengths[b] real tokens; the cache holds `length` positions."""
    cache = transformer.init_cache(cfg, impl, tokens.shape[0], length)
    hidden, cache = transformer.forward_cached(cfg, impl, params, tokens, jnp.zeros_like(lengths), cache, length,
                                               lengths)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return next_token(cfg, params, last), cache


def step(cfg: ModelConfig, impl: ImplConfig, params: dict, tokens: jax.Array, positions: jax.Array,
         cache: transformer.Cache, length: int) -> tuple[jax.Array, transformer.Cache]:
    """(each row's next token [B], the cache) after one token per row, tokens [B] at positions [B]."""
    hidden, cache = transformer.forward_cached(cfg, impl, params, tokens[:, None], positions, cache, length)
    return next_token(cfg, params, hidden[:, 0]), cache
