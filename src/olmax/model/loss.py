"""Everything computed from the LM head's logits (`transformer.logits`), a chunk of sequence positions at a time.

Full float32 logits of a batch are [tokens, padded vocab]: about 13 GB per device for the 7B recipe
(4 x 8192 tokens, vocab 100,352), more than all other activations. `over_logits` computes the logits of
`chunk` positions at a time, applies a per-position function to them and keeps only its (small)
outputs; the chunk's logits are recomputed in the backward pass, so forward and backward memory are
bounded by the chunk. Training's CE and z-loss, held-out log-probabilities and checkpoint KL all go
through it.

Next-token loss, OLMo-core's reduction: labels are the inputs shifted left; the last position of each
instance has no label; pad labels are ignored when `mask_pad`; an instance masked by the data filters
loses all its labels but still counts in the denominator, as T positions (OLMo-core's `labels.shape[1]`,
one more than the T - 1 labels an instance has), so the loss of a batch does not jump when the filter
fires and equals OLMo-core's when it does.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from olmax.model.transformer import logits as lm_logits


def over_logits(fn: Callable, params: tuple[dict, ...], hiddens: tuple[jax.Array, ...], per_position: tuple,
                chunk: int | None, grad: str = "float32"):
    """fn(logits tuple, *per_position) -> pytree of [B, T, ...] arrays, computed `chunk` positions at a time.

    `logits` holds one float32 [B, C, padded_vocab] array per (params, hidden) pair (several models on the
    same inputs, for KL), their gradient taken in `grad` (impl.logits_grad); `per_position` arrays are [B, T, ...].
    With chunk None or >= T, one call on the whole sequence.
    """
    T = hiddens[0].shape[1]

    def call(hs, extra):
        return fn(tuple(lm_logits(p, h, grad) for p, h in zip(params, hs)), *extra)

    if chunk is None or chunk >= T:
        return call(hiddens, per_position)
    n = math.ceil(T / chunk)
    pad = n * chunk - T

    def split(a):  # [B, T, ...] -> [n, B, chunk, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(a.shape[0], n, chunk, *a.shape[2:]), 1, 0)

    def merge(a):  # [n, B, chunk, ...] -> [B, T, ...]
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape(a.shape[0], n * chunk, *a.shape[3:])[:, :T]

    outs = jax.lax.map(jax.checkpoint(lambda xs: call(*xs)), (tuple(map(split, hiddens)), tuple(map(split, per_position))))
    return jax.tree.map(merge, outs)


def label_mask(input_ids: jax.Array, pad_id: int, mask_pad: bool) -> jax.Array:
    """[B, T] bool: True where position t has the label input_ids[t + 1]."""
    has_next = jnp.arange(input_ids.shape[1]) < input_ids.shape[1] - 1
    mask = jnp.broadcast_to(has_next, input_ids.shape)
    if mask_pad:
        labels = jnp.roll(input_ids, -1, axis=1)
        mask &= labels != pad_id
    return mask


def label_count(input_ids: jax.Array, instance_mask: jax.Array, pad_id: int, mask_pad: bool) -> jax.Array:
    """The loss's denominator for rows [N, T] (float32, at least 1): the labels of the kept instances, plus T
    for each masked one (OLMo-core's train module adds `labels.shape[1]` per masked instance)."""
    kept = (label_mask(input_ids, pad_id, mask_pad) & instance_mask[:, None]).sum()
    masked = (~instance_mask).sum() * input_ids.shape[1]
    return jnp.maximum(kept + masked, 1).astype(jnp.float32)


def _lse_and_target(logits: tuple[jax.Array], labels: jax.Array):
    logits = logits[0].astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse, jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def loss_sums(params: dict, hidden: jax.Array, input_ids: jax.Array, mask: jax.Array, instance_mask: jax.Array,
              chunk: int | None, grad: str = "float32"):
    """Summed CE and summed logsumexp^2 over counted labels; divide by the batch's label count."""
    labels = jnp.roll(input_ids, -1, axis=1)
    lse, target = over_logits(_lse_and_target, (params,), (hidden,), (labels,), chunk, grad)
    counted = mask & instance_mask[:, None]
    ce = jnp.where(counted, lse - target, 0.0).sum()
    z = jnp.where(counted, lse * lse, 0.0).sum()
    return ce, z


def target_log_probs(params: dict, hidden: jax.Array, targets: jax.Array, vocab_size: int,
                     chunk: int | None) -> jax.Array:
    """log p(target) [B, T] in float32 over the real vocabulary (not the embedding's padding rows)."""
    def fn(logits, targets):
        logits = logits[0][..., :vocab_size]
        return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(logits, axis=-1)

    return over_logits(fn, (params,), (hidden,), (targets,), chunk)
