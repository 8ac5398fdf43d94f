"""The LM head and loss a chunk of positions at a time: the same numbers, bounded memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model.loss import label_mask, loss_sums, over_logits, target_log_probs


def _inputs(batch=2, seq=100, d=32, vocab=640, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    params = {"lm_head": 0.3 * jax.random.normal(keys[0], (d, vocab))}
    hidden = jax.random.normal(keys[1], (batch, seq, d))
    input_ids = jax.random.randint(keys[2], (batch, seq), 0, vocab)
    instance_mask = jnp.array([True, False] * (batch // 2))
    return params, hidden, input_ids, instance_mask


def _unchunked(params, hidden, input_ids, mask, instance_mask):
    """Full float32 logits, as a plain reference."""
    logits = hidden @ params["lm_head"]
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.roll(input_ids, -1, axis=1)[..., None], axis=-1)[..., 0]
    counted = mask & instance_mask[:, None]
    return jnp.where(counted, lse - target, 0).sum(), jnp.where(counted, lse * lse, 0).sum()


@pytest.mark.parametrize("chunk", [None, 100, 32, 7])  # whole, exactly the sequence, dividing, with a remainder
def test_chunked_loss_and_gradients_equal_full_logits(chunk):
    params, hidden, input_ids, instance_mask = _inputs()
    mask = label_mask(input_ids, pad_id=1, mask_pad=True)

    def total(fn, params, hidden):
        ce, z = fn(params, hidden)
        return ce + 1e-3 * z

    ours = lambda p, h: loss_sums(p, h, input_ids, mask, instance_mask, chunk)
    ref = lambda p, h: _unchunked(p, h, input_ids, mask, instance_mask)
    for a, b in zip(ours(params, hidden), ref(params, hidden)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    grads = jax.grad(lambda p, h: total(ours, p, h), argnums=(0, 1))(params, hidden)
    want = jax.grad(lambda p, h: total(ref, p, h), argnums=(0, 1))(params, hidden)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_target_log_probs_and_two_model_chunks():
    params, hidden, input_ids, _ = _inputs()
    full = jax.nn.log_softmax((hidden @ params["lm_head"])[..., :600], axis=-1)
    want = jnp.take_along_axis(full, input_ids[..., None] % 600, axis=-1)[..., 0]
    got = target_log_probs(params, hidden, input_ids % 600, 600, chunk=16)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    other = {"lm_head": params["lm_head"] * 1.1}
    maxes = over_logits(lambda logits: logits[0].max(-1) - logits[1].max(-1), (params, other), (hidden, hidden),
                        (), chunk=16)
    np.testing.assert_allclose(maxes, (hidden @ params["lm_head"]).max(-1) - (hidden @ other["lm_head"]).max(-1),
                               rtol=1e-5, atol=1e-5)


def test_chunks_bound_the_compiled_memory():
    """The train-step gradient of the loss keeps no [tokens, vocab] array when chunked (XLA's own figures)."""
    params = {"lm_head": jax.ShapeDtypeStruct((64, 32768), jnp.float32)}
    hidden = jax.ShapeDtypeStruct((2, 1024, 64), jnp.float32)
    ids = jax.ShapeDtypeStruct((2, 1024), jnp.int32)

    def temp_bytes(chunk):
        def loss(p, h, ids):
            ce, z = loss_sums(p, h, ids, label_mask(ids, 1, False), jnp.ones(2, bool), chunk)
            return ce + z
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, hidden, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = 2 * 1024 * 32768 * 4  # 256 MiB; a chunk of 64 positions is 1/16 of it
    whole, chunked = temp_bytes(None), temp_bytes(64)
    assert whole >= logits_bytes  # measured: 2x (logits and their gradient)
    assert chunked < 4 * logits_bytes / 16, (whole, chunked)  # measured: 2.6 chunks
