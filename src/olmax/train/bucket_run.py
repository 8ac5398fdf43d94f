"""A run whose output_dir is a bucket (gs://, s3://): it works in a local staging directory and uploads.

On start the bucket's run directory is copied down (metrics.jsonl, TensorBoard
events and the newest checkpoint step that carries its commit marker; a step
without one is an upload cut short and is left out, with one line saying so).
An older step is copied down only when the newer ones turn out unreadable
(`fetch`), and the steps the retention rule keeps are judged over the bucket's
steps, not the local copy's. Then
metrics, events and the goodput record go up at every log interval and before
each checkpoint (and once, a damaged record the run set aside, so that it is
kept in the bucket beside the new one, not in the staging directory alone),
and each checkpoint step goes up (in the background, see
olmax.checkpoint.async_save) file by file with its commit marker last; steps
the checkpointer no longer keeps (keep_last / keep_every) are deleted from the
bucket. A host that dies loses at most one log interval of metrics, and never
leaves a step that a resume would take for complete. Every write and deletion
passes the fence of the run's lease (olmax.run_lock): a run that lost it, to
another run that took the directory over, sends nothing more there.

In a multi-process run every process stages on its own disk (hosts share no
filesystem): each copies the run down, writes the shards it holds of each
checkpoint (olmax.checkpoint.Checkpointer's `own_copy`) and uploads them into
the step's prefix; after a barrier process 0 uploads its copy (its metadata is
the one kept) and then the commit marker. Process 0 alone writes metrics and
deletes the steps no longer kept.

A listing can be stale (an S3-compatible store, a cache in between) and a run
that believed one would start over and delete what it had. So after each
commit the run records its latest committed step in OUTPUT_DIR/committed.json,
read at start by name, not through a listing; a listing that shows an older
latest step, or no metrics.jsonl where the object exists, is listed again with
backoff for storage.retry_seconds, then the run stops with exit 2 naming both.
Nor does a run ever delete a committed step newer than the one it copied down,
unless it wrote that step itself.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from olmax import run_lock, storage
from olmax.checkpoint import retained
from olmax.checkpoint.remote import pull_steps
from olmax.config import CheckpointConfig
from olmax.errors import LeaseLost
from olmax.run_dir import RunDir, committed_steps

log = logging.getLogger(__name__)

FIRST_RELIST_S = 0.5
DAMAGED = ".damaged-"  # in the name of a file set aside (olmax.run_dir.set_aside)


def barrier(name: str) -> None:
    """Wait until every process gets here, through the coordination service rather than a collective on the
    devices: the upload runs on a background thread while the training thread runs the steps' collectives."""
    ocp.multihost.sync_global_processes(name, processes=set(range(jax.process_count())))


