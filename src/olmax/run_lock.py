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
lease, the object OUTPUT_DIR/run.lock with the holder's host and PID, the boot
and PID namespace that PID is one of, and the time it was last renewed. The
holder renews it every RENEW_S seconds from a thread and deletes it when it
ends. A second run is refused while the lease is fresh, and takes over one not
renewed for STALE_S seconds (its holder died, froze or lost the network); at
once only one whose holder provably ended: it ran in this PID namespace of this
boot and its PID is gone (a PID alone proves nothing: containers that share a
hostname each have their own PIDs). Every write of the lease is conditional
(`storage.write_if`: S3's If-Match / If-None-Match, GCS's generation match): a
new lease only where there is none, a takeover only over the version it judged
stale, a renewal or the deletion at the end only over the version this holder
wrote last. So of two runs starting at once one goes on, and a renewal that
arrives late never overwrites a lease another run has taken over.

The holder's writes and deletions in the run directory are fenced by its lease
(`storage.fence`): each is sent only while the lease is confirmed, within
STALE_S / 2 of the last renewal that went through, timed by the holder's own
monotonic clock (which runs on while the process is stopped); a commit, a
record or a deletion renews it first. A takeover waits for a renewal STALE_S
old, so a holder stopped (SIGSTOP, a frozen VM) or cut off past its lease finds
it run out when it goes on: its renewal finds another's lease, and it stops
without sending anything more to the run directory (LeaseLost, exit 75).
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
from olmax.run_dir import RunDir, refuse_link

log = logging.getLogger(__name__)

ENV_RUN_LOCK = "OLMAX_RUN_LOCK"
RENEW_S = 10.0  # a bucket lease's holder rewrites it this often
STALE_S = 45.0  # a lease not renewed for this long is a dead (or cut off) holder's, and is taken over
# Its holder writes only within STALE_S / 2 of its last renewal: the other half is room for the clocks of two
# hosts to disagree (a takeover is judged by the renewal's time stamp against the taker's clock).

_HELD: dict[str, _Lease] = {}  # bucket run directory URL -> this process's lease on it


def check_lease(url: str) -> None:
    """Renew this process's lease on bucket run directory `url` now (nothing when it holds none there); LeaseLost
    if another run has taken it over."""
    lease = _HELD.get(str(url).rstrip("/"))
    if lease is not None:
        lease.confirm()


def identity() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()})


def _describe(record: str) -> str:
    try:
        holder = json.loads(record)
        return f"host {holder['host']}, PID {holder['pid']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its host and PID yet"


@contextlib.contextmanager
def hold(run_dir: str | os.PathLike, environ=None, *, lock: str | os.PathLike | None = None,
         setting: str = "output_dir"):
    """Hold the run directory's lock inside the block (creating the directory); the identity to pass to the
    processes started for this run as OLMAX_RUN_LOCK. Raises RunDirError when another process holds it or the
    directory cannot be written (read-only, permissions). A bucket URL is held by a lease (see the module's
    doc). A directory it made that holds nothing but the lock when the block ends (the run failed before
    writing anything) is removed. Another output is held the same way: `lock` names its lock file (the run
    directory's run.lock by default) and `setting` the option that names the output, in the errors."""
    if storage.is_remote(run_dir):
        url = str(run_dir).rstrip("/")
        with _lease(url, str(lock or RunDir(url).lock), setting) as mine:
            yield mine
        return
    environ = os.environ if environ is None else environ
    run_dir = Path(run_dir)
    path = Path(lock or RunDir(run_dir).lock)
    made = not path.parent.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(errno.EACCES, "permission denied")
        fd = _locked(path)
    except BlockingIOError as err:
        fd, holder = None, os.pread(err.fd, 4096, 0).decode(errors="replace")
        os.close(err.fd)
    except OSError as err:
        raise RunDirError(f"{setting} {run_dir} cannot be written ({err.strerror}); make it writable or set "
                          f"another {setting}") from None
    if fd is None:
        if environ.get(ENV_RUN_LOCK) != holder:
            raise RunDirError(f"{setting} {run_dir} is in use by another run ({_describe(holder)}, per {path}); "
                              f"wait for it to end or stop it, or set another {setting}")
        yield holder  # our launcher holds it for us
        return
    try:
        mine = identity()
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine.encode(), 0)
        yield mine
    finally:
        if made and path.parent.is_dir() and os.listdir(path.parent) == [path.name]:
            path.unlink()
            path.parent.rmdir()
        os.close(fd)  # releases the lock


