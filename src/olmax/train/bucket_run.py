"""A run whose output_dir is a bucket (gs://, s3://): it works in a local staging directory and uploads.

On start the bucket's run directory is copied down (metrics.jsonl, TensorBoard
events, every checkpoint step that carries its commit marker; a step without
one is an upload cut short and is left out, with one line saying so). Then
metrics and events go up at every log interval and before each checkpoint, and
each checkpoint step goes up file by file with its commit marker last; steps
the checkpointer no longer keeps (keep_last / keep_every) are deleted from the
bucket. A host that dies loses at most one log interval of metrics, and never
leaves a step that a resume would take for complete.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from olmax import storage
from olmax.checkpoint.remote import CHECKPOINTS, pull_steps

METRICS = ("metrics.jsonl", "tensorboard")


class BucketRun:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.local = Path(tempfile.mkdtemp(prefix="olmax-run-"))
        self.pull()

    def pull(self) -> None:
        for name in storage.listdir(self.url):
            if name != CHECKPOINTS:
                storage.download(storage.join(self.url, name), self.local / name)
        pull_steps(storage.join(self.url, CHECKPOINTS), self.local / CHECKPOINTS)

    def push_metrics(self) -> None:
        for name in METRICS:
            if (self.local / name).exists():
                storage.upload(self.local / name, storage.join(self.url, name))

    def push_checkpoint(self, step: int, kept: list[int]) -> None:
        """Upload checkpoint `step` (marker last), then delete the bucket's steps not in `kept`."""
        remote = storage.join(self.url, CHECKPOINTS)
        storage.upload_committed(self.local / CHECKPOINTS / str(step), storage.join(remote, str(step)))
        for name in storage.listdir(remote):
            if name.isdigit() and int(name) not in kept:
                storage.remove_committed(storage.join(remote, name))

    def close(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)
