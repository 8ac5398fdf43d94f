"""benchmarks/bucket_io.py runs at toy sizes against the test servers (the timing runs are made alone)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bucket_io", ROOT / "benchmarks" / "bucket_io.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bucket_benchmark_rows(stores, tmp_path):
    bench = _bench()
    local = bench.write_shards(tmp_path / "shards", 2, 4096)
    from olmax import storage

    storage.upload(tmp_path / "shards", f"s3://{stores.bucket}/shards")
    remote = [f"s3://{stores.bucket}/shards/{Path(p).name}" for p in local]
    for paths in (local, remote):
        for workers in (0, 2):
            row = bench.loader_row(paths, length=128, batch=8, batches=3, workers=workers)
            assert row["tokens_per_s"] > 0 and row["read_ahead"] == workers
    assert 5000 < bench.v5p_tokens_per_s() < 6000
    state = bench._state("tiny", ["params", "mu", "nu"])
    for url in (None, f"s3://{stores.bucket}/checkpoints"):
        row = bench.checkpoint_row(state, tmp_path / f"ckpt-{url is None}", url)
        assert row["restored_equal"] and row["save_s"] > 0
