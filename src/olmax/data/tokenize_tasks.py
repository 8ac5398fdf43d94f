"""What every engine of `olmax tokenize` runs (olmax.data.tokenize's format and tasks): the input files read and
parsed, a task tokenized by worker processes into its shards, each shard committed on its own, and the counts of
the progress line. The `processes` engine (olmax.data.tokenize) runs the tasks on this host, the `ray` engine
(olmax.data.tokenize_ray) as Ray tasks; neither knows the other."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from olmax import storage
from olmax.data.shards import DataError
from olmax.errors import MissingObject

TEXT_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt"}
COMPRESSIONS = ("", ".gz", ".zst")
CHUNK_BYTES = 1 << 20
# Small files are gathered into tasks of at least this many stored bytes (at most shard_tokens of them): every
# task ends in a short shard, whose last partial instance the loader drops; at a byte or more per token that is
# under 0.1% of a task's tokens at sequence length 8192.
TASK_BYTES = 1 << 25
WORK = ".tokenize"  # the plan, the records of committed shards and tasks, and staging directories


@dataclass(frozen=True)
class Task:
    """Consecutive input files, read in order into the shards part-{index}-PPPPP: (input number, path, size)."""

    index: int
    files: tuple[tuple[int, str, int], ...]


@dataclass(frozen=True)
class Settings:
    """What every task needs besides the tokenizer."""

    out: str
    eos_id: int
    dtype: str
    shard_tokens: int
    skip_bad: bool


def text_kind(path: str) -> str | None:
    name = storage.basename(path)
    for compression in COMPRESSIONS:
        for suffix, kind in TEXT_KINDS.items():
            if name.endswith(suffix + compression):
                return kind
    return None


def find_inputs(inputs: list[str]) -> list[tuple[str, int]]:
    """(path, size) of the text files named or found (sorted, recursively) under the named directories or
    prefixes; local paths made absolute, so that a task reads them wherever it runs."""
    files = []
    for item in inputs:
        item = str(item) if storage.is_remote(item) else os.path.abspath(item)
        try:
            found = storage.list_files(item)
        except MissingObject:
            raise DataError(f"input {item} does not exist") from None
        if len(found) == 1 and found[0][0] == item and not text_kind(item):
            raise DataError(f"{item}: not a .jsonl/.json/.txt file (optionally .gz/.zst); convert it or rename it")
        texts = [(path, size) for path, size in found if text_kind(path)]
        if not texts:
            raise DataError(f"{item} holds no .jsonl/.json/.txt files (optionally .gz/.zst); point at the text")
        files.extend(texts)
    return files


def plan_tasks(files: list[tuple[str, int]], shard_tokens: int) -> list[Task]:
    least = min(shard_tokens, TASK_BYTES)
    tasks, gathered = [], []
    for number, (path, size) in enumerate(files):
        gathered.append((number, path, size))
        if sum(size for _, _, size in gathered) >= least or number == len(files) - 1:
            tasks.append(Task(len(tasks), tuple(gathered)))
            gathered = []
    return tasks


@contextlib.contextmanager
def open_binary(path: str):
    """The decompressed bytes of a local or remote file."""
    path = str(path)
    with storage.open_read(path) as raw:
        if path.endswith(".gz"):
            yield gzip.GzipFile(fileobj=raw)
        elif path.endswith(".zst"):
            yield io.BufferedReader(ZstdFrames(raw), buffer_size=CHUNK_BYTES)
        else:
            yield raw


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame of a file, one after another, and EOFError where the file ends
    inside a frame, as a truncated .gz's reader raises (zstandard's `stream_reader` ends there silently, as at the
    end of a shorter file, and reads only the first frame)."""

    READ = 1 << 16  # compressed bytes decompressed at a time: their output, held here, stays a few MB

    def __init__(self, raw):
        import zstandard

        self.raw, self.new_frame = raw, zstandard.ZstdDecompressor().decompressobj
        self.frame, self.in_frame = self.new_frame(), False  # in_frame: the frame has had input and not ended
        self.out, self.at = b"", 0  # decompressed bytes not yet read, from `at`

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.out):
            data = self.raw.read(self.READ)
            if not data:
                if self.in_frame:
                    raise EOFError("the file ends inside a zstd frame: it was cut short")
                return 0
            self.out, self.at = b"", 0
            while data:
                self.out += self.frame.decompress(data)
                self.in_frame = not self.frame.eof
                if self.in_frame:
                    break
                data, self.frame = self.frame.unused_data, self.new_frame()  # the next frame's start, if any
        size = min(len(buffer), len(self.out) - self.at)
        buffer[:size] = memoryview(self.out)[self.at : self.at + size]
        self.at += size
        return size


