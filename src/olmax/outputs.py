"""New output directories: what a command writes (shards, a converted checkpoint, an HF model) appears whole or
not at all, and never over an earlier output. `tokenize`, `synth-data` and `convert` write through it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from olmax import run_lock, storage
from olmax.config import writable_dir
from olmax.errors import BadInput


def check_new_output(out: str | os.PathLike, command: str, error: type[BadInput], ignoring: tuple[str, ...] = ()) -> None:
    """Raise `error` unless `out` (a path or a bucket URL) is new or an empty directory that can be written (but for
    the names `ignoring`: the lock the command holds there)."""
    remote = storage.is_remote(out)
    if remote:
        storage.check_writable(str(out))
    elif Path(out).exists() and not Path(out).is_dir():
        raise error(f"{out} is a file; {command} writes a new directory: choose another path")
    if set(storage.listdir(str(out))) - set(ignoring):
        raise error(f"{out} exists and is not empty (an earlier output?); {command} writes into a new or empty "
                    "directory: choose another, or delete this one")
    if not remote:
        writable_dir(Path(out).resolve().parent, "--out")


@contextlib.contextmanager
def new_output_dir(out: str | os.PathLike, command: str, error: type[BadInput], checkpoint: bool = False):
    """An empty local directory to write the output `out` into (see `check_new_output`), which becomes `out` when
    the block succeeds; when it fails, nothing is left. On disk it is a directory beside `out`, renamed to `out`;
    for a bucket, a temporary one uploaded (a `checkpoint` step by step, each with its commit marker last)."""
    check_new_output(out, command, error)
    if storage.is_remote(out):
        with tempfile.TemporaryDirectory(prefix="olmax-out-") as tmp:
            local = Path(tmp, "out")
            local.mkdir()
            yield local
            if checkpoint:
                for step in sorted(local.iterdir()):
                    storage.upload_committed(step, storage.join(str(out), step.name))
            else:
                storage.upload(local, str(out))
        return
    out = Path(out)
    parent, name = out.resolve().parent, out.resolve().name
    for stale in parent.glob(f".{name}.partial-*"):  # left by a process killed outright (kill -9, power loss)
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not run_lock.alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    partial = parent / f".{name}.partial-{os.getpid()}"
    partial.mkdir(parents=True)
    try:
        yield partial
        os.replace(partial, out)  # replaces an empty directory
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
