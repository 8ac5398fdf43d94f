"""The one place that knows URLs: local paths, gs://, s3:// and (read-only) https://, through fsspec.

fsspec with s3fs and gcsfs gives one interface for every store, byte-range
reads (`cat_ranges` fetches many ranges concurrently), object metadata
(size, ETag, generation) and each store's standard credential chain:
boto's for S3 (AWS_* variables, ~/.aws, instance metadata; AWS_ENDPOINT_URL
selects an S3-compatible server), google-auth's for GCS (application default
credentials, the metadata server; STORAGE_EMULATOR_HOST selects an emulator).
olmax reads no setting of its own for either and never logs a credential.

Retries are olmax's, not the libraries' (theirs are turned off), so that each is
counted (`io/retries`) and bounded: a transient fault (HTTP 5xx or 429, a reset
connection, a timeout, a body cut short or failing its checksum) is retried with
exponential backoff and full jitter until `storage.retry_seconds` have passed
since the first failure, then raises `StorageUnavailable` (its own exit code,
which launchers retry later); a permanent one (403, 404, no such bucket, an
endpoint that refuses connections) raises `StorageError` at once (exit 2),
naming the URL and what to check.

A process that holds a run directory in a bucket puts a fence on it (`fence`):
every write and deletion under it passes that check first, in each attempt,
so that a holder that lost its lease sends nothing more there.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import http.client
import io
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec

from olmax.errors import AlreadyExists, MissingBucket, MissingObject, OlmaxError, StorageError, StorageUnavailable

REMOTE_SCHEMES = ("gs", "s3", "https", "http")
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 10.0
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
UPLOAD_THREADS = 8  # files of a tree uploaded at once
MULTIPART_CHUNK = 16 * 2**20  # part size of S3 multipart uploads (s3fs's default, 50 MiB, leaves 100 MiB whole)
READ_TIMEOUT_S = 60.0  # a response that sends no byte for this long has stalled: a transient fault, retried
# Requests in flight to S3 at once, per process (botocore's default, 10, held the loader's read-ahead to 10 byte
# ranges per round trip: 200 ms a request left steps waiting for their batches).
S3_CONNECTIONS = 64

log = logging.getLogger(__name__)


class _Settings:
    retry_seconds = 120.0
    retries = 0
    lock = threading.Lock()


def configure(retry_seconds: float) -> None:
    """How long transient faults of one request are retried (from `storage.retry_seconds`)."""
    _Settings.retry_seconds = retry_seconds


def retry_seconds() -> float:
    """How long transient faults are retried (storage.retry_seconds)."""
    return _Settings.retry_seconds


def retries() -> int:
    """Retries of transient faults so far in this process."""
    return _Settings.retries


def scheme(path: str | os.PathLike) -> str | None:
    text = str(path)
    head, sep, _ = text.partition("://")
    return head if sep and head in REMOTE_SCHEMES else None


def is_remote(path: str | os.PathLike) -> bool:
    return scheme(path) is not None


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base/parts...`, for a URL or a local path (a URL's `//` survives, which pathlib would collapse)."""
    if is_remote(base):
        return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(base, *parts))


def parent(path: str | os.PathLike) -> str:
    if is_remote(path):
        return str(path).rstrip("/").rsplit("/", 1)[0]
    return str(Path(path).parent)


def basename(path: str | os.PathLike) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


# --- the filesystems -------------------------------------------------------------------------------


@functools.cache
def _filesystem(kind: str, emulator: str | None, endpoint: str | None):
    """One filesystem per store (and endpoint, so a test that changes it gets a new one), making one attempt
    per request: olmax retries."""
    if kind == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(config_kwargs={"retries": {"total_max_attempts": 1}, "read_timeout": READ_TIMEOUT_S,
                                              "max_pool_connections": S3_CONNECTIONS},
                               skip_instance_cache=True, use_listings_cache=False)
        fs.retries = 1  # s3fs's own loop: one attempt
        return fs
    if kind == "gs":
        from gcsfs.core import GCSFileSystem  # the JSON API one; gcsfs's default adds gRPC calls for HNS buckets

        class OneAttemptGCS(GCSFileSystem):
            # gcsfs wraps every request in six retries of its own, at class level; this is the request itself.
            _request = GCSFileSystem._request.__wrapped__

        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs whole tracebacks for errors it raises
        import aiohttp

        return OneAttemptGCS(token="anon" if emulator else None, skip_instance_cache=True, use_listings_cache=False,
                             requests_timeout=aiohttp.ClientTimeout(sock_read=READ_TIMEOUT_S))
    if kind in ("http", "https"):
        return fsspec.filesystem("http", skip_instance_cache=True)
    return fsspec.filesystem("file")