class BucketRun:
    def __init__(self, url: str, keep: CheckpointConfig):
        self.run, self.keep = RunDir(url), keep
        self.local = Path(tempfile.mkdtemp(prefix="olmax-run-"))
        self.staged = RunDir(self.local)
        self.steps: list[int] = []  # the bucket's committed steps at the start
        self.pushed: set[int] = set()
        self.pull()

    def pull(self) -> None:
        names, steps = self._listing()
        for name in names if jax.process_index() == 0 else []:  # it writes the metrics
            if name not in (RunDir.checkpoints.name, RunDir.committed_record.name) and DAMAGED not in name:
                storage.download(self.run.path(name), self.staged.path(name))
        pull_steps(self.run.checkpoints, self.staged.checkpoints, steps[-1:])  # the one a resume restores
        self.steps = steps

    @property
    def pulled_step(self) -> int:
        """The newest step at the start: older ones may be deleted, newer ones are not this run's."""
        return max(self.steps, default=0)

    def fetch(self, step: int) -> None:
        """Copy committed step `step` down unless it is here already (a resume falling back to an older one)."""
        if not (self.staged.checkpoints / str(step)).exists():
            pull_steps(self.run.checkpoints, self.staged.checkpoints, [step])

    def _listing(self) -> tuple[list[str], list[int]]:
        """The run directory's names and committed steps, listed again while they disagree with the run's record
        or with the objects themselves (see the module's doc)."""
        record = self.run.committed_record
        recorded = json.loads(storage.read_text(record))["latest_step"] if storage.exists(record) else 0
        first, wait = time.monotonic(), FIRST_RELIST_S
        while True:
            names = storage.listdir(self.run.location)
            steps = committed_steps(self.run.checkpoints)
            wrong = []
            if max(steps, default=0) < recorded:
                wrong.append(f"its newest committed checkpoint is {max(steps, default='none')} but {record} "
                             f"records step {recorded} as committed")
            if RunDir.metrics.name not in names and storage.exists(self.run.metrics):
                wrong.append(f"it has no {RunDir.metrics.name} but {self.run.metrics} exists")
            if not wrong:
                return names, steps
            if time.monotonic() - first >= storage.retry_seconds():
                raise storage.StorageError(
                    f"{self.run.location}: the store's listing disagrees with the run ({'; '.join(wrong)}) after "
                    f"{time.monotonic() - first:.0f}s of listing again; nothing was changed. The listing is stale "
                    "or objects were lost: check the store, then run again")
            log.warning("%s: the listing looks stale (%s); listing again in %.1fs", self.run.location,
                        "; ".join(wrong), wait)
            time.sleep(wait)
            wait = min(2 * wait, storage.MAX_BACKOFF_S)

    def remote_step(self, step: int) -> str:
        return storage.join(self.run.checkpoints, str(step))

    def push_metrics(self) -> None:
        run_lock.check_lease(self.run.location)  # a run that another has taken over writes nothing more
        for name in RunDir.METRIC_FILES if jax.process_index() == 0 else []:
            if self.staged.path(name).exists():
                storage.upload(self.staged.path(name), self.run.path(name))
        for aside in sorted(self.local.glob(f"*{DAMAGED}*")) if jax.process_index() == 0 else []:
            storage.upload(aside, self.run.path(aside.name))
            aside.unlink()  # kept in the bucket now: uploaded once
            log.warning("the damaged record is kept in the bucket as %s", self.run.path(aside.name))

    def push_checkpoint(self, step: int, kept: list[int]) -> None:
        """Upload checkpoint `step` (marker last), then delete the bucket's steps neither in `kept` (the local
        checkpointer's) nor kept by the retention rule over the bucket's steps."""
        try:
            if not self._upload(step):
                return
        except LeaseLost as err:
            raise LeaseLost(f"{err} (checkpoint {step} was left uncommitted there)") from None
        self.pushed.add(step)
        remote = self.run.checkpoints
        kept = set(kept) | retained(set(self.steps) | self.pushed, self.keep)  # committed: at the start, or ours
        for name in storage.listdir(remote):
            if not name.isdigit() or int(name) in kept:
                continue
            path = storage.join(remote, name)
            # A committed step newer than the one copied down that this run did not write is no step to drop.
            if int(name) <= self.pulled_step or int(name) in self.pushed or not storage.committed(path):
                storage.remove_committed(path)
        storage.write_bytes(self.run.committed_record, json.dumps({"latest_step": step}).encode())

    def _upload(self, step: int) -> bool:
        """Upload and commit checkpoint `step`: whether this process committed it (process 0 of several does)."""
        run_lock.check_lease(self.run.location)
        local, target = self.staged.checkpoints / str(step), self.remote_step(step)
        if jax.process_count() == 1:
            storage.upload_committed(local, target)
            return True
        first = jax.process_index() == 0
        if first and storage.exists(target):  # an upload cut short
            storage.remove_committed(target)
        barrier(f"olmax: upload checkpoint {step}")
        if not first:
            storage.upload(local, target)
        barrier(f"olmax: checkpoint {step} uploaded by every other process")
        if first:
            storage.upload(local, target)
            storage.commit(target)
        return first

    def close(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)
