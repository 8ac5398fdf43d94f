"""The generated language: real OLMo shards, deterministic in the seed, and learnable."""

import numpy as np

from olmax.config import load_config
from olmax.data import build_loader
from olmax.data.synthetic import BRANCHING, write_synthetic_shards


def read_all(paths, dtype=np.uint16):
    return [np.fromfile(p, dtype=dtype) for p in paths]


def test_shards_are_whole_documents_and_deterministic(tmp_path):
    args = dict(vocab_size=512, eos_id=0, n_tokens=60_000, n_shards=3, token_dtype="uint16")
    first = read_all(write_synthetic_shards(tmp_path / "a", seed=1, **args))
    again = read_all(write_synthetic_shards(tmp_path / "b", seed=1, **args))
    other = read_all(write_synthetic_shards(tmp_path / "c", seed=2, **args))
    assert all(np.array_equal(x, y) for x, y in zip(first, again))
    assert not np.array_equal(first[0][:1000], other[0][:1000])
    assert sum(len(s) for s in first) == 60_000
    for tokens in first:
        assert tokens[-1] == 0 and 10 < (tokens == 0).sum() < len(tokens) / 20
        assert tokens.max() < 512


def test_learnable_bigram_language(tmp_path):
    stream = np.concatenate(read_all(write_synthetic_shards(
        tmp_path, vocab_size=512, eos_id=0, n_tokens=200_000, n_shards=1, seed=0, token_dtype="uint32"), np.uint32))
    pairs = np.zeros((512, 512))
    np.add.at(pairs, (stream[:-1], stream[1:]), 1)
    probabilities = pairs / np.maximum(pairs.sum(axis=1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(pairs * np.log(np.where(probabilities > 0, probabilities, 1))) / pairs.sum()
    # A bigram model gets near the chain's entropy, far below a uniform guess.
    assert entropy < np.log(BRANCHING) + 0.1 < np.log(512) / 3


def test_the_tiny_config_loads_it(tmp_path):
    """Shards written with the tiny config's vocabulary, EOS and token dtype load under that config: full
    batches of its shape whose instances are consecutive tokens of the shards. (Training the tiny model on this
    language: tests/train/test_train.py, test_loss_decreases_on_the_generated_language.)"""
    config = load_config("tiny")
    paths = write_synthetic_shards(tmp_path, vocab_size=config.model.vocab_size, eos_id=config.data.eos_id,
                                   n_tokens=100_000, n_shards=2, seed=0, token_dtype=config.data.token_dtype)
    config.data.paths = paths
    loader = build_loader(config.data, global_batch_instances=config.train.global_batch_instances,
                          vocab_size=config.model.vocab_size)
    batch = next(loader)
    assert batch["input_ids"].shape == (config.train.global_batch_instances, config.data.sequence_length)
    assert batch["instance_mask"].all()
    T = config.data.sequence_length
    instances = np.concatenate([s[: len(s) // T * T].reshape(-1, T) for s in read_all(paths)])
    assert all((instances == row).all(axis=1).any() for row in np.asarray(batch["input_ids"]))
