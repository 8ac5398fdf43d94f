"""Next-token cross-entropy and z-loss in float32, OLMo-core's reduction.

Labels are the inputs shifted left; the last position of each instance has no
label; pad labels are ignored when `mask_pad`; an instance masked by the data
filters loses all its labels but still counts in the denominator, so the loss of
a batch does not jump when the filter fires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def label_mask(input_ids: jax.Array, pad_id: int, mask_pad: bool) -> jax.Array:
    """[B, T] bool: True where position t has the label input_ids[t + 1]."""
    has_next = jnp.arange(input_ids.shape[1]) < input_ids.shape[1] - 1
    mask = jnp.broadcast_to(has_next, input_ids.shape)
    if mask_pad:
        labels = jnp.roll(input_ids, -1, axis=1)
        mask &= labels != pad_id
    return mask


def loss_sums(logits: jax.Array, input_ids: jax.Array, mask: jax.Array, instance_mask: jax.Array):
    """Summed CE and summed logsumexp^2 over counted labels; divide by the batch's label count."""
    labels = jnp.roll(input_ids, -1, axis=1)
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    counted = mask & instance_mask[:, None]
    ce = jnp.where(counted, lse - target, 0.0).sum()
    z = jnp.where(counted, lse * lse, 0.0).sum()
    return ce, z
