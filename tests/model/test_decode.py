"""KV-cached decoding runs the training block: its logits equal the plain forward pass's at every position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import load_config
from olmax.model import families, transformer
from olmax.model.attention.cached import slot_positions

LENGTH = 48


def _cfg(dtype, *overrides):
    # GQA (4 heads, 2 KV heads), window 8 on a 3:1 pattern: a 48-token sequence wraps the sliding rings 6 times.
    return load_config("tiny", ["model.sliding_window=8", f"impl.compute_dtype={dtype}", "impl.attention.block=16",
                                *overrides])


def _setup(dtype, *overrides):
    cfg = _cfg(dtype, *overrides)
    params = families.init_params(cfg.model, jax.random.key(0))
    return cfg, params


def _cached_fns(cfg):
    m, impl = cfg.model, cfg.impl

    @jax.jit
    def run(params, tokens, positions, cache, lengths):
        hidden, cache = transformer.forward_cached(m, impl, params, tokens, positions, cache, LENGTH, lengths)
        return transformer.logits(params, hidden), cache

    return run


TOLERANCE = {"float32": 2e-5, "bfloat16": 0.1}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_decoding_with_the_cache_gives_the_forward_logits(dtype):
    """Prompt in one call, then one token per call, greedily; every logit the cache produced equals the
    forward pass's over the whole generated sequence (sliding rings wrap; GQA)."""
    cfg, params = _setup(dtype)
    run = _cached_fns(cfg)
    prompt = np.asarray(jax.random.randint(jax.random.key(1), (2, 5), 2, cfg.model.vocab_size), np.int32)
    cache = transformer.init_cache(cfg.model, cfg.impl, 2, LENGTH)
    assert cache.layers["sliding"].k.shape == (3, 2, 8, 2, 16) and cache.layers["global"].k.shape == (1, 2, 48, 2, 16)
    logits, cache = run(params, prompt, np.zeros(2, np.int32), cache, np.full(2, 5, np.int32))
    collected = [np.asarray(logits, np.float32)]
    tokens = [prompt]
    for position in range(5, LENGTH):
        nxt = np.asarray(jnp.argmax(logits[:, -1, : cfg.model.vocab_size], -1), np.int32)[:, None]
        tokens.append(nxt)
        logits, cache = run(params, nxt, np.full(2, position, np.int32), cache, np.ones(2, np.int32))
        collected.append(np.asarray(logits, np.float32))
    sequence = np.concatenate(tokens, axis=1)
    assert sequence.shape == (2, LENGTH)
    reference = np.asarray(transformer.forward_logits(cfg.model, cfg.impl, params, sequence), np.float32)
    np.testing.assert_allclose(np.concatenate(collected, axis=1), reference, atol=TOLERANCE[dtype], rtol=0)
    if dtype == "float32":  # bfloat16 logits of a random model have near-ties
        assert np.array_equal(np.argmax(reference[:, 4:-1, :512], -1), sequence[:, 5:]), "greedy path is forward's"


def test_prefill_in_chunks_longer_than_the_window_and_ragged_rows():
    """Rows at different positions, right padding that is never cached, chunks longer than the window."""
    cfg, params = _setup("float32")
    run = _cached_fns(cfg)
    sequence = np.asarray(jax.random.randint(jax.random.key(2), (3, LENGTH), 2, cfg.model.vocab_size), np.int32)
    reference = np.asarray(transformer.forward_logits(cfg.model, cfg.impl, params, sequence))
    cache = transformer.init_cache(cfg.model, cfg.impl, 3, LENGTH)
    # row lengths 13, 7 and 20 in the first call (padded to 20 with junk), then chunks of 12 tokens
    lengths = np.array([13, 7, 20], np.int32)
    first = np.where(np.arange(20) < lengths[:, None], sequence[:, :20], 9)
    logits, cache = run(params, first, np.zeros(3, np.int32), cache, lengths)
    for row in range(3):
        np.testing.assert_allclose(logits[row, : lengths[row]], reference[row, : lengths[row]], atol=2e-5, rtol=0)
    positions = lengths.copy()
    while positions.max() < LENGTH:
        width = 12
        take = np.minimum(width, LENGTH - positions)
        chunk = np.stack([np.pad(sequence[r, positions[r]:positions[r] + take[r]], (0, width - take[r]),
                                 constant_values=9) for r in range(3)])
        logits, cache = run(params, chunk, positions, cache, take.astype(np.int32))
        for row in range(3):
            got, want = logits[row, : take[row]], reference[row, positions[row]: positions[row] + take[row]]
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
        positions = positions + take


def test_slot_positions_of_a_ring():
    assert slot_positions(jnp.array([0]), 4).tolist() == [[-4, -3, -2, -1]]
    assert slot_positions(jnp.array([3]), 4).tolist() == [[0, 1, 2, -1]]
    assert slot_positions(jnp.array([10]), 4).tolist() == [[8, 9, 6, 7]]


def test_greedy_generation_of_ragged_prompts_follows_the_forward_pass():
    """model/generate.py (the demo's and the harness's decoding): right-padded prompts of different lengths, then
    a token per call; each row's tokens are the argmax of the plain forward pass over its own sequence."""
    from olmax.model import generate

    cfg, params = _setup("float32")
    m, impl = cfg.model, cfg.impl
    prefill = jax.jit(lambda p, t, n: generate.prefill(m, impl, p, t, n, LENGTH))
    step = jax.jit(lambda p, t, pos, c: generate.step(m, impl, p, t, pos, c, LENGTH))
    lengths = np.array([3, 7], np.int32)
    prompts = np.asarray(jax.random.randint(jax.random.key(2), (2, 8), 2, m.vocab_size), np.int32)
    token, cache = prefill(params, prompts, lengths)
    rows = [list(prompts[b, : lengths[b]]) for b in range(2)]
    for i in range(6):
        for b in range(2):
            rows[b].append(int(token[b]))
        token, cache = step(params, np.asarray(token, np.int32), lengths + i, cache)
    for row in rows:
        sequence = np.array([row], np.int32)
        expected = np.argmax(np.asarray(transformer.forward_logits(m, impl, params, sequence))[0, :, : m.vocab_size], -1)
        assert row[-6:] == list(expected[-7:-1])