def read_documents(path: str) -> Iterator[str]:
    """The documents of one input file, in order."""
    path = str(path)
    for number, raw in _raw_documents(path):
        yield _parse(path, raw, number)


def _raw_documents(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) for JSONL, (0, whole file) for .txt: decoded and parsed by the workers."""
    number = 0
    try:
        with open_binary(path) as f:
            if text_kind(path) == "txt":
                yield 0, f.read()
                return
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield number, line
    except Exception as err:  # gzip, zstd and I/O errors alike: the file cannot be read (on)
        where = f"past line {number}" if number else "it"
        raise DataError(f"{path}: cannot read {where} ({type(err).__name__}: {err}); fix or remove the file") from None


def _parse(path: str, raw: bytes, number: int = 0) -> str:
    where = f"{path}:{number}" if number else path
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 ({err}); fix the file, or pass --skip-bad to skip such documents") from None
    if text_kind(path) == "txt":
        return text
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err}); each line must be a JSON object with a `text` field (or pass "
                        "--skip-bad to skip such lines)") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{where}: no string `text` field; each line must be a JSON object with one (or pass "
                        "--skip-bad to skip such lines)")
    return text


# Worker state: each worker process loads the tokenizer once (a Ray worker process runs many tasks).
_worker: dict = {}


def init_worker(tokenizer_json: str, eos_id: int, dtype: str, skip_bad: bool, one_of_many: bool) -> None:
    """Load the tokenizer into this process, unless it holds it with these arguments already; `one_of_many`: beside
    other workers, whose cores the tokenizer's own Rust threads would only fight for."""
    from tokenizers import Tokenizer

    if _worker.get("args") == (tokenizer_json, eos_id, dtype, skip_bad, one_of_many):
        return
    if one_of_many:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(args=(tokenizer_json, eos_id, dtype, skip_bad, one_of_many),
                   tokenizer=Tokenizer.from_str(tokenizer_json), eos_id=eos_id, dtype=np.dtype(dtype), skip_bad=skip_bad)


def _encode_chunk(chunk: tuple[str, int, list[tuple[int, bytes]]]):
    """(tokens with EOS after each document, tokens per document, text bytes per document, the task's index of
    each document's raw line, the indices of the lines skipped as bad)."""
    path, first, raw = chunk
    texts, kept, bad = [], [], []
    for i, (number, line) in enumerate(raw):
        try:
            text = _parse(path, line, number)
        except DataError:
            if not _worker["skip_bad"]:
                raise
            bad.append(first + i)
            continue
        if text.strip():  # a document without text would be a lone EOS in the shards: it is not a document
            texts.append(text)
            kept.append(first + i)
    encodings = _worker["tokenizer"].encode_batch_fast(texts, add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encodings], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=_worker["dtype"])
    ends = np.cumsum(lengths)
    for encoding, end, length in zip(encodings, ends.tolist(), lengths.tolist()):
        tokens[end - length : end - 1] = encoding.ids
    tokens[ends - 1] = _worker["eos_id"]
    text_bytes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    return tokens, lengths, text_bytes, kept, bad