def _locked(path: Path) -> int:
    """An open descriptor of `path`, exclusively locked. A BlockingIOError carries in `fd` the descriptor of
    the file another process holds. Retries when the file was removed while it waited (see hold)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                refuse_link(path)
            raise
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
    except (ProcessLookupError, OverflowError):  # none has it, or none can
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _namespace() -> str | None:
    """This boot of this machine and this process's PID namespace: where a PID names one process (None where
    there is no /proc to say)."""
    try:
        return f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _read_lease(path: str) -> tuple[dict | None, str | None]:
    """(the lease, its text) of the object at `path`: (None, None) when there is none; (None, text) when it
    holds no lease (no JSON object)."""
    try:
        text = storage.read_bytes(path).decode(errors="replace")
    except storage.MissingBucket:
        raise
    except storage.MissingObject:
        return None, None
    try:
        record = json.loads(text)
    except ValueError:
        return None, text
    return (record, text) if isinstance(record, dict) else (None, text)


def _fresh(record: dict) -> bool:
    """Whether the lease `record` is still its holder's."""
    here, pid = _namespace(), record.get("pid")
    if here is not None and record.get("pid_namespace") == here and isinstance(pid, int) and not alive(pid):
        return False  # its holder ran here and has ended
    renewed = record.get("renewed")
    if not isinstance(renewed, (int, float)) or isinstance(renewed, bool):
        return False  # no time a holder wrote: nobody's lease
    # One stamped further ahead than a lease lasts is no clock's skew; it would block a takeover for that long.
    return abs(time.time() - renewed) < STALE_S


