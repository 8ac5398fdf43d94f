"""The repetition filter against OLMo-core's `find_periodic_sequences` decision, instance by instance."""

import numpy as np
import pytest

from olmax.data.filters import repetition_keep

olmo_utils = pytest.importorskip("olmo_core.data.utils")


def olmo_core_keep(instance, *, min_period, max_period, max_count):
    """OLMo-core's `NumpyDatasetBase._validate_instance`."""
    return not any(
        m.times >= max_count
        for m in olmo_utils.find_periodic_sequences(instance.astype(np.int64), max_period, min_period)
    )


def planted(rng, count, length, alphabet):
    """Random instances, most with a stretch repeated with some period, near the threshold, anywhere."""
    tokens = rng.integers(0, alphabet, size=(count, length))
    for row in tokens:
        if rng.random() < 0.2:
            continue
        period = int(rng.integers(1, 16))
        span = min(length, period * int(rng.integers(2, 40)) + int(rng.integers(0, period)))
        start = int(rng.integers(0, length - span + 1))
        unit = rng.integers(0, alphabet, size=period)
        row[start : start + span] = np.resize(unit, span)
    return tokens


@pytest.mark.parametrize(
    "length,alphabet,min_period,max_period,max_count",
    [
        (512, 1000, 1, 13, 32),  # the 32B recipe's settings
        (512, 3, 1, 13, 32),  # tiny alphabet: natural repeats everywhere
        (96, 50, 1, 13, 32),  # short instances: periods capped at length // 3
        (40, 4, 2, 13, 5),
        (300, 20, 3, 7, 8),
        (64, 10, 1, 20, 2),  # OLMo-core only counts 3+ repeats
        (13, 2, 1, 13, 3),
    ],
)
def test_same_decision_as_olmo_core(length, alphabet, min_period, max_period, max_count):
    rng = np.random.default_rng(length * 1000 + alphabet)
    tokens = planted(rng, 300, length, alphabet)
    settings = dict(min_period=min_period, max_period=max_period, max_count=max_count)
    expected = np.array([olmo_core_keep(row, **settings) for row in tokens])
    np.testing.assert_array_equal(repetition_keep(tokens, **settings), expected)
    assert 0 < expected.sum() < len(expected) or alphabet == 3  # both outcomes exercised


def test_exact_threshold():
    settings = dict(min_period=1, max_period=13, max_count=32)
    rng = np.random.default_rng(1)
    for period in (1, 5, 13):
        for repeats, kept in ((31, True), (32, False)):
            row = rng.integers(100, 10_000, size=1024)
            unit = np.arange(period)
            row[200 : 200 + period * repeats] = np.tile(unit, repeats)
            # A partial repeat after the last whole one does not count as another.
            row[200 + period * repeats] = 99
            assert repetition_keep(row[None], **settings)[0] == kept == olmo_core_keep(row, **settings)
