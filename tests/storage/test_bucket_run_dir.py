"""A run directory in a bucket: only its newest step with a commit marker comes down (an older one when asked);
pruning deletes remote steps the retention rule does not keep, judged over the bucket's steps."""

from __future__ import annotations

import logging

from olmax import storage
from olmax.checkpoint import remote
from olmax.config import CheckpointConfig
from olmax.train.bucket_run import BucketRun


def test_uncommitted_step_is_not_a_checkpoint_and_pruning_deletes(stores, tmp_path, caplog):
    run = f"gs://{stores.bucket}/run"
    for step in ("1", "2", "3"):
        (tmp_path / step).mkdir()
        (tmp_path / step / "meta").write_text(step)
    storage.upload_committed(tmp_path / "1", f"{run}/checkpoints/1")
    storage.upload_committed(tmp_path / "2", f"{run}/checkpoints/2")
    storage.upload(tmp_path / "3", f"{run}/checkpoints/3")  # cut short: no marker
    storage.write_bytes(f"{run}/metrics.jsonl", b'{"step": 1}\n')
    with caplog.at_level(logging.WARNING):
        bucket = BucketRun(run, CheckpointConfig(keep_last=3))
    try:
        assert bucket.steps == [1, 2]
        assert sorted(p.name for p in (bucket.local / "checkpoints").iterdir()) == ["2"]  # what a resume restores
        assert not (bucket.local / "checkpoints" / "2" / storage.COMMIT_MARKER).exists()
        assert (bucket.local / "metrics.jsonl").read_text() == '{"step": 1}\n'
        assert f"{run}/checkpoints/3 has no commit marker" in caplog.text
        (bucket.local / "checkpoints" / "4").mkdir()
        (bucket.local / "checkpoints" / "4" / "meta").write_text("4")
        bucket.push_checkpoint(4, kept=[2, 4])  # the local checkpointer knows 2 and 4; the bucket keeps 1 too
        assert storage.listdir(f"{run}/checkpoints") == ["1", "2", "4"]
        assert storage.committed(f"{run}/checkpoints/4")
        bucket.fetch(1)
        assert (bucket.local / "checkpoints" / "1" / "meta").read_text() == "1"
        bucket.keep = CheckpointConfig(keep_last=2)
        bucket.push_checkpoint(4, kept=[2, 4])
        assert storage.listdir(f"{run}/checkpoints") == ["2", "4"]
    finally:
        bucket.close()
    copy = tmp_path / "copy" / "checkpoints"
    assert remote.fetch(f"{run}/checkpoints/4", tmp_path / "copy") == (copy / "4", f"{run}/checkpoints")
    assert (copy / "4" / "meta").read_text() == "4"
    latest = tmp_path / "latest" / "checkpoints" / "4"
    assert remote.fetch(run, tmp_path / "latest") == (latest, f"{run}/checkpoints")  # the latest alone
    assert sorted(p.name for p in (tmp_path / "latest" / "checkpoints").iterdir()) == ["4"]
    two = tmp_path / "two" / "checkpoints" / "2"
    assert remote.fetch(run, tmp_path / "two", step=2) == (two, f"{run}/checkpoints")
