"""Token shards in buckets: read by byte range through faults, batch for batch what the same shards give
from local disk; a replaced object is named on resume."""

from __future__ import annotations

import numpy as np
import pytest

from olmax import storage
from olmax.config import DataConfig
from olmax.data import build_loader
from olmax.data.shards import DataError, write_shard, write_shards_record

VOCAB, LENGTH = 1000, 64


def _shards(tmp_path) -> list:
    rng = np.random.default_rng(0)
    paths = []
    for i, tokens in enumerate((LENGTH * 37 + 5, LENGTH * 20, LENGTH * 11 + 63)):
        path = tmp_path / "shards" / f"part-{i}.npy"
        path.parent.mkdir(exist_ok=True)
        write_shard(path, rng.integers(0, VOCAB - 1, tokens, dtype=np.uint32))
        paths.append(path)
    write_shards_record(tmp_path / "shards", [str(p) for p in paths], token_dtype="uint32", vocab_size=VOCAB,
                        eos_id=0)
    return paths


def _batches(data: DataConfig, steps: int) -> list[np.ndarray]:
    with build_loader(data, global_batch_instances=8, vocab_size=VOCAB) as loader:
        return [next(loader)["input_ids"] for _ in range(steps)]


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_bucket_batches_are_the_local_ones_through_faults(stores, kind, tmp_path):
    paths = _shards(tmp_path)
    base = f"{kind}://{stores.bucket}/tokens"
    storage.upload(tmp_path / "shards", base)
    # OLMo-core's mixes: relative paths resolved against a remote base (data.mix_base_dir).
    storage.write_bytes(f"{kind}://{stores.bucket}/mix.txt",
                        "".join(f"web,{p.name}\n" for p in paths).encode())
    local = DataConfig(paths=[str(p) for p in paths], sequence_length=LENGTH, eos_id=0, pad_id=1)
    expected = _batches(local, 12)
    stores.set_faults(share=0.1)
    remote = local.model_copy(update=dict(paths=[], mix_file=f"{kind}://{stores.bucket}/mix.txt",
                                          mix_base_dir=base, num_workers=2))
    got = _batches(remote, 12)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    proxy = stores.s3 if kind == "s3" else stores.gcs
    assert proxy.faults > 0


def test_replaced_object_is_named_on_resume(stores, tmp_path):
    paths = _shards(tmp_path)
    base = f"s3://{stores.bucket}/tokens"
    storage.upload(tmp_path / "shards", base)
    data = DataConfig(paths=[f"{base}/{p.name}" for p in paths], sequence_length=LENGTH, eos_id=0, pad_id=1)
    with build_loader(data, global_batch_instances=8, vocab_size=VOCAB) as loader:
        next(loader)
        state = loader.state_dict()
    replaced = np.fromfile(paths[1], dtype=np.uint32)[::-1].copy()  # same size, other tokens
    storage.write_bytes(f"{base}/{paths[1].name}", replaced.tobytes())
    with build_loader(data, global_batch_instances=8, vocab_size=VOCAB) as loader:
        with pytest.raises(DataError, match="shard 1: part-1.npy was replaced"):
            loader.load_state_dict(state)


def test_missing_shard_object_is_a_storage_error(stores):
    data = DataConfig(paths=[f"s3://{stores.bucket}/nope.npy"], sequence_length=LENGTH, eos_id=0, pad_id=1)
    with pytest.raises(storage.StorageError, match=f"s3://{stores.bucket}/nope.npy does not exist"):
        build_loader(data, global_batch_instances=8, vocab_size=VOCAB)


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_range_read_cut_short_is_retried_at_start_up_and_in_training(stores, kind, tmp_path):
    """A body cut short under a Content-Length that matches it is a fault on the way, not a shard that shrank."""
    paths = _shards(tmp_path)
    base = f"{kind}://{stores.bucket}/tokens"
    storage.upload(tmp_path / "shards", base)
    local = DataConfig(paths=[str(p) for p in paths], sequence_length=LENGTH, eos_id=0, pad_id=1)
    expected = _batches(local, 6)
    proxy, media = (stores.s3, "$") if kind == "s3" else (stores.gcs, r"\?alt=media")
    cut = proxy.add("truncate", method="GET", path=rf"part-0\.npy{media}", times=4)  # the first at start-up
    before = storage.retries()
    remote = local.model_copy(update=dict(paths=[f"{base}/{p.name}" for p in paths]))
    with build_loader(remote, global_batch_instances=8, vocab_size=VOCAB) as loader:
        got = [next(loader)["input_ids"] for _ in range(6)]
        state = loader.state_dict()
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    assert cut.hits == 4 and storage.retries() - before >= 4
    with build_loader(remote, global_batch_instances=8, vocab_size=VOCAB) as loader:
        loader.load_state_dict(state)  # what it recorded of the data is what a clean start reads


def test_a_shard_that_really_shrank_is_still_refused(stores, tmp_path):
    paths = _shards(tmp_path)
    base = f"s3://{stores.bucket}/tokens"
    storage.upload(tmp_path / "shards", base)
    data = DataConfig(paths=[f"{base}/{p.name}" for p in paths], sequence_length=LENGTH, eos_id=0, pad_id=1)
    with build_loader(data, global_batch_instances=8, vocab_size=VOCAB) as loader:
        for path in paths:  # rewritten during the run: one instance left of each
            storage.write_bytes(f"{base}/{path.name}", path.read_bytes()[:LENGTH * 4])
        with pytest.raises(DataError, match=f"shard {base}/part-.\\.npy shrank while reading"):
            next(loader)


def test_a_flip_on_every_read_of_a_new_runs_shard_is_not_its_data_record(stores, tmp_path):
    """The run's record of a shard in a bucket is the store's version of it, not bytes read through the network: a
    bit flipped on every read while a new run starts does not make the next, clean, start refuse the data."""
    shard = tmp_path / "big.npy"  # larger than the bytes a record would hash: those are range reads
    write_shard(shard, np.random.default_rng(0).integers(0, VOCAB - 1, 100_000, dtype=np.uint32))
    storage.upload(shard, f"s3://{stores.bucket}/big.npy")
    data = DataConfig(paths=[f"s3://{stores.bucket}/big.npy"], sequence_length=LENGTH, eos_id=0, pad_id=1)
    flip = stores.s3.add("flip", method="GET", path=r"big\.npy")
    with build_loader(data, global_batch_instances=8, vocab_size=VOCAB) as loader:
        state = loader.state_dict()
    assert flip.hits
    stores.s3.remove(flip)
    with build_loader(data, global_batch_instances=8, vocab_size=VOCAB) as loader:
        loader.load_state_dict(state)
