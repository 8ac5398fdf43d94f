"""olmax's loader against ai2-olmo-core's own NumpyFSLDataset / NumpyFSLDataLoader on a generated mix."""

import json

import numpy as np
import pytest

from olmax.config import DataConfig, RepetitionFilterConfig
from olmax.data import build_loader
from olmax.data.order import epoch_order
from olmax.data.synthetic import write_synthetic_shards

olmo_data = pytest.importorskip("olmo_core.data")
from olmo_core.data.numpy_dataset import InstanceFilterConfig  # noqa: E402

VOCAB, EOS, PAD, SEED = 512, 0, 1, 34521


def olmo_core_loader(paths, *, dtype, length, global_batch, rank, world, work_dir, filtered=False):
    dataset = olmo_data.NumpyFSLDataset(
        *paths, sequence_length=length, pad_token_id=PAD, eos_token_id=EOS, vocab_size=VOCAB, dtype=dtype,
        instance_filter_config=InstanceFilterConfig() if filtered else None,
    )
    dataset.work_dir = work_dir
    dataset.prepare()
    return dataset, olmo_data.NumpyFSLDataLoader(
        dataset, collator=olmo_data.DataCollator(pad_token_id=PAD), global_batch_size=global_batch * length,
        work_dir=work_dir, seed=SEED, dp_world_size=world, dp_rank=rank, fs_local_rank=0, num_threads=0,
    )


def olmo_core_batches(loader, epochs):
    for epoch in range(1, epochs + 1):
        loader.reshuffle(epoch=epoch)
        yield from loader
        loader.reset()


def data_config(paths, *, token_dtype, length, filtered=False, **extra):
    return DataConfig(
        paths=paths, sequence_length=length, eos_id=EOS, pad_id=PAD, token_dtype=token_dtype, seed=SEED,
        repetition_filter=RepetitionFilterConfig(enabled=filtered), **extra,
    )


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_same_batches_as_olmo_core_over_epochs(tmp_path, token_dtype, world):
    length, global_batch = 32, 24
    # Uneven shards, so tails are dropped and instances must not cross files.
    paths = write_synthetic_shards(tmp_path, vocab_size=VOCAB, eos_id=EOS, n_tokens=40_000, n_shards=5, seed=7,
                                   token_dtype=token_dtype)
    for rank in range(world):
        dataset, reference = olmo_core_loader(paths, dtype=np.dtype(token_dtype).type, length=length,
                                              global_batch=global_batch, rank=rank, world=world, work_dir=tmp_path)
        loader = build_loader(data_config(paths, token_dtype=token_dtype, length=length),
                              global_batch_instances=global_batch, vocab_size=VOCAB,
                              process_index=rank, process_count=world)
        assert loader.batches_per_epoch == reference.total_batches
        count = 0
        for expected in olmo_core_batches(reference, epochs=3):
            batch = next(loader)
            assert batch["input_ids"].dtype == np.int32
            assert batch["input_ids"].shape == (global_batch // world, length)
            np.testing.assert_array_equal(batch["input_ids"], expected["input_ids"].numpy())
            count += 1
        assert count == 3 * reference.total_batches
        assert loader.state_dict()["epoch"] == 4
        loader.close()


def test_order_is_olmo_core_global_indices(tmp_path):
    paths = write_synthetic_shards(tmp_path, vocab_size=VOCAB, eos_id=EOS, n_tokens=30_000, n_shards=3, seed=1)
    dataset, reference = olmo_core_loader(paths, dtype=np.uint16, length=16, global_batch=8, rank=0, world=1,
                                          work_dir=tmp_path)
    for epoch in (1, 2, 5):
        reference.reshuffle(epoch=epoch)
        np.testing.assert_array_equal(epoch_order(len(dataset), SEED, epoch), reference.get_global_indices())


def test_repetition_filter_matches_olmo_core_instance_mask(tmp_path):
    length, global_batch = 512, 8
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, VOCAB, size=64 * length)
    # Plant repeats of periods 1..14 and counts around the threshold of 32 in every other instance.
    for instance in range(0, 64, 2):
        period, count = int(rng.integers(1, 15)), int(rng.integers(28, 37))
        start = instance * length + int(rng.integers(0, length - period * count))
        tokens[start : start + period * count] = np.tile(rng.integers(2, VOCAB, size=period), count)
    tokens[-1] = EOS
    path = tmp_path / "repeats.npy"
    tokens.astype(np.uint16).tofile(path)
    _, reference = olmo_core_loader([path], dtype=np.uint16, length=length, global_batch=global_batch, rank=0,
                                    world=1, work_dir=tmp_path, filtered=True)
    loader = build_loader(data_config([str(path)], token_dtype="uint16", length=length, filtered=True),
                          global_batch_instances=global_batch, vocab_size=VOCAB)
    masked = 0
    for expected in olmo_core_batches(reference, epochs=1):
        batch = next(loader)
        np.testing.assert_array_equal(batch["instance_mask"], expected["instance_mask"].numpy())
        masked += int((~batch["instance_mask"]).sum())
    assert 5 < masked < 40  # both outcomes were exercised


def test_resume_state_matches_olmo_core_position(tmp_path):
    """After the same batches, the loaders agree on epoch, batches and tokens processed."""
    length, global_batch = 32, 8
    paths = write_synthetic_shards(tmp_path, vocab_size=VOCAB, eos_id=EOS, n_tokens=20_000, n_shards=2, seed=3)
    _, reference = olmo_core_loader(paths, dtype=np.uint16, length=length, global_batch=global_batch, rank=0,
                                    world=1, work_dir=tmp_path)
    loader = build_loader(data_config(paths, token_dtype="uint16", length=length),
                          global_batch_instances=global_batch, vocab_size=VOCAB)
    advance_together(loader, reference, 5)


def advance_together(loader, reference, batches):
    """Take `batches` of epoch 1 from both loaders; their states, which must agree on the position."""
    reference.reshuffle(epoch=1)
    taken = iter(reference)
    for _ in range(batches):
        next(taken)
        next(loader)
    ours, theirs = json.loads(json.dumps(loader.state_dict())), reference.state_dict()
    for key in ("epoch", "batches_processed", "tokens_processed", "seed"):
        assert ours[key] == theirs[key], key
    return ours, theirs