def _fs(path: str):
    kind = scheme(path) or "file"
    return _filesystem(kind, os.environ.get("STORAGE_EMULATOR_HOST") if kind == "gs" else None,
                       os.environ.get("AWS_ENDPOINT_URL") if kind == "s3" else None)


def _endpoint(path: str) -> str:
    kind = scheme(path)
    if kind == "s3":
        return os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (AWS_ENDPOINT_URL unset)"
    if kind == "gs":
        return os.environ.get("STORAGE_EMULATOR_HOST") or "Google Cloud Storage (STORAGE_EMULATOR_HOST unset)"
    return str(path).split("/", 3)[2] if kind else "the local filesystem"


# --- faults ----------------------------------------------------------------------------------------


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _status(err: BaseException) -> int | None:
    for e in _chain(err):
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore's ClientError
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code:
                return int(code)
        for attribute in ("status", "code"):  # aiohttp's ClientResponseError, gcsfs's HttpError
            value = getattr(e, attribute, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
    return None


# Transient by what they are, matched against every class an error derives from (so that a library's subclass,
# aiobotocore's AioReadTimeoutError, fsspec's FSTimeoutError, counts as what it derives from): builtin timeouts and
# dropped connections, botocore's HTTP client errors (timeouts, closed connections, streams cut short), a body
# shorter than its Content-Length or failing its checksum, aiohttp's server and payload errors, urllib3's and
# http.client's protocol errors.
TRANSIENT_CLASSES = {"TimeoutError", "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError",
                     "HTTPClientError", "IncompleteReadError", "FlexibleChecksumError", "ServerConnectionError",
                     "ClientPayloadError", "ClientOSError", "ContentLengthError", "TransferEncodingError",
                     "ConnectTimeoutError", "ProtocolError", "IncompleteRead"}


def _kind(err: BaseException) -> str:
    """'missing', 'exists', 'denied', 'unreachable', 'transient' or 'other'."""
    status = _status(err)
    names = {cls.__name__ for e in _chain(err) for cls in type(e).__mro__}
    if isinstance(err, FileExistsError) or status == 412:  # s3fs and gcsfs say so for a failed exclusive write
        return "exists"
    if isinstance(err, FileNotFoundError) or status == 404 or "NoSuchBucket" in str(err):
        return "missing"
    # gcsfs raises a bare OSError("Forbidden: URL") for 403
    if isinstance(err, PermissionError) or status in (401, 403) or str(err).startswith(("Forbidden", "Unauthorized")):
        return "denied"
    if status in TRANSIENT_STATUS:
        return "transient"
    refused = any(isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED
                  for e in _chain(err))
    if refused or names & {"ClientConnectorDNSError", "EndpointConnectionError"} and not names & {
            "ConnectionResetError", "ServerDisconnectedError"}:
        return "unreachable"
    if names & TRANSIENT_CLASSES:
        return "transient"
    if isinstance(err, OSError) and err.errno in (errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO), errno.EAGAIN):
        return "transient"  # s3fs's translation of a 5xx it has no name for
    return "other"


def _named(err: BaseException, path: str, kind: str) -> StorageError:
    what = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
    endpoint = _endpoint(path)
    if kind == "exists":
        return AlreadyExists(f"{path} exists already ({what})")
    if kind == "missing" and _no_bucket(err, path):
        bucket = "/".join(str(path).split("/", 3)[:3])
        return MissingBucket(f"bucket {bucket} does not exist (for {path}); check the bucket name and the endpoint "
                             f"({endpoint})")
    if kind == "missing" and not is_remote(path):
        return MissingObject(f"{path} does not exist")
    if kind == "missing":
        return MissingObject(f"{path} does not exist ({what}); check the bucket and object names")
    if kind == "denied":
        return StorageError(f"{path}: access denied ({what}); check the credentials the store's standard chain "
                            "finds (AWS_* / ~/.aws for s3://, application default credentials for gs://) and the "
                            "bucket's permissions")
    if kind == "unreachable":
        return StorageError(f"{path}: cannot reach {endpoint} ({what}); check the endpoint (AWS_ENDPOINT_URL, "
                            "STORAGE_EMULATOR_HOST) and the network")
    return StorageError(f"{path}: {what}")


def _no_bucket(err: BaseException, path: str) -> bool:
    """Whether a 'missing' error is the bucket's: S3 says so; gcsfs's 404 does not, so the bucket is looked up."""
    if "bucket does not exist" in str(err) or "NoSuchBucket" in str(err):
        return True
    if scheme(path) != "gs":
        return False
    try:
        return not _fs(path).exists(str(path).split("/", 3)[2])
    except Exception:  # the lookup is only to name the bucket; the error being named is the original one
        return False


