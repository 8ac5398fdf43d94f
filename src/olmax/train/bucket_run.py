"""A run whose output_dir is a bucket (gs://, s3://): it works in a local staging directory and uploads.

On start the bucket's run directory is copied down (metrics.jsonl, TensorBoard
events, every checkpoint step that carries its commit marker; a step without
one is an upload cut short and is left out, with one line saying so). Then
metrics and events go up at every log interval and before each checkpoint, and
each checkpoint step goes up file by file with its commit marker last; steps
the checkpointer no longer keeps (keep_last / keep_every) are deleted from the
bucket. A host that dies loses at most one log interval of metrics, and never
leaves a step that a resume would take for complete.

In a multi-process run every process stages on its own disk (hosts share no
filesystem): each copies the run down, writes the shards it holds of each
checkpoint (olmax.checkpoint.Checkpointer's `own_copy`) and uploads them into
the step's prefix; after a barrier process 0 uploads its copy (its metadata is
the one kept) and then the commit marker. Process 0 alone writes metrics and
deletes the steps no longer kept.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from olmax import storage
from olmax.checkpoint.remote import pull_steps
from olmax.run_dir import RunDir


class BucketRun:
    def __init__(self, url: str):
        self.run = RunDir(url)
        self.local = Path(tempfile.mkdtemp(prefix="olmax-run-"))
        self.staged = RunDir(self.local)
        self.pull()

    def pull(self) -> None:
        for name in storage.listdir(self.run.location) if jax.process_index() == 0 else []:  # it writes the metrics
            if name != RunDir.checkpoints.name:
                storage.download(self.run.path(name), self.staged.path(name))
        pull_steps(self.run.checkpoints, self.staged.checkpoints)

    def push_metrics(self) -> None:
        for name in RunDir.METRIC_FILES if jax.process_index() == 0 else []:
            if self.staged.path(name).exists():
                storage.upload(self.staged.path(name), self.run.path(name))

    def push_checkpoint(self, step: int, kept: list[int]) -> None:
        """Upload checkpoint `step` (marker last), then delete the bucket's steps not in `kept`."""
        remote = self.run.checkpoints
        local, target = self.staged.checkpoints / str(step), storage.join(remote, str(step))
        if jax.process_count() == 1:
            storage.upload_committed(local, target)
        else:
            first = jax.process_index() == 0
            if first and storage.exists(target):  # an upload cut short
                storage.remove_committed(target)
            multihost_utils.sync_global_devices(f"olmax: upload checkpoint {step}")
            if not first:
                storage.upload(local, target)
            multihost_utils.sync_global_devices(f"olmax: checkpoint {step} uploaded by every other process")
            if not first:
                return
            storage.upload(local, target)
            storage.write_bytes(storage.join(target, storage.COMMIT_MARKER), b"")
        for name in storage.listdir(remote):
            if name.isdigit() and int(name) not in kept:
                storage.remove_committed(storage.join(remote, name))

    def close(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)
