"""Token shards: the mix as one dataset of fixed-length instances (OLMo-core's numpy FSL dataset).

A shard is a raw, headerless array of token ids (uint16 or uint32), documents
already tokenized, each ending with EOS. Each shard is cut on its own into
non-overlapping instances of `sequence_length` tokens, its tail dropped, so an
instance never crosses a shard boundary; global instance ids follow the mix
order. Shards are read with `os.pread` straight into the batch buffer: one
copy from the page cache, no per-shard mapping to keep open. A shard in a
bucket (gs://, s3://, https://) is read through olmax.storage as the byte
ranges of the batch's instances, fetched concurrently; its size comes from the
object's metadata, and its ETag or generation joins the fingerprint, so a
replaced object is named on resume. That version stands for its contents too:
the store sets it from what was written, while the bytes a range read brings
carry no checksum (a flip that repeats on every read would hash into the run's
record, then refuse every clean resume), so no bytes of it are hashed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmax import storage
from olmax.errors import DataError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FINGERPRINT_VERSION = "olmax-fsl-v1"
# Tokens read from the head of every shard at startup, so a wrong token_dtype or
# tokenizer fails before the first step rather than at some batch hours later.
HEAD_CHECK_TOKENS = 4096
# Bytes hashed at each end of every shard for the facts' content check: a shard rewritten with other tokens of
# the same size is caught on resume, for two small reads per shard.
CONTENT_HASH_BYTES = 1 << 16
CONTENT_READS = 3  # reads after the first of a remote shard's hashed bytes, until two agree
MAX_OPEN_FILES = 256
# Written beside the shards by `olmax tokenize` and `olmax synth-data`: how they were written.
SHARDS_RECORD = "shards.json"


@dataclass(frozen=True)
class Source:
    label: str
    path: str


def read_mix_file(mix_file: str | os.PathLike, base_dir: str | None = None,
                  tokenizer: str | None = None, given_as: str = "data.mix_file") -> list[Source]:
    """OLMo-core's mix format: `label,path` lines, `#` comments. Relative paths are relative to `base_dir`
    (OLMo-core's mix_base_dir), by default the mix file's directory; `{TOKENIZER}` becomes `tokenizer`, as
    OLMo-core builds its published mixes (e.g. allenai/dolma2-tokenizer). `given_as`: the setting or option that
    named the file, which an error tells to change."""
    if storage.is_remote(mix_file):
        text = storage.read_text(str(mix_file))
        return _parse_mix(str(mix_file), text, base_dir or storage.parent(mix_file), tokenizer)
    mix = Path(mix_file)
    if mix.is_dir():
        raise DataError(f"mix file {mix} is a directory; {given_as} must name a file of `label,path` lines in it")
    if not mix.is_file():
        raise DataError(f"mix file {mix} does not exist; {given_as} must name an existing file of `label,path` lines")
    try:
        text = mix.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"mix file {mix} cannot be read as text ({err}); it must hold `label,path` lines") from None
    return _parse_mix(mix, text, base_dir or str(mix.parent), tokenizer)


def _parse_mix(mix, text: str, base_dir: str, tokenizer: str | None) -> list[Source]:
    sources = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(",")
        if len(fields) != 2 or not all(f.strip() for f in fields):
            raise DataError(f"{mix}:{number}: {raw!r} does not parse; each line must be `label,path` (one comma)")
        label, path = (f.strip() for f in fields)
        if "{TOKENIZER}" in path:
            if tokenizer is None:
                raise DataError(
                    f"{mix}:{number}: path has OLMo-core's {{TOKENIZER}} placeholder; set data.mix_tokenizer to "
                    "the tokenizer's directory name (e.g. allenai/dolma2-tokenizer)"
                )
            path = path.replace("{TOKENIZER}", tokenizer)
        if not os.path.isabs(path) and not storage.is_remote(path):
            path = storage.join(base_dir, path)
        sources.append(Source(label, path))
    if not sources:
        raise DataError(f"mix file {mix} lists no shards; add `label,path` lines")
    return sources


def resolve_sources(paths: list[str], mix_file: str | None, base_dir: str | None = None,
                    tokenizer: str | None = None) -> list[Source]:
    if paths and mix_file:
        raise DataError("set either data.paths or data.mix_file, not both")
    if mix_file:
        return read_mix_file(mix_file, base_dir, tokenizer)
    if not paths:
        raise DataError("no data: set data.paths (token shards in mix order) or data.mix_file")
    return [Source(Path(storage.basename(p)).stem, p) for p in paths]


def count_tokens(path: str, token_dtype: str, setting: str = "data.token_dtype") -> int:
    """Tokens in a shard, checking that it is a readable file, not empty, of whole tokens of the dtype it was
    written with: the one check every reader of shards (training, evals) applies. The dtype is the one its
    directory's shards record names; without a record, the shard's head must not look like uint32 tokens read
    as uint16. `setting` is what the user sets to choose the dtype, named in the errors."""
    return _checked_tokens(path, token_dtype, shard_size(path)[0], setting)


def shard_size(path: str) -> tuple[int, str | None]:
    """(bytes, the object's ETag or generation in a bucket; None on disk)."""
    if not storage.is_remote(path):
        return _local_size(path), None
    meta = storage.info(path)
    if meta["dir"]:
        raise DataError(f"shard {path} is a directory, not a token shard; list the shard files in it instead")
    return meta["size"], meta["version"]


def _local_size(path: str) -> int:
    if os.path.isdir(path):
        raise DataError(f"shard {path} is a directory, not a token shard; list the shard files in it instead")
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise DataError(f"shard {path} does not exist; fix data.paths / data.mix_file or run `olmax tokenize`") from None
    if not os.access(path, os.R_OK):
        raise DataError(f"shard {path} is not readable (file permissions); fix them or remove it from the mix")
    return size


def _checked_tokens(path: str, token_dtype: str, size: int, setting: str = "data.token_dtype") -> int:
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"{setting} {token_dtype!r} is not one of {sorted(TOKEN_DTYPES)}")
    record = recorded(path)
    written = record.get("token_dtype", token_dtype)
    if written != token_dtype:
        raise DataError(f"shard {path} was written as {written} tokens ({Path(path).parent / SHARDS_RECORD} "
                        f"says), not {token_dtype}; set {setting}={written}")
    itemsize = np.dtype(TOKEN_DTYPES[token_dtype]).itemsize
    if size == 0:
        raise DataError(f"shard {path} is empty; remove it from the mix or re-run `olmax tokenize`")
    if size % itemsize:
        raise DataError(
            f"shard {path}: {size} bytes is not a multiple of the {itemsize}-byte {token_dtype} token; "
            f"the file is truncated or written with another {setting}"
        )
    if not record and not storage.is_remote(path):
        _check_plausible(path, np.fromfile(path, dtype=TOKEN_DTYPES[token_dtype], count=HEAD_CHECK_TOKENS), setting)
    return size // itemsize


def _check_plausible(path: str, head: np.ndarray, setting: str) -> None:
    """Refuse uint32 tokens read as uint16 (each id then reads as itself and a 0, or a 1 above 65535),
    for shards that do not record their dtype."""
    high, low = head[1::2], head[0::2]
    if head.dtype.itemsize == 2 and len(high) >= 64 and np.mean(high <= 1) > 0.99 and np.mean(low <= 1) < 0.5:
        raise DataError(
            f"shard {path}: every other token is 0 or 1, as uint32 tokens read as uint16 are; set "
            f"{setting}=uint32 (no {SHARDS_RECORD} beside the shard says how it was written)"
        )


class TokenShards:
    """The instances of a mix, read by global instance id.

    `instances`, when given, is how many instances each shard gives from its head
    (a mixture's selection; a shard may appear more than once); `mixture` is that
    selection's definition, part of the facts.
    """

    def __init__(
        self,
        sources: list[Source],
        *,
        sequence_length: int,
        token_dtype: str,
        vocab_size: int,
        eos_id: int,
        pad_id: int,
        instances: list[int] | None = None,
        mixture: dict | None = None,
    ):
        if token_dtype not in TOKEN_DTYPES:
            raise DataError(f"data.token_dtype {token_dtype!r} is not one of {sorted(TOKEN_DTYPES)}")
        self.dtype = np.dtype(TOKEN_DTYPES[token_dtype])
        if vocab_size > np.iinfo(self.dtype).max + 1:
            raise DataError(f"data.token_dtype {token_dtype} cannot hold vocab size {vocab_size}; use uint32")
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < vocab_size:
                raise DataError(f"data.{name} {value} is outside the vocabulary [0, {vocab_size})")
        self.sources = list(sources)
        self._remote = [storage.is_remote(s.path) for s in self.sources]
        self.sequence_length = sequence_length
        self.token_dtype = token_dtype
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.pad_id = pad_id
        sizes = [shard_size(s.path) for s in self.sources]
        self.versions = [version for _, version in sizes]
        self.sizes = [self._checked_size(s.path, size) for s, (size, _) in zip(self.sources, sizes)]
        self.mixture = mixture
        if instances is None:
            instances = [size // self.dtype.itemsize // sequence_length for size in self.sizes]
        self.instances = list(instances)
        self.offsets = np.concatenate([[0], np.cumsum(self.instances, dtype=np.int64)])
        if self.num_instances >= np.iinfo(np.uint32).max:
            raise DataError(f"{self.num_instances} instances exceed OLMo-core's uint32 instance ids; split the mix")
        self._lock = threading.Lock()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self.contents = []
        for index in range(len(self.sources)):
            head = self._read_tokens(index, 0, min(HEAD_CHECK_TOKENS, self.sizes[index] // self.dtype.itemsize))
            self._check_ids(head, index, 0)
            self.contents.append(None if self.versions[index] else self._content_hash(index))

    def _checked_size(self, path: str, size: int) -> int:
        tokens = _checked_tokens(path, self.token_dtype, size)
        if tokens < self.sequence_length:
            raise DataError(
                f"shard {path} holds {tokens} tokens, fewer than data.sequence_length "
                f"{self.sequence_length}; it gives no instance: remove it from the mix (the order of the others "
                "is unchanged) or lower data.sequence_length"
            )
        return tokens * self.dtype.itemsize

    @property
    def num_instances(self) -> int:
        return int(self.offsets[-1])

    def facts(self) -> dict:
        """What defines the dataset: vocab, special ids, dtype, sequence length, file names and sizes.

        A mixture adds its definition and the instances taken from each shard.
        """
        facts = {
            "version": FINGERPRINT_VERSION,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "token_dtype": self.token_dtype,
            "sequence_length": self.sequence_length,
            # Names, not full paths, as OLMo-core: the same mix moved to another disk is the same data.
            "files": [[storage.basename(s.path), size] for s, size in zip(self.sources, self.sizes)],
            # Compared on resume beside the fingerprint, which stays a hash of names and sizes (as OLMo-core's),
            # so that checkpoints written before these hashes existed still resume; None for an object in a bucket,
            # which its version (below) identifies.
            "contents": self.contents,
        }
        if any(self.versions):  # objects in a bucket: a replaced one of the same size is a change too
            facts["versions"] = self.versions
        if self.mixture is not None:
            facts.update(mixture=self.mixture, instances=self.instances)
        return facts

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.facts())

    def locate(self, instance: int) -> tuple[int, int]:
        """(shard index, first token) of a global instance id."""
        shard = int(np.searchsorted(self.offsets, instance, side="right")) - 1
        return shard, int(instance - self.offsets[shard]) * self.sequence_length

    def read(self, instances: np.ndarray) -> np.ndarray:
        """Token ids of the given global instances, as int32 [len(instances), sequence_length]."""
        instances = np.asarray(instances, dtype=np.int64)
        length = self.sequence_length
        out = np.empty((len(instances), length), dtype=np.int32)
        shards = np.searchsorted(self.offsets, instances, side="right") - 1
        starts = (instances - self.offsets[shards]) * length
        wide = self.dtype.itemsize == 4
        self._read_remote(out, shards, starts)
        for row, (shard, start) in enumerate(zip(shards.tolist(), starts.tolist())):
            if self._remote[shard]:
                continue
            # uint32 ids below 2**31 have int32's bytes, so they are read in place; uint16 needs one widening copy.
            out[row] = self._read_tokens(shard, start, length, into=out[row] if wide else None)
        # As uint32, an id that int32 shows as negative (>= 2**31) is large too: one pass catches both.
        ids = out.view(np.uint32)
        if len(out) and int(ids.max()) >= self.vocab_size:
            row = int(np.argmax(ids.max(axis=1) >= self.vocab_size))
            self._check_ids(ids[row], int(shards[row]), int(starts[row]))
        return out

    def _read_remote(self, out: np.ndarray, shards: np.ndarray, starts: np.ndarray) -> None:
        """The rows of `out` whose instances live in buckets: one concurrent fetch of their byte ranges per shard."""
        itemsize, length = self.dtype.itemsize, self.sequence_length
        for shard in np.unique(shards).tolist():
            if not self._remote[shard]:
                continue
            path = self.sources[shard].path
            rows = np.flatnonzero(shards == shard)
            begins = (starts[rows] * itemsize).tolist()
            chunks = storage.read_ranges(path, begins, [b + length * itemsize for b in begins])
            for row, chunk in zip(rows.tolist(), chunks):
                if len(chunk) != length * itemsize:
                    raise DataError(f"shard {path} shrank while reading; was it rewritten during the run?")
                out[row] = np.frombuffer(chunk, dtype=self.dtype)

    def _check_ids(self, tokens: np.ndarray, shard: int, start: int) -> None:
        bad = np.flatnonzero(tokens.astype(np.int64) >= self.vocab_size)
        if bad.size:
            raise DataError(
                f"shard {self.sources[shard].path}: token id {int(tokens[bad[0]])} at token {start + int(bad[0])} "
                f">= vocab size {self.vocab_size}; the shard was made by another tokenizer or data.token_dtype is wrong "
                f"(it is {self.token_dtype})"
            )

    def _content_hash(self, shard: int) -> str:
        """sha256 of the shard's first and last CONTENT_HASH_BYTES (the whole shard when smaller). A range read
        carries no checksum, and a bit flipped in transit would become the run's record of its data (refusing
        every resume), so a remote shard's (one its server gives no version) is read until two reads agree."""
        tokens = self.sizes[shard] // self.dtype.itemsize
        block = CONTENT_HASH_BYTES // self.dtype.itemsize

        def read() -> str:
            head = self._read_tokens(shard, 0, min(block, tokens))
            tail = self._read_tokens(shard, max(tokens - block, 0), min(block, tokens))
            return hashlib.sha256(head.tobytes() + tail.tobytes()).hexdigest()

        digest = read()
        if not self._remote[shard]:
            return digest
        for _ in range(CONTENT_READS):
            digest, previous = read(), digest
            if digest == previous:
                return digest
        raise storage.StorageUnavailable(
            f"shard {self.sources[shard].path}: {CONTENT_READS + 1} reads of its first and last bytes all differ; "
            "something between here and the store corrupts data: check it, then run again")

    def _read_tokens(self, shard: int, start: int, count: int, into: np.ndarray | None = None) -> np.ndarray:
        if self._remote[shard]:
            offset = start * self.dtype.itemsize
            chunk = storage.read_ranges(self.sources[shard].path, [offset], [offset + count * self.dtype.itemsize])[0]
            return np.frombuffer(chunk, dtype=self.dtype)
        buffer = np.empty(count, dtype=self.dtype) if into is None else into
        view = memoryview(buffer).cast("B")
        fd = self._fd(shard)
        offset = start * self.dtype.itemsize
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise DataError(f"shard {self.sources[shard].path} shrank while reading; was it rewritten during the run?")
            done += got
        return buffer

    def _fd(self, shard: int) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                if len(self._fds) >= MAX_OPEN_FILES:
                    os.close(self._fds.popitem(last=False)[1])
                fd = self._fds[shard] = os.open(self.sources[shard].path, os.O_RDONLY)
            else:
                self._fds.move_to_end(shard)
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fds"], state["_lock"] = OrderedDict(), None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


def fingerprint(facts: dict) -> str:
    digest = hashlib.sha256()
    for key in ("version", "vocab_size", "eos_id", "pad_id", "token_dtype", "sequence_length"):
        digest.update(f"{key}={facts[key]},".encode())
    for name, size in facts["files"]:
        digest.update(f"path={name},size={size},".encode())
    if "versions" in facts:
        digest.update(f"versions={facts['versions']},".encode())
    if "mixture" in facts:
        mixture = json.dumps(facts["mixture"], sort_keys=True)
        digest.update(f"mixture={mixture},instances={facts['instances']},".encode())
    return digest.hexdigest()


def describe_change(old: dict, new: dict) -> list[str]:
    """What differs between two datasets' facts, in words."""
    changes = [
        f"{key} {old.get(key)!r} -> {new[key]!r}"
        for key in ("version", "vocab_size", "eos_id", "pad_id", "token_dtype", "sequence_length")
        if old.get(key) != new[key]
    ]
    old_files, new_files = [tuple(f) for f in old.get("files", [])], [tuple(f) for f in new["files"]]
    if len(old_files) != len(new_files):
        changes.append(f"number of shards {len(old_files)} -> {len(new_files)}")
    for index, (was, now) in enumerate(zip(old_files, new_files)):
        if was != now:
            changes.append(f"shard {index}: {was[0]} ({was[1]} bytes) -> {now[0]} ({now[1]} bytes)")
    if "contents" in old and len(old_files) == len(new_files):  # checkpoints before content hashes lack them
        changes += [f"shard {index}: {now[0]} has other contents (same name and size)"
                    for index, (was, now, old_hash, new_hash) in enumerate(zip(old_files, new_files, old["contents"],
                                                                               new["contents"]))
                    if was == now and None not in (old_hash, new_hash) and old_hash != new_hash]
    for index, (was, now) in enumerate(zip(old.get("versions", []), new.get("versions", []))):
        if was != now and old_files[index:index + 1] == new_files[index:index + 1]:
            changes.append(f"shard {index}: {new_files[index][0]} was replaced (version {was} -> {now})")
    return changes + _mixture_changes(old, new)


def _mixture_changes(old: dict, new: dict) -> list[str]:
    was, now = old.get("mixture"), new.get("mixture")
    if was is None or now is None:
        return [] if was is now else [f"data.sources {'set' if now else 'unset'}"]
    changes = []
    if was["requested_tokens"] != now["requested_tokens"]:
        changes.append(f"data.requested_tokens {was['requested_tokens']} -> {now['requested_tokens']}")
    old_sources = {s["name"]: s for s in was["sources"]}
    for source in now["sources"]:
        before = old_sources.pop(source["name"], None)
        if before is None:
            changes.append(f"source {source['name']} added")
            continue
        changes += [f"source {source['name']} {key} {before.get(key)} -> {value}"
                    for key, value in source.items() if before.get(key) != value]
    changes += [f"source {name} removed" for name in old_sources]
    old_counts, new_counts = old["instances"], new["instances"]
    if old_counts != new_counts:
        changes.append(f"instances selected {sum(old_counts)} -> {sum(new_counts)}")
    return changes


def recorded(path: str | os.PathLike) -> dict:
    """What the shards record beside `path` says about it ({} when there is none, or it does not list it)."""
    if storage.is_remote(path):
        entry = _read_remote_record(storage.join(storage.parent(path), SHARDS_RECORD))
        return entry if storage.basename(path) in entry.get("shards", ()) else {}
    record = Path(path).parent / SHARDS_RECORD
    try:
        stat = record.stat()
    except OSError:
        return {}
    entry = _read_record(str(record), stat.st_mtime_ns, stat.st_size)
    return entry if os.path.basename(path) in entry.get("shards", ()) else {}


@functools.lru_cache(maxsize=64)
def _read_remote_record(url: str) -> dict:
    return _read_record(url, 0, 0) if storage.exists(url) else {}


@functools.lru_cache(maxsize=64)
def _read_record(path: str, mtime_ns: int, size: int) -> dict:
    try:
        record = json.loads(storage.read_text(path) if storage.is_remote(path) else Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path} is not a readable shards record ({err}); restore it or delete it") from None
    if not isinstance(record, dict):
        raise DataError(f"{path} is not a shards record (a JSON object); restore it or delete it")
    return record


def write_shards_record(directory: str | os.PathLike, shards: list[str], *, token_dtype: str, vocab_size: int,
                        eos_id: int) -> None:
    """Record how the shards of `directory` were written, so that reading them otherwise is an error."""
    record = {"token_dtype": token_dtype, "vocab_size": vocab_size, "eos_id": eos_id,
              "shards": [storage.basename(s) for s in shards]}
    storage.write_bytes(storage.join(str(directory), SHARDS_RECORD), (json.dumps(record, indent=1) + "\n").encode())


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write a raw headerless shard atomically (a crash leaves no half shard under the final name)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(np.ascontiguousarray(tokens).tobytes())
    os.replace(partial, path)


def write_mix_file(path: str | os.PathLike, sources: list[Source]) -> None:
    """OLMo-core's `label,path` lines; paths under the mix file's directory are written relative to it."""
    path = Path(path)
    lines = []
    for source in sources:
        shard = Path(source.path)
        try:
            shard = shard.resolve().relative_to(path.parent.resolve())
        except ValueError:
            shard = shard.resolve()
        lines.append(f"{source.label},{shard}\n")
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(lines))
    os.replace(partial, path)
