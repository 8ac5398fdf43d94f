"""One run per run directory: an advisory lock on OUTPUT_DIR/run.lock.

The holder keeps the file locked (`fcntl.flock`) while it runs; the kernel
releases the lock when the process ends, however it ends, so a crash leaves
nothing to clean up. The file records the holder's host and PID, which a
second run names when it is refused.

A process the holder starts for the same run (`olmax launch`'s trainers, the
processes of a multi-process run it starts) finds the holder's identity in
OLMAX_RUN_LOCK and checks it against the file, which must still be locked by
that holder, instead of taking the lock itself. This module is the one place
that knows how a run directory is claimed: a lease object in a bucket can
take its place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from olmax.errors import BadInput

LOCK_FILE = "run.lock"
ENV_RUN_LOCK = "OLMAX_RUN_LOCK"


class RunDirError(BadInput):
    """Another process holds the run directory, or it cannot be written; the message names the holder or the fix."""


def identity() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()})


def _describe(record: str) -> str:
    try:
        holder = json.loads(record)
        return f"host {holder['host']}, PID {holder['pid']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its host and PID yet"


@contextlib.contextmanager
def hold(run_dir: str | os.PathLike, environ=None):
    """Hold the run directory's lock inside the block (creating the directory); the identity to pass to the
    processes started for this run as OLMAX_RUN_LOCK. Raises RunDirError when another process holds it or the
    directory cannot be written (read-only, permissions). A directory it made that holds nothing but the lock
    when the block ends (the run failed before writing anything) is removed."""
    environ = os.environ if environ is None else environ
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    made = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(errno.EACCES, "permission denied")
        fd = _locked(path)
    except BlockingIOError as err:
        fd, holder = None, os.pread(err.fd, 4096, 0).decode(errors="replace")
        os.close(err.fd)
    except OSError as err:
        raise RunDirError(f"output_dir {run_dir} cannot be written ({err.strerror}); make it writable or set "
                          "another output_dir") from None
    if fd is None:
        if environ.get(ENV_RUN_LOCK) != holder:
            raise RunDirError(f"output_dir {run_dir} is in use by another run ({_describe(holder)}, per {path}); "
                              "wait for it to end or stop it, or set another output_dir")
        yield holder  # our launcher holds it for us
        return
    try:
        mine = identity()
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
        yield mine
    finally:
        if made and os.listdir(run_dir) == [LOCK_FILE]:
            path.unlink()
            run_dir.rmdir()
        os.close(fd)  # releases the lock


def _locked(path: Path) -> int:
    """An open descriptor of `path`, exclusively locked. A BlockingIOError carries in `fd` the descriptor of
    the file another process holds. Retries when the file was removed while it waited (see hold)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            err.fd = fd
            raise
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
