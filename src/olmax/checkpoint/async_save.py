"""Checkpoints that do not stall the step: the state is copied to host memory (the only wait), then written
and, for a run in a bucket, uploaded in the background while training goes on.

Orbax's asynchronous CheckpointManager does the copy and the write: its `save` returns once every array is
on the host, and it renames the step's temporary directory into place only when every file is written, so
a torn write is never a checkpoint. A thread of ours then waits for that write and uploads the step with
its commit marker last (olmax.train.bucket_run). One save is in flight at most: the next waits for it
(`save` returns how long), so saves never pile up. Orbax deletes the steps no longer kept only after the new
one is committed, and the bucket's are deleted after its upload.

An error of the background work (a full disk, a store that keeps failing) is raised by the next `save` or
by `finish`, on the training thread. With a synchronous Checkpointer (`checkpoint.async: false`) `save`
writes and uploads before it returns.
"""

from __future__ import annotations

import threading
import time

from olmax.checkpoint import Checkpointer


class AsyncSaver:
    """Saves of one run's checkpointer; `upload(step, kept_steps)` is called once step `step` is written
    (a run in a bucket uploads it there), on the background thread."""

    def __init__(self, checkpointer: Checkpointer, upload=None):
        self.checkpointer, self.upload = checkpointer, upload
        self.committed = 0  # the newest step this saver wrote and uploaded (0: none yet)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state, meta: dict) -> float:
        """Start checkpoint `step` once the one in flight is done; returns the seconds waited for that one."""
        waited = self.finish()
        self.checkpointer.save(step, state, meta)
        if not self.checkpointer.asynchronous:  # written already: upload it now too
            self._complete(step)
            self.finish()
            return waited
        self._thread = threading.Thread(target=self._complete, args=(step,), name=f"olmax-save-{step}", daemon=True)
        self._thread.start()
        return waited

    def finish(self) -> float:
        """Wait until the save in flight is written, uploaded and committed; raise its error. The seconds waited."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return time.perf_counter() - start

    def _complete(self, step: int) -> None:
        try:
            self.checkpointer.finish()
            if self.upload is not None:
                self.upload(step, self.checkpointer.all_steps())
            self.committed = step
        except BaseException as err:  # raised on the training thread by the next save or finish
            self._error = err
