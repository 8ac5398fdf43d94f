"""One run per run directory: an advisory lock on OUTPUT_DIR/run.lock.

The holder keeps the file locked (`fcntl.flock`) while it runs; the kernel
releases the lock when the process ends, however it ends, so a crash leaves
nothing to clean up. The file records the holder's host and PID, which a
second run names when it is refused.

A process the holder starts for the same run (`olmax launch`'s trainers, the
processes of a multi-process run it starts) finds the holder's identity in
OLMAX_RUN_LOCK and checks it against the file, which must still be locked by
that holder, instead of taking the lock itself. This module is the one place
that knows how a run directory is claimed.

A run directory in a bucket (gs://, s3://) has no locks: it is held by a
lease, the object OUTPUT_DIR/run.lock with the holder's host, PID and the
time it was last renewed. The holder renews it every RENEW_S seconds from a
thread and deletes it when it ends. A second run is refused while the lease is
fresh; one not renewed for STALE_S seconds (its holder died, or lost the
network), or one of this host whose process is gone, is taken over. Object
stores have no compare-and-swap that every one of them offers alike, so a new
holder writes its lease, waits SETTLE_S and reads it back: of two runs that
wrote at the same moment, only the one whose lease is there goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from olmax import storage
from olmax.errors import RunDirError
from olmax.run_dir import RunDir

log = logging.getLogger(__name__)

ENV_RUN_LOCK = "OLMAX_RUN_LOCK"
RENEW_S = 10.0  # a bucket lease's holder rewrites it this often
STALE_S = 45.0  # a lease not renewed for this long is a dead (or cut off) holder's, and is taken over
SETTLE_S = 1.0  # a new lease is read back this long after it was written


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
    directory cannot be written (read-only, permissions). A bucket URL is held by a lease (see the module's
    doc). A directory it made that holds nothing but the lock when the block ends (the run failed before
    writing anything) is removed."""
    if storage.is_remote(run_dir):
        with _lease(str(run_dir)) as mine:
            yield mine
        return
    environ = os.environ if environ is None else environ
    run_dir = Path(run_dir)
    path = RunDir(run_dir).lock
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
        if made and os.listdir(run_dir) == [path.name]:
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


def alive(pid: int) -> bool:
    """Whether process `pid` of this host exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read_lease(path: str) -> dict | None:
    try:
        record = json.loads(storage.read_text(path))
    except storage.MissingObject:
        return None
    except ValueError:  # a torn or foreign object: no holder can be named, so it is nobody's lease
        return None
    return record if isinstance(record, dict) else None


def _fresh(record: dict | None) -> bool:
    """Whether the lease `record` is still its holder's."""
    if not record:
        return False
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int) and not alive(record["pid"]):
        return False  # its holder ran here and has ended
    return time.time() - float(record.get("renewed", 0)) < STALE_S


@contextlib.contextmanager
def _lease(url: str):
    path = RunDir(url).lock
    held = _read_lease(path)
    if _fresh(held):
        raise RunDirError(f"output_dir {url} is in use by another run ({_describe(json.dumps(held))}, per {path}, "
                          f"renewed {time.time() - float(held['renewed']):.0f}s ago); wait for it to end or stop "
                          f"it (a lease not renewed for {STALE_S:.0f}s is taken over), or set another output_dir")
    if held:
        log.warning("taking over %s: its holder (%s) stopped renewing it", path, _describe(json.dumps(held)))
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}

    def write() -> None:
        storage.write_bytes(path, json.dumps(mine | {"renewed": time.time()}).encode())

    write()
    time.sleep(SETTLE_S)
    now = _read_lease(path)
    if not now or now.get("token") != mine["token"]:
        raise RunDirError(f"output_dir {url} was taken by another run starting at the same time "
                          f"({_describe(json.dumps(now))}, per {path}); set another output_dir")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(RENEW_S):
            try:
                if (now := _read_lease(path)) and now.get("token") != mine["token"]:
                    log.error("lost the lease %s to %s (this process was cut off for over %.0fs); stop this run",
                              path, _describe(json.dumps(now)), STALE_S)
                    return
                write()
            except storage.StorageError as err:  # the next renewal tries again; STALE_S leaves room for several
                log.warning("could not renew the lease %s: %s", path, err)

    renewer = threading.Thread(target=renew, name="olmax-lease", daemon=True)
    renewer.start()
    try:
        yield json.dumps({"host": mine["host"], "pid": mine["pid"]})
    finally:
        stop.set()
        renewer.join()
        if (_read_lease(path) or {}).get("token") == mine["token"]:
            storage.remove(path)
