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
network), or one of this host whose process is gone, is taken over. A lease is
written with a conditional write (`storage.write_if`), which S3 and GCS refuse
when the object exists, so of two runs starting at once however late their
writes arrive, one goes on; a takeover deletes the stale lease first, and is
read back SETTLE_S later in case another took it over too. Each renewal is
conditional on the object still being the version this holder wrote last, so a
renewal that arrives late (its holder frozen between its check and its write)
never overwrites a lease another run has taken over. A holder that finds
another's lease at a renewal has been cut off for longer than STALE_S and
another run holds the directory now: `check_lease` says so, and the run stops
without writing anything more (LeaseLost, exit 75).
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
from olmax.errors import LeaseLost, RunDirError
from olmax.run_dir import RunDir

log = logging.getLogger(__name__)

ENV_RUN_LOCK = "OLMAX_RUN_LOCK"
RENEW_S = 10.0  # a bucket lease's holder rewrites it this often
STALE_S = 45.0  # a lease not renewed for this long is a dead (or cut off) holder's, and is taken over
SETTLE_S = 1.0  # a new lease is read back this long after it was written


_HELD: dict[str, str] = {}  # bucket run directory URL -> the token of this process's lease
_LOST: dict[str, str] = {}  # bucket run directory URL -> why this process's lease was lost


def check_lease(url: str) -> None:
    """Raise LeaseLost if another run has taken over the lease this process holds on bucket run directory `url`
    (one read; nothing when this process holds none there): call it before writing to the directory."""
    url = str(url).rstrip("/")
    if url in _HELD and url not in _LOST:
        if (now := _read_lease(RunDir(url).lock)) and now.get("token") != _HELD[url]:
            _lose(url, now)
    if url in _LOST:
        raise LeaseLost(f"{_LOST[url]}; stopped without writing anything more")


def _lose(url: str, now: dict | None) -> None:
    _LOST[url] = (f"lost the lease {RunDir(url).lock} to {_describe(json.dumps(now)) if now else 'nobody (deleted)'}: "
                  f"this process was cut off from the store for over {STALE_S:.0f}s and another run took the run over")


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
        text = storage.read_text(path)
    except storage.MissingObject:
        return None
    try:
        record = json.loads(text)
    except ValueError:  # a torn or foreign object: no holder can be named, so it is nobody's lease
        return None
    return record if isinstance(record, dict) else None


def _fresh(record: dict | None) -> bool:
    """Whether the lease `record` is still its holder's."""
    if not record:
        return False
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int) and not alive(record["pid"]):
        return False  # its holder ran here and has ended
    renewed = record.get("renewed")
    if not isinstance(renewed, (int, float)) or isinstance(renewed, bool):
        return False  # no time a holder wrote: nobody's lease
    # One stamped further ahead than a lease lasts is no clock's skew; it would block a takeover for that long.
    return abs(time.time() - renewed) < STALE_S


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

    def write(version: str | None) -> tuple[str | None, dict | None]:
        """Our lease, renewed now, where the object is still at `version` (None: absent): (the version written,
        None), else (None, what the object holds: another's lease, or None). A refusal of our own write, retried
        after its answer was lost, is its success."""
        try:
            return storage.write_if(path, json.dumps(mine | {"renewed": time.time()}).encode(), version), None
        except (storage.AlreadyExists, storage.MissingObject):
            now = _read_lease(path)
            return (storage.info(path)["version"], None) if (now or {}).get("token") == mine["token"] else (None, now)

    def taken(now: dict | None) -> RunDirError:
        return RunDirError(f"output_dir {url} was taken by another run starting at the same time "
                           f"({_describe(json.dumps(now))}, per {path}); set another output_dir")

    if held:
        storage.remove(path)
    version, now = write(None)
    if version is None:
        raise taken(now or {})
    if held:  # another run may have deleted the stale lease too, and written its own after ours
        time.sleep(SETTLE_S)
        if (now := _read_lease(path) or {}).get("token") != mine["token"]:
            raise taken(now)
    key = url.rstrip("/")
    _HELD[key] = mine["token"]
    _LOST.pop(key, None)
    stop = threading.Event()

    def renew() -> None:
        nonlocal version
        while not stop.wait(RENEW_S):
            try:
                check_lease(key)
                version, now = write(version)
                if version is None:
                    _lose(key, now)
                    check_lease(key)  # raises
            except LeaseLost as err:
                log.error("%s", err)
                return
            except storage.StorageError as err:  # the next renewal tries again; STALE_S leaves room for several
                log.warning("could not renew the lease %s: %s", path, err)

    renewer = threading.Thread(target=renew, name="olmax-lease", daemon=True)
    renewer.start()
    try:
        yield json.dumps({"host": mine["host"], "pid": mine["pid"]})
    finally:
        stop.set()
        renewer.join()
        _HELD.pop(key, None)
        if (_read_lease(path) or {}).get("token") == mine["token"]:
            storage.remove(path)
