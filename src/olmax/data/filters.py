"""OLMo-core's n-gram repetition filter, vectorized over a batch.

OLMo-core (`find_periodic_sequences`) masks an instance when, for some period
p in [min_period, min(max_period, len // 3)], a stretch of it repeats with
period p at least `max_count` times, counting `times = span // p` and only
stretches of three or more repeats. A stretch of span `run + p` is exactly a
maximal run of `run` positions i with x[i] == x[i + p]; so an instance is
masked iff, for some p, x[i] == x[i + p] holds on `p * (max(max_count, 3) - 1)`
consecutive positions. (tests/data/test_data_filters.py checks this against
OLMo-core's own function.)
"""

from __future__ import annotations

import numpy as np


def repetition_keep(tokens: np.ndarray, *, min_period: int, max_period: int, max_count: int) -> np.ndarray:
    """[instances, length] token ids -> bool [instances]: False where OLMo-core would mask the instance."""
    count, length = tokens.shape
    keep = np.ones(count, dtype=bool)
    repeats = max(max_count, 3)
    for period in range(min_period, min(max_period, length // 3) + 1):
        rows = np.flatnonzero(keep)
        if rows.size == 0:
            break
        equal = tokens[rows, period:] == tokens[rows, :-period]
        hit = _has_true_run(equal, period * (repeats - 1))
        keep[rows[hit]] = False
    return keep


def _has_true_run(flags: np.ndarray, run: int) -> np.ndarray:
    """bool [rows, n] -> bool [rows]: does the row hold `run` consecutive Trues?

    `flags[:, i]` is widened to "flags[i : i + width] all true" by doubling the
    width; rows without any True left are dropped as soon as they appear, which
    on real text is after a step or two.
    """
    result = np.zeros(len(flags), dtype=bool)
    rows = np.arange(len(flags))
    width = 1
    while True:
        alive = flags.any(axis=1)
        if not alive.all():
            rows, flags = rows[alive], flags[alive]
            if rows.size == 0:
                return result
        if width >= run:
            result[rows] = True
            return result
        step = min(width, run - width)
        flags = flags[:, :-step] & flags[:, step:]
        width += step
