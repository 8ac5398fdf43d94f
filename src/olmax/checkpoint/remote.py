"""Checkpoints in a bucket (gs://, s3://): a step counts only with its commit marker, and a reader copies
down just the step it reads.

A run in a bucket uploads each step file by file with `storage.COMMIT_MARKER`
last (train/bucket_run.py); a step without it is an upload cut short and is
never taken for a checkpoint. Evaluation, conversion, parity and warm starts
from a bucket read one step: the named one or the latest committed one.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from olmax import storage
from olmax.errors import CheckpointError
from olmax.run_dir import RunDir, committed_steps

KINDS = "a run directory, its checkpoints/ or one step of it (checkpoints/N)"


def pull_steps(remote: str, local: Path, steps: list[int] | None = None) -> None:
    """Copy committed steps of `remote` (all of them, or those named, which must be committed) into `local`."""
    for step in committed_steps(remote) if steps is None else steps:
        storage.download(storage.join(remote, str(step)), local / str(step))
        (local / str(step) / storage.COMMIT_MARKER).unlink()


def fetch(url: str, local: Path, step: int | None = None) -> tuple[Path, str]:
    """The checkpoint `url` names (see KINDS; its latest committed step unless the URL or `step` names one),
    copied into `local/checkpoints/STEP`: the local path of that step, and the URL of its checkpoints/."""
    url = url.rstrip("/")
    if storage.basename(url).isdigit():
        remote, step = storage.parent(url), int(storage.basename(url)) if step is None else step
    else:
        names = storage.listdir(url)
        if not names:
            raise CheckpointError(f"{url} does not exist or is empty; give {KINDS}")
        remote = RunDir(url).checkpoints if RunDir.checkpoints.name in names else url
    steps = committed_steps(remote)
    if step is None and not steps:
        raise CheckpointError(f"{remote} holds no committed olmax checkpoint; give {KINDS}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise CheckpointError(f"{storage.join(remote, str(step))} is not a committed checkpoint (committed: "
                              f"{steps or 'none'}); give one of those steps")
    pull_steps(remote, RunDir(local).checkpoints, [step])
    return RunDir(local).checkpoints / str(step), remote


@contextlib.contextmanager
def local_step(url: str, step: int | None = None):
    """`fetch` into a temporary directory: the local path of the step, removed after the block. A CheckpointError
    in the block (an unreadable step) names the step in the bucket, not its temporary copy."""
    with tempfile.TemporaryDirectory(prefix="olmax-ckpt-") as local:
        path, remote = fetch(url, Path(local), step)
        try:
            yield path
        except CheckpointError as err:
            raise type(err)(str(err).replace(str(path.parent), remote)) from err
