"""OLMo-core's instance order: a pure function of (instances, seed, epoch, global batch, step).

Epoch e (from 1) shuffles `arange(N, dtype=uint32)` with
`Generator(PCG64(seed + e))`, truncates it to whole global batches and reshapes
it to (batches, global_batch); batch b is row b, and process p of P takes
columns p::P. The global batch at a step is the same whatever P.
"""

from __future__ import annotations

import numpy as np


def epoch_order(num_instances: int, seed: int, epoch: int) -> np.ndarray:
    """All instance ids of an epoch in OLMo-core's order (`NumpyFSLDataLoader._build_global_indices`)."""
    if epoch < 1:
        raise ValueError(f"epochs count from 1, got {epoch}")
    order = np.arange(num_instances, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(order)
    return order


def batches_per_epoch(num_instances: int, global_batch: int) -> int:
    return num_instances // global_batch


def local_rows(order: np.ndarray, global_batch: int, process_index: int, process_count: int) -> np.ndarray:
    """This process's columns of every global batch of the epoch: [batches, global_batch // process_count]."""
    batches = batches_per_epoch(len(order), global_batch)
    rows = order[: batches * global_batch].reshape(batches, global_batch)
    return np.ascontiguousarray(rows[:, process_index::process_count])