class _Retries:
    """One operation's retry budget: `after(err)` waits before the next attempt, or raises."""

    def __init__(self, path: str):
        self.path, self.attempt, self.first_failure = path, 0, None

    def after(self, err: Exception, retried: int = 1) -> None:
        kind = _kind(err)
        if kind == "other" and not (is_remote(self.path) and isinstance(err, OSError)):
            raise err  # a local OSError says what it is itself (disk full, permissions); a TypeError is a bug
        now = time.monotonic()
        self.first_failure = self.first_failure or now
        if kind != "transient":
            raise _named(err, self.path, kind) from None
        if now - self.first_failure >= _Settings.retry_seconds:
            raise StorageUnavailable(
                f"{self.path}: still failing after {self.attempt} retries over {now - self.first_failure:.0f}s "
                f"({_named(err, self.path, kind)}); check {_endpoint(self.path)}, or raise storage.retry_seconds"
            ) from None
        self.attempt += 1
        with _Settings.lock:
            _Settings.retries += retried
        log.debug("retry %d of %s after %s", self.attempt, self.path, type(err).__name__)
        time.sleep(random.uniform(0, min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2**self.attempt)))


def _call(path: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), retrying transient faults within the budget; permanent ones become StorageError."""
    retries = _Retries(path)
    while True:
        try:
            return fn(*args, **kwargs)
        except OlmaxError:  # a StorageError named already, or a fence's refusal
            raise
        except Exception as err:
            retries.after(err)


_FENCES: dict[str, object] = {}  # a directory URL -> the check every write and deletion under it passes first


def fence(directory: str, check) -> None:
    """Make every write and deletion under `directory` (a bucket URL) call `check(path, confirm)` first, before each
    attempt; it raises to refuse. `confirm` is True for one object written or deleted whole (a commit marker, a
    record, a deletion), False for each file of an upload. `check` None takes the fence away."""
    if check is None:
        _FENCES.pop(directory, None)
    else:
        _FENCES[directory] = check


def _write(path: str, confirm: bool, fn, *args, **kwargs):
    """`_call` for a write or a deletion: each attempt passes the fence of a directory `path` is under first."""

    def attempt():
        for directory, check in list(_FENCES.items()):
            if path == directory or path.startswith(directory + "/"):
                check(path, confirm)
        return fn(*args, **kwargs)

    return _call(path, attempt)


# --- operations ------------------------------------------------------------------------------------


def info(path: str) -> dict:
    """{"size", "version"}: the object's size and its ETag or generation where the store gives one (None
    locally). A directory or prefix is FileNotFoundError's 'missing' for objects; callers check `size`."""
    if not is_remote(path):
        return {"size": os.path.getsize(path), "version": None, "dir": os.path.isdir(path)}
    fs = _fs(path)
    meta = _call(path, fs.info, path)
    version = meta.get("generation") or meta.get("ETag") or meta.get("etag")
    return {"size": int(meta.get("size") or 0), "version": str(version).strip('"') if version else None,
            "dir": meta.get("type") == "directory"}


def exists(path: str) -> bool:
    return _call(path, _fs(path).exists, path)


def is_dir(path: str) -> bool:
    return _call(path, _fs(path).isdir, path)


def read_bytes(path: str) -> bytes:
    return _call(path, _fs(path).cat_file, path)


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def read_ranges(path: str, starts: list[int], ends: list[int]) -> list[bytes]:
    """Bytes [start, end) of one object for each pair, fetched concurrently by async stores; the ranges a fault
    failed are fetched again (each one a retry), not the others. A range carries no checksum: one answered short
    although the object holds all of it was cut short on its way (a fault, retried); one past the object's end
    is answered as short as the object is."""
    fs, retries = _fs(path), _Retries(path)
    out, todo, size = [None] * len(starts), list(range(len(starts))), None
    while todo:
        got = _call(path, fs.cat_ranges, [path] * len(todo), [starts[i] for i in todo], [ends[i] for i in todo],
                    on_error="return")
        failed = []
        for i, r in zip(todo, got):
            if isinstance(r, Exception) and _status(r) == 416:  # Range Not Satisfiable: it starts past the end
                r = b""
            if not isinstance(r, Exception) and len(r) > ends[i] - starts[i]:  # a 200 with the whole object
                raise StorageError(
                    f"{path}: asked for bytes {starts[i]}-{ends[i] - 1}, the server answered {len(r)} bytes: it "
                    "ignores Range requests; serve the data from a server that honours them (206 Partial "
                    "Content), a bucket or a local disk")
            if not isinstance(r, Exception) and len(r) < ends[i] - starts[i]:
                size = info(path)["size"] if size is None else size
                if size >= ends[i]:  # the object holds the whole range: the body was cut short on its way
                    r = http.client.IncompleteRead(r, ends[i] - starts[i] - len(r))
            if isinstance(r, Exception):
                failed.append((i, r))
            out[i] = None if isinstance(r, Exception) else r
        todo = [i for i, _ in failed]
        if failed:
            retries.after(failed[0][1], retried=len(failed))
    return out