def _chunks(task: Task, skip: int, progress) -> Iterator[tuple[str, int, list[tuple[int, bytes]]]]:
    """The task's raw documents after its first `skip`, in chunks of about CHUNK_BYTES of one file each."""
    index = 0
    for number, path, size in task.files:
        chunk, chunk_bytes = [], 0
        for line in _raw_documents(path):
            index += 1
            if index <= skip:
                continue
            chunk.append(line)
            chunk_bytes += len(line[1])
            if chunk_bytes >= CHUNK_BYTES:
                yield path, index - len(chunk), chunk
                chunk, chunk_bytes = [], 0
        if chunk:
            yield path, index - len(chunk), chunk
        progress.read(number, size)


def _put(staged: Path, target: str) -> None:
    """Put a staged file in place: renamed beside it on disk, uploaded to a bucket."""
    if storage.is_remote(target):
        storage.upload(staged, target)
        staged.unlink()
    else:
        os.replace(staged, target)


@contextlib.contextmanager
def _staging(out: str):
    """A local directory to write files in before `_put`: in the output's work directory on disk (a rename away
    from their place), a temporary one for a bucket."""
    if storage.is_remote(out):
        with tempfile.TemporaryDirectory(prefix="olmax-tokenize-") as tmp:
            yield Path(tmp)
        return
    stage = Path(out, WORK, f"stage-{uuid.uuid4().hex}")
    stage.mkdir(parents=True)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def remove_staging(out: str) -> None:
    """Remove the staging directories in an output on disk (a task's worker killed while it wrote leaves its own):
    called when no task is running."""
    if not storage.is_remote(out):
        for stage in Path(out, WORK).glob("stage-*"):
            shutil.rmtree(stage, ignore_errors=True)


def _record_path(out: str, name: str) -> str:
    return storage.join(out, WORK, name)


class TaskWriter:
    """Appends a task's documents to its shards, starting a new one when the next document would overflow it, and
    commits each: the shard and its sidecar put in place, then its record (the commit). A record holds the shard's
    counts and `resume_at`, the index of the task's raw line after its last document: where a resumed task starts.
    A line skipped as bad counts in the shard of the next document (or the task's record, after the last one)."""

    def __init__(self, task: Task, settings: Settings, stage: Path, committed: list[dict], progress):
        self.task, self.settings, self.stage, self.progress = task, settings, stage, progress
        self.records = committed
        self._file = None
        self._offsets, self._bytes = [0], []
        self._last = -1  # the raw index of the last document written
        self._bad: list[int] = []  # the raw indices of skipped lines counted in no committed shard yet

    def _name(self, suffix: str) -> str:
        return f"part-{self.task.index:05d}-{len(self.records):05d}{suffix}"

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: np.ndarray, kept: list[int],
            bad: list[int]) -> None:
        self._bad.extend(bad)
        start = 0
        for length, size, raw in zip(lengths.tolist(), text_bytes.tolist(), kept):
            if self._file is not None and self._offsets[-1] + length > self.settings.shard_tokens:
                self._commit()
            if self._file is None:
                self._file = open(self.stage / self._name(".npy"), "wb")
            self._file.write(memoryview(tokens[start : start + length]))
            self._offsets.append(self._offsets[-1] + length)
            self._bytes.append(size)
            self._last = raw
            start += length

    def _commit(self) -> None:
        self._file.close()
        self._file = None
        with open(self.stage / self._name(".docs.npz"), "wb") as f:
            np.savez(f, token_offsets=np.array(self._offsets, dtype=np.int64),
                     text_bytes=np.array(self._bytes, dtype=np.int64))
        skipped = sum(1 for b in self._bad if b < self._last)
        self._bad = [b for b in self._bad if b > self._last]
        record = {"shard": self._name(".npy"), "documents": len(self._bytes), "tokens": self._offsets[-1],
                  "text_bytes": sum(self._bytes), "skipped_documents": skipped, "resume_at": self._last + 1}
        for suffix in (".npy", ".docs.npz"):
            _put(self.stage / self._name(suffix), storage.join(self.settings.out, self._name(suffix)))
        self._put_record(self._name(".json"), record)
        self.records.append(record)
        self._offsets, self._bytes = [0], []
        self.progress.wrote(record["documents"], record["tokens"])

    def _put_record(self, name: str, record: dict) -> None:
        (self.stage / name).write_text(json.dumps(record, indent=1) + "\n")
        _put(self.stage / name, _record_path(self.settings.out, name))

    def finish(self) -> dict:
        """Commit the last shard and the task's record, which it returns."""
        if self._file is not None:
            self._commit()
        record = {"shards": [r["shard"] for r in self.records],
                  **{key: sum(r[key] for r in self.records) for key in ("documents", "tokens", "text_bytes")},
                  "skipped_documents": sum(r["skipped_documents"] for r in self.records) + len(self._bad)}
        self._put_record(f"task-{self.task.index:05d}.json", record)
        return record


