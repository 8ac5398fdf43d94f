"""Properties of the data order for any process count and resume point, and the double-sharding regression.

The shards hold a running counter, so an instance's first token names it. The
reference order below is spelled out from OLMo-core's semantics (and test_data_order.py
shows it is OLMo-core's).
"""

import json

import numpy as np
import pytest

from olmax.config import DataConfig
from olmax.data import Loader, build_loader

LENGTH, GLOBAL_BATCH, SEED = 8, 24, 34521
# Shard sizes in tokens: tails of 3, 0, 7 and 1 tokens are dropped.
SHARD_TOKENS = [70 * LENGTH + 3, 45 * LENGTH, 61 * LENGTH + 7, 33 * LENGTH + 1]
PROCESS_COUNTS = [1, 2, 3, 4, 8]


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mix")
    paths, first_token_of, start, instance = [], {}, 0, 0
    for index, tokens in enumerate(SHARD_TOKENS):
        path = directory / f"shard-{index}.npy"
        np.arange(start, start + tokens, dtype=np.uint32).tofile(path)
        for offset in range(0, tokens - LENGTH + 1, LENGTH):
            first_token_of[start + offset] = instance
            instance += 1
        paths.append(str(path))
        start += tokens
    return paths, first_token_of, start


def make_loader(mix, process_index=0, process_count=1, global_batch=GLOBAL_BATCH, loader_class=Loader, **data):
    paths, _, vocab = mix
    config = DataConfig(paths=paths, sequence_length=LENGTH, eos_id=0, pad_id=1, token_dtype="uint32", seed=SEED,
                        **data)
    loader = build_loader(config, global_batch_instances=global_batch, vocab_size=vocab,
                          process_index=process_index, process_count=process_count)
    if loader_class is not Loader:
        loader.__class__ = loader_class
    return loader


def instance_ids(mix, batch):
    _, first_token_of, _ = mix
    rows = batch["input_ids"]
    assert np.all(rows[:, 1:] == rows[:, :1] + np.arange(1, LENGTH)), "an instance is not contiguous"
    return np.array([first_token_of[int(t)] for t in rows[:, 0]])


def reference_batch(num_instances, step, global_batch=GLOBAL_BATCH):
    batches = num_instances // global_batch
    epoch, row = divmod(step, batches)
    order = np.arange(num_instances, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(SEED + epoch + 1)).shuffle(order)
    return order[: batches * global_batch].reshape(batches, global_batch)[row]