READ_BLOCK = 16 * 2**20  # bytes of one range request of a remote file read front to back (`open_read`)


class _RangeReader(io.RawIOBase):
    """A remote file read front to back, a block at a time, each block a range request retried on its own."""

    def __init__(self, path: str):
        self.path, self.size, self.position = path, info(path)["size"], 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        end = min(self.position + len(buffer), self.size)
        if end <= self.position:
            return 0
        data = read_ranges(self.path, [self.position], [end])[0]
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def open_read(path: str) -> io.BufferedIOBase:
    """A binary file object reading `path` from the start: the file itself, or a remote object READ_BLOCK bytes
    per request, each request retried (a fault in the middle of a large object costs one block, not the object)."""
    if not is_remote(path):
        return open(path, "rb")
    return io.BufferedReader(_RangeReader(path), buffer_size=READ_BLOCK)


def list_files(path: str) -> list[tuple[str, int]]:
    """(path, size) of every file under the directory or prefix `path`, in sorted order, or [(path, size)] when
    `path` is a file itself (an https:// URL always is). A path that does not exist is MissingObject."""
    if not is_remote(path):
        local = Path(path)
        if not local.exists():
            raise MissingObject(f"{path} does not exist")
        if not local.is_dir():
            return [(str(path), local.stat().st_size)]
        return [(str(p), p.stat().st_size) for p in sorted(local.rglob("*")) if p.is_file()]
    meta = info(path)
    if not meta["dir"]:
        return [(str(path), meta["size"])]
    fs = _fs(path)
    found = _call(path, fs.find, path, detail=True)
    return sorted((f"{scheme(path)}://{name}", int(entry.get("size") or 0)) for name, entry in found.items())


def check_writable(path: str) -> None:
    if scheme(path) in ("http", "https"):
        raise StorageError(f"{path}: http(s) URLs are read-only; write to gs://, s3:// or a local path")


def write_bytes(path: str, data: bytes) -> None:
    check_writable(path)
    if not is_remote(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    _write(path, True, _fs(path).pipe_file, path, data)


def write_if(path: str, data: bytes, version: str | None) -> str:
    """Write the object of a bucket only while it is at `version` (None: only while there is none), in one
    conditional request (S3's If-Match / If-None-Match, GCS's ifGenerationMatch), else AlreadyExists (or
    MissingObject: it was deleted). Returns the version written: its ETag or generation, as `info` gives it."""
    fs, (bucket, key) = _fs(path), path.split("://", 1)[1].split("/", 1)
    if scheme(path) == "s3":
        condition = {"IfMatch": f'"{version}"'} if version else {"IfNoneMatch": "*"}
        out = _write(path, True, fs.call_s3, "put_object", Bucket=bucket, Key=key, Body=data, **condition)
        return out["ETag"].strip('"')
    if scheme(path) == "gs":
        # a multipart upload (the object's name in its first part), as gcsfs sends one
        body = (f'--==0==\nContent-Type: application/json; charset=UTF-8\n\n{json.dumps({"name": key})}\n'
                "--==0==\nContent-Type: application/octet-stream\n\n").encode() + data + b"\n--==0==--"
        out = _write(path, True, fs.call, "POST", f"{fs._location}/upload/storage/v1/b/{bucket}/o", uploadType="multipart",
                    ifGenerationMatch=version or "0", data=body, json_out=True,
                    headers={"Content-Type": 'multipart/related; boundary="==0=="'})
        return str(out["generation"])
    raise StorageError(f"{path}: a conditional write needs a bucket (gs://, s3://)")


def remove_if(path: str, version: str) -> None:
    """Delete the object of a bucket only while it is at `version`, in one conditional request (S3's If-Match, GCS's
    ifGenerationMatch), else AlreadyExists (another version is there) or MissingObject (none is)."""
    fs, (bucket, key) = _fs(path), path.split("://", 1)[1].split("/", 1)
    if scheme(path) == "s3":
        _write(path, True, fs.call_s3, "delete_object", Bucket=bucket, Key=key, IfMatch=f'"{version}"')
    elif scheme(path) == "gs":
        _write(path, True, fs.call, "DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
    else:
        raise StorageError(f"{path}: a conditional deletion needs a bucket (gs://, s3://)")


def upload(local: str | os.PathLike, path: str) -> None:
    """Copy a local file or directory tree to `path` (a URL): UPLOAD_THREADS files at once, each retried on
    its own; S3 objects over twice MULTIPART_CHUNK go up in parts, s3fs sending 10 at once."""
    check_writable(path)
    local = Path(local)
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())

    def put(file: Path) -> None:
        target = path if file == local else join(path, *file.relative_to(local).parts)
        parts = {"chunksize": MULTIPART_CHUNK} if scheme(target) == "s3" and MULTIPART_CHUNK else {}
        _write(target, False, _fs(target).put_file, str(file), target, **parts)

    with ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="olmax-upload") as pool:
        list(pool.map(put, files))  # the first failure is raised, once the others have ended