def run_task(task: Task, settings: Settings, encode_map, progress) -> dict:
    """Tokenize one task into its shards, after those committed before (by an earlier run of the command, or an
    attempt of this task that was lost), with `encode_map(_encode_chunk, chunks)` (map, or a pool's); its record."""
    committed = []
    while storage.exists(path := _record_path(settings.out, f"part-{task.index:05d}-{len(committed):05d}.json")):
        committed.append(json.loads(storage.read_text(path)))
    resume_at = committed[-1]["resume_at"] if committed else 0
    with _staging(settings.out) as stage:
        writer = TaskWriter(task, settings, stage, committed, progress)
        for encoded in encode_map(_encode_chunk, _chunks(task, resume_at, progress)):
            writer.add(*encoded)
        return writer.finish()


class Progress:
    """Files and bytes read, documents and tokens written: the counts of the progress line. A file counts once,
    however often a retried task reads it; documents and tokens count when their shard is committed."""

    def __init__(self, line: ProgressLine | None = None):
        self.line, self.files, self.bytes, self.documents, self.tokens = line, set(), 0, 0, 0

    def read(self, file: int, size: int) -> None:
        if file not in self.files:
            self.files.add(file)
            self.bytes += size
            self._show()

    def wrote(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self._show()

    def totals(self) -> tuple[int, int, int, int]:
        return len(self.files), self.bytes, self.documents, self.tokens

    def _show(self) -> None:
        if self.line is not None:
            self.line.show(self.totals())


class ProgressLine:
    """The one progress line: files and bytes read, documents and tokens written, tokens/s and the time left (by
    bytes read); what a resumed run had done before counts as done, not in its rates."""

    def __init__(self, enabled: bool, files: int, total_bytes: int, done_files: int, done_bytes: int):
        from tqdm import tqdm

        self.files, self.done_files, self.done_bytes, self.started = files, done_files, done_bytes, time.perf_counter()
        self.bar = tqdm(total=total_bytes, initial=done_bytes, unit="B", unit_scale=True, disable=not enabled,
                        desc=f"{done_files}/{files} files", postfix="0 documents, 0 tokens written",
                        bar_format="tokenize {desc}: {n_fmt}B/{total_fmt}B read{postfix}, ETA {remaining}")
        self.show((0, 0, 0, 0))

    def show(self, totals: tuple[int, int, int, int]) -> None:
        files, read, documents, tokens = totals
        self.bar.set_description_str(f"{self.done_files + files}/{self.files} files", refresh=False)
        per_second = tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{documents:,} documents, {tokens:,} tokens written, {per_second:,.0f} tokens/s",
                                 refresh=False)
        self.bar.update(self.done_bytes + read - self.bar.n)

    def close(self) -> None:
        self.bar.close()