NUM_INSTANCES = sum(t // LENGTH for t in SHARD_TOKENS)
BATCHES_PER_EPOCH = NUM_INSTANCES // GLOBAL_BATCH


def global_batches(mix, process_count, steps, loader_class=Loader, **data):
    """Global batches of the first `steps` steps, put together from every process's slice."""
    out = np.empty((steps, GLOBAL_BATCH), dtype=np.int64)
    for process in range(process_count):
        loader = make_loader(mix, process, process_count, loader_class=loader_class, **data)
        for step in range(steps):
            out[step, process::process_count] = instance_ids(mix, next(loader))
        loader.close()
    return out


def check_union_is_global_batch(mix, process_count, loader_class=Loader, **data):
    steps = 2 * BATCHES_PER_EPOCH + 3
    batches = global_batches(mix, process_count, steps, loader_class, **data)
    for step in range(steps):
        np.testing.assert_array_equal(batches[step], reference_batch(NUM_INSTANCES, step), err_msg=f"step {step}")


def check_each_instance_once_per_epoch(mix, process_count, loader_class=Loader, **data):
    batches = global_batches(mix, process_count, 2 * BATCHES_PER_EPOCH, loader_class, **data)
    for epoch in batches.reshape(2, -1):
        assert len(np.unique(epoch)) == len(epoch) == BATCHES_PER_EPOCH * GLOBAL_BATCH, "an instance repeats"
        assert set(epoch) <= set(range(NUM_INSTANCES))


def check_resume_equals_continuous(mix, process_count, resume_at, loader_class=Loader, **data):
    steps = 2 * BATCHES_PER_EPOCH + 2
    for process in range(process_count):
        continuous = make_loader(mix, process, process_count, loader_class=loader_class, **data)
        expected = [instance_ids(mix, next(continuous)) for _ in range(steps)]
        first = make_loader(mix, process, process_count, loader_class=loader_class, **data)
        for _ in range(resume_at):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = make_loader(mix, process, process_count, loader_class=loader_class, **data)
        resumed.load_state_dict(state)
        for step in range(resume_at, steps):
            got = instance_ids(mix, next(resumed))
            np.testing.assert_array_equal(got, expected[step], err_msg=f"process {process}, step {step}")
            reference = reference_batch(NUM_INSTANCES, step)[process::process_count]
            np.testing.assert_array_equal(got, reference, err_msg=f"process {process}, step {step}")
        continuous.close()
        resumed.close()


RESUME_POINTS = [0, 1, BATCHES_PER_EPOCH - 1, BATCHES_PER_EPOCH, BATCHES_PER_EPOCH + 3]


@pytest.mark.parametrize("process_count", PROCESS_COUNTS)
def test_union_of_slices_is_the_global_batch(mix, process_count):
    check_union_is_global_batch(mix, process_count)


@pytest.mark.parametrize("process_count", PROCESS_COUNTS)
def test_each_instance_once_per_epoch(mix, process_count):
    check_each_instance_once_per_epoch(mix, process_count)


@pytest.mark.parametrize("process_count", PROCESS_COUNTS)
@pytest.mark.parametrize("resume_at", RESUME_POINTS)
def test_resume_equals_continuous(mix, process_count, resume_at):
    check_resume_equals_continuous(mix, process_count, resume_at)


@pytest.mark.parametrize("process_count", [1, 3])
def test_properties_hold_with_prefetch_threads(mix, process_count):
    check_union_is_global_batch(mix, process_count, num_workers=2)
    check_resume_equals_continuous(mix, process_count, BATCHES_PER_EPOCH - 1, num_workers=2)


@pytest.mark.parametrize("old,new", [(2, 8), (8, 3), (4, 1)])
def test_resume_with_another_process_count(mix, old, new):
    resume_at = BATCHES_PER_EPOCH + 2
    loaders = [make_loader(mix, p, old) for p in range(old)]
    for _ in range(resume_at):
        for loader in loaders:
            next(loader)
    state = loaders[0].state_dict()
    assert all(loader.state_dict() == state for loader in loaders)
    resumed = [make_loader(mix, p, new) for p in range(new)]
    for step in range(resume_at, resume_at + 4):
        batch = np.empty(GLOBAL_BATCH, dtype=np.int64)
        for process, loader in enumerate(resumed):
            if step == resume_at:
                loader.load_state_dict(state)
            batch[process::new] = instance_ids(mix, next(loader))
        np.testing.assert_array_equal(batch, reference_batch(NUM_INSTANCES, step))


def test_new_global_batch_size_resumes_at_the_same_tokens(mix):
    loader = make_loader(mix)
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    smaller = make_loader(mix, global_batch=GLOBAL_BATCH // 2)
    smaller.load_state_dict(state)
    # Batch 3 of 24 instances is batches 6 and 7 of 12: the same epoch order, cut finer.
    assert smaller.state_dict()["batches_processed"] == 6
    together = np.concatenate([instance_ids(mix, next(smaller)) for _ in range(2)])
    np.testing.assert_array_equal(together, reference_batch(NUM_INSTANCES, 3))
    assert smaller.state_dict()["tokens_processed"] == 4 * GLOBAL_BATCH * LENGTH


class TooFastCursor(Loader):
    """MaxText's double sharding: the position moves k batches for every batch handed out."""

    k = 2

    def _advance(self):
        self.step += self.k


@pytest.mark.parametrize("k,process_count", [(2, 1), (3, 3), (8, 8)])
def test_a_too_fast_cursor_fails_every_property(mix, k, process_count):
    TooFastCursor.k = k
    with pytest.raises(AssertionError):
        check_union_is_global_batch(mix, process_count, loader_class=TooFastCursor)
    with pytest.raises(AssertionError):
        check_each_instance_once_per_epoch(mix, process_count, loader_class=TooFastCursor)
    with pytest.raises(AssertionError):
        check_resume_equals_continuous(mix, process_count, resume_at=1, loader_class=TooFastCursor)


def test_state_after_batch_n_resumes_at_batch_n_plus_one(mix):
    """MaxText's off-by-one: the state saved after step N must give batch N + 1 next, not replay N."""
    loader = make_loader(mix, num_workers=2)
    seen = [instance_ids(mix, next(loader)) for _ in range(5)]
    state = loader.state_dict()
    assert state["batches_processed"] == 5
    resumed = make_loader(mix)
    resumed.load_state_dict(state)
    following = instance_ids(mix, next(resumed))
    np.testing.assert_array_equal(following, instance_ids(mix, next(loader)))
    assert not set(following) & set(np.concatenate(seen))
