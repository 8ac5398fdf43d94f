"""The compile cache: each program `olmax compile`, `plan` and `tune` compile, kept by the program's text, the
target, its compiler flags and JAX's version, in a directory (`OLMAX_COMPILE_CACHE`, default the user's cache
directory) or a bucket (`OLMAX_COMPILE_CACHE=s3://...`, `gs://...`), which the nodes of a cluster share.

An entry is `KEY/result.json` (the figures, the key, a digest of both and the program) beside `KEY/program.hlo.gz`.
It is verified when it is read (`lookup`): one that cannot prove it is this program's, stored whole, with valid
figures is not used, but named in a warning and removed, and the program is compiled again. In a directory an entry
is written beside and renamed into place; in a bucket, which has no rename, result.json is written last: a reader
finds no entry until it is there, and the digest refuses a program.hlo.gz another writer replaced meanwhile.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import math
import os
import shutil
import zlib
from pathlib import Path

import jax

from olmax import storage
from olmax.config import ConfigError, writable_dir
from olmax.errors import MissingObject, StorageError, StorageUnavailable
from olmax.scale.targets import Target

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # in every key: an entry stored in an earlier layout (no key or digest inside) is never looked up


def cache_dir() -> str:
    """Where compiled programs are kept by their program: `OLMAX_COMPILE_CACHE` (a directory or a bucket URL), or the
    user's cache directory."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("OLMAX_COMPILE_CACHE") or os.path.join(home, "olmax", "compiles")


def usable_cache_dir() -> str:
    """The compile cache, refused (ConfigError) before anything is compiled where it cannot be used: a file where
    its directory would be, a directory that cannot be made or written, a bucket that is not there or denies this
    machine, an https:// URL (read-only)."""
    where = cache_dir()
    if not storage.is_remote(where):
        return str(writable_dir(Path(where), "OLMAX_COMPILE_CACHE"))
    try:
        storage.check_writable(where)
        storage.listdir(where)
    except StorageUnavailable:
        raise
    except StorageError as err:
        raise ConfigError(f"OLMAX_COMPILE_CACHE {where}: {err}; set another OLMAX_COMPILE_CACHE") from None
    return where


def key(lowered_text: str, target: Target) -> str:
    facts = json.dumps({"program": hashlib.sha256(lowered_text.encode()).hexdigest(), "target": target.name,
                        "flags": target.xla_flags, "jax": jax.__version__, "format": CACHE_FORMAT}, sort_keys=True)
    return hashlib.sha256(facts.encode()).hexdigest()[:32]


def lookup(program: str) -> dict | None:
    """The stored result of the program keyed `program`, verified, or None: none stored, or one that cannot be used
    (said in a warning naming it, and removed)."""
    entry = storage.join(cache_dir(), program)
    try:
        return _read_entry(entry, program)
    except (OSError, EOFError, ValueError, zlib.error, StorageError) as err:  # cut short, garbled, not this program's
        log.warning("the compile cache entry %s cannot be used (%s: %s); compiling the program again", entry,
                    type(err).__name__, err)
        _remove(entry)
        return None


def _read(entry: str, name: str) -> bytes:
    if storage.is_remote(entry):
        return storage.read_bytes(storage.join(entry, name))
    return Path(entry, name).read_bytes()


def _read_entry(entry: str, program: str) -> dict | None:
    """A stored result, verified: the entry a directory of olmax's (not a symbolic link), its result.json a whole
    JSON object holding this program's key and a digest of itself and the program in program.hlo.gz (gzip checks
    its CRC-32 and length), and its figures valid; None where there is none, and raises what is wrong otherwise."""
    if not storage.is_remote(entry):
        if not os.path.lexists(entry):
            return None
        if os.path.islink(entry):
            raise ValueError(f"a symbolic link (to {os.readlink(entry)}), not an entry olmax stored")
    try:
        record = json.loads(_read(entry, "result.json"))
    except MissingObject:  # in a bucket: no result.json, no entry (or one whose writer has not finished)
        return None
    if not isinstance(record, dict) or record.get("key") != program:
        found = record.get("key") if isinstance(record, dict) else None
        raise ValueError(f"it holds the result of another program (key {found}), not of this one")
    text = None if "error" in record else gzip.decompress(_read(entry, "program.hlo.gz")).decode()
    if record.pop("digest", None) != _digest(record, text):
        raise ValueError("its result.json and program.hlo.gz are not what was stored together (their digest differs)")
    if why := _invalid(record):
        raise ValueError(f"result.json's {why}")
    del record["key"]
    return record if text is None else {**record, "text": text}


def _digest(record: dict, text: str | None) -> str:
    """What binds an entry's result.json to its program: a hash of the record (its key among it) and the text."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode())
    if text is not None:
        digest.update(text.encode())
    return digest.hexdigest()


def _invalid(result: dict) -> str | None:
    """What is wrong with a stored result's figures, if anything."""
    def seconds(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0

    def byte_count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not seconds(result.get("compile_seconds")):
        return f"compile time {result.get('compile_seconds')!r} is not a number of seconds"
    if "error" in result:  # refused for memory: nothing else is stored
        if not isinstance(result["error"], str) or "RESOURCE_EXHAUSTED" not in result["error"]:
            return "compiler error is not the compiler's refusal for memory"
        return None
    if bad := [k for k in ("peak", "arguments", "temporaries") if not byte_count(result.get(k))]:
        return f"{', '.join(f'{k} {result.get(k)!r}' for k in bad)}: not a count of bytes"
    cost = result.get("xla_cost")
    if not isinstance(cost, dict) or not all(isinstance(cost.get(k), (int, float, type(None)))
                                             for k in ("flops", "bytes_accessed")):
        return "xla_cost is not XLA's FLOPs and bytes"
    return None


def _remove(entry: str) -> None:
    """An entry that cannot be used, out of the way: a link or a file unlinked (never what a link points to), a
    directory or a bucket's prefix removed."""
    with contextlib.suppress(OSError, StorageError):
        if storage.is_remote(entry):
            storage.remove(entry)
        elif os.path.islink(entry) or not os.path.isdir(entry):
            os.unlink(entry)
        else:
            shutil.rmtree(entry)


def store(program: str, result: dict) -> None:
    """Keep `result` (the compiled program's `text` and figures, or the compiler's refusal for memory) under the key
    `program`. A cache that cannot keep it costs a compile next time, not this result: a warning says so."""
    record = {"key": program, **{k: v for k, v in result.items() if k != "text"}}
    record["digest"] = _digest(record, result.get("text"))
    files = {"result.json": json.dumps(record).encode()}
    if "text" in result:
        files = {"program.hlo.gz": gzip.compress(result["text"].encode(), compresslevel=6), **files}
    entry = storage.join(cache_dir(), program)
    try:
        if storage.is_remote(entry):
            for name, data in files.items():  # result.json last: the entry is there once it is
                storage.write_bytes(storage.join(entry, name), data)
        else:
            _store_local(Path(entry), files)
    except (OSError, StorageError) as err:
        log.warning("the compile cache %s cannot keep this program (%s); it is compiled again next time",
                    cache_dir(), err)


def _store_local(entry: Path, files: dict[str, bytes]) -> None:
    """Written beside, then renamed: a reader sees a whole entry or none (two compiles of one program race
    harmlessly)."""
    partial = entry.parent / f".{entry.name}.{os.getpid()}"
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir(exist_ok=True)
        for name, data in files.items():
            (partial / name).write_bytes(data)
    except OSError:
        _remove(str(partial))
        raise
    try:
        partial.rename(entry)
    except OSError:  # another process stored it first
        _remove(str(partial))