def download(path: str, local: str | os.PathLike) -> None:
    """Copy the object or the tree under `path` to `local`."""
    local = Path(local)
    fs = _fs(path)
    if not is_dir(path):
        local.parent.mkdir(parents=True, exist_ok=True)
        _call(path, fs.get_file, path, str(local))
        return
    for name in _call(path, fs.find, path):
        relative = name[len(fs._strip_protocol(path).rstrip("/")) + 1:]
        target = local / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        source = f"{scheme(path)}://{name}"
        _call(source, fs.get_file, source, str(target))


def listdir(path: str) -> list[str]:
    """Names (not paths) directly under `path`; [] when there is nothing."""
    if not is_remote(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    fs = _fs(path)
    try:
        entries = _call(path, fs.ls, path, detail=False, refresh=True)
    except MissingObject:
        if _bucket_exists(path):  # an empty prefix, in a bucket that exists
            return []
        raise
    return sorted(basename(e) for e in entries)


def _bucket_exists(path: str) -> bool:
    """Whether the bucket of `path` exists. s3fs's own probe (HEAD, then ?location) answers False for any error,
    a 503 or a denial too, so S3's is asked as a listing of one key, whose faults are retried or named."""
    bucket = "/".join(str(path).split("/", 3)[:3])
    if scheme(path) != "s3":
        return exists(bucket)
    try:
        _call(bucket, _fs(path).call_s3, "list_objects_v2", Bucket=basename(bucket), MaxKeys=1)
    except MissingObject:
        return False
    return True


def remove(path: str) -> None:
    """Delete an object or a whole tree."""
    check_writable(path)
    if not is_remote(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return
    try:
        _write(path, True, _fs(path).rm, path, recursive=True)
    except MissingObject:
        pass  # gone already: a retry of a deletion that had gone through in part


# --- commands' inputs and outputs ------------------------------------------------------------------


@contextlib.contextmanager
def local_copy(path: str | os.PathLike):
    """A local path to read `path` from: itself when local, else a copy of the object or tree in a temporary
    directory removed after the block (for inputs read whole: an HF model directory, a token file)."""
    if not is_remote(path):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="olmax-in-") as tmp:
        local = Path(tmp, basename(path))
        download(str(path), local)
        yield local


# --- a run directory in a bucket -------------------------------------------------------------------

COMMIT_MARKER = "UPLOADED"  # written into a directory last: without it, an upload was cut short


def upload_committed(local: str | os.PathLike, path: str) -> None:
    """Upload a directory, then its commit marker, so that a reader never takes a part of it for the whole.
    Whatever was at `path` (an upload cut short) goes first."""
    if exists(path):
        remove_committed(path)
    upload(local, path)
    commit(path)


def commit(path: str) -> None:
    """Write the commit marker of the directory `path` (a bucket URL) where there is none: a conditional write, so
    that a commit never replaces another writer's."""
    marker, mine = join(path, COMMIT_MARKER), uuid.uuid4().hex.encode()
    try:
        write_if(marker, mine, None)
    except AlreadyExists:
        if read_bytes(marker) != mine:  # else our own write, refused when retried after its answer was lost
            raise AlreadyExists(f"{path} was committed by another writer while this one uploaded it; nothing of it "
                                "was replaced") from None


def committed(path: str) -> bool:
    return exists(join(path, COMMIT_MARKER))


def remove_committed(path: str) -> None:
    """Delete a directory uploaded with `upload_committed`, its marker first (a half-deleted one is no commit)."""
    if committed(path):
        remove(join(path, COMMIT_MARKER))
    remove(path)