class _Lease:
    """This process's lease on one bucket run directory; `fence` is the check of its writes there."""

    def __init__(self, url: str, path: str, setting: str):
        self.url, self.path, self.setting = url, path, setting
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "pid_namespace": _namespace(),
                     "token": uuid.uuid4().hex}
        self.version: str | None = None  # of the object, as this holder wrote it last
        self.confirmed = 0.0  # time.monotonic() when the last renewal that went through was stamped
        self.lost: str | None = None  # why it was lost
        self.lock = threading.RLock()

    def take(self) -> None:
        """Write the lease: where there is none, or over a stale one; RunDirError if another run holds it."""
        try:
            version = storage.info(self.path)["version"]
        except storage.MissingBucket:
            raise
        except storage.MissingObject:
            version = None
        held, text = _read_lease(self.path) if version else (None, None)
        if text is None:  # none there (or gone since)
            version = None
        elif held is None:
            raise RunDirError(f"{self.setting} {self.url}: {self.path} holds no olmax lease ({text[:80]!r}); if no "
                              f"run is using {self.url}, delete {self.path} and run again, else set another "
                              f"{self.setting}")
        if held and _fresh(held):
            raise RunDirError(f"{self.setting} {self.url} is in use by another run ({_describe(json.dumps(held))}, "
                              f"per {self.path}, {_renewed(float(held['renewed']))}); wait for it to end or stop it "
                              f"(a lease not renewed for {STALE_S:.0f}s is taken over), or set another {self.setting}")
        if held:
            log.warning("taking over %s: its holder (%s) stopped renewing it", self.path, _describe(json.dumps(held)))
        if not self._write(version):
            now, _ = _read_lease(self.path)
            raise RunDirError(f"{self.setting} {self.url} was taken by another run starting at the same time "
                              f"({_describe(json.dumps(now)) if now else 'which has let it go since'}, per "
                              f"{self.path}); set another {self.setting}, or run again")

    def _write(self, version: str | None) -> bool:
        """Our lease, renewed now, where the object is still at `version` (None: absent): whether it went
        through. A refusal of our own write, retried after its answer was lost, is its success."""
        stamped = time.monotonic()
        try:
            self.version = storage.write_if(self.path, json.dumps(self.mine | {"renewed": time.time()}).encode(),
                                            version)
        except storage.MissingBucket:
            raise
        except (storage.AlreadyExists, storage.MissingObject):
            now, _ = _read_lease(self.path)
            if (now or {}).get("token") != self.mine["token"]:
                return False
            self.version = storage.info(self.path)["version"]
        self.confirmed = stamped
        return True

    def confirm(self, within: float = 0.0) -> None:
        """Renew the lease unless its last renewal went through less than `within` seconds ago; LeaseLost if
        another run has it now."""
        with self.lock:
            if self.lost is None and time.monotonic() - self.confirmed >= within and not self._write(self.version):
                now, _ = _read_lease(self.path)
                age = time.monotonic() - self.confirmed
                why = (f"it was stopped or cut off from the store, and a lease not renewed for {STALE_S:.0f}s is "
                       "taken over" if age >= STALE_S / 2 else "it was replaced while fresh")
                self.lost = (f"lost the lease {self.path} to "
                             f"{_describe(json.dumps(now)) if now else 'nobody (it was deleted)'}: this process "
                             f"renewed it last {age:.0f}s ago ({why})")
            if self.lost is not None:
                raise LeaseLost(f"{self.lost}; it stopped, and sent no write or deletion to {self.url} after its "
                                "lease ran out")

    def fence(self, path: str, confirm: bool) -> None:
        """storage's check before each write or deletion in the run directory (see the module's doc)."""
        if path != self.path:  # the lease's own writes are conditional
            self.confirm(0.0 if confirm else STALE_S / 2)

    def release(self) -> None:
        """Delete the lease, if it is still the one this holder wrote (read first: fake-gcs-server, for one, deletes
        whatever the generation its deletion names)."""
        with self.lock:
            if self.lost is None and (_read_lease(self.path)[0] or {}).get("token") == self.mine["token"]:
                try:
                    storage.remove_if(self.path, self.version)
                except (storage.AlreadyExists, storage.MissingObject):
                    pass  # another run's now: left alone


def _renewed(stamp: float) -> str:
    """When a lease stamped `stamp` (its holder's clock) was renewed, by this host's clock."""
    age = time.time() - stamp
    if age > -1:  # a second's skew is within what the clocks of two hosts disagree by anyway
        return f"renewed {max(age, 0):.0f}s ago"
    return (f"renewed {-age:.0f}s from now by this host's clock: the two hosts' clocks disagree (a lease is judged "
            "by the time its holder stamps on it; keep the clocks in sync, e.g. with NTP)")


@contextlib.contextmanager
def _lease(url: str, path: str, setting: str):
    lease = _Lease(url, path, setting)
    lease.take()
    _HELD[lease.url] = lease
    storage.fence(lease.url, lease.fence)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(RENEW_S):
            try:
                lease.confirm()
            except LeaseLost:  # the run stops at its next write
                log.error("%s", lease.lost)
                return
            except storage.StorageError as err:  # the next renewal tries again; STALE_S leaves room for several
                log.warning("could not renew the lease %s: %s", lease.path, err)

    renewer = threading.Thread(target=renew, name="olmax-lease", daemon=True)
    renewer.start()
    try:
        yield json.dumps({"host": lease.mine["host"], "pid": lease.mine["pid"]})
    finally:
        stop.set()
        renewer.join()
        storage.fence(lease.url, None)
        _HELD.pop(lease.url, None)
        lease.release()
