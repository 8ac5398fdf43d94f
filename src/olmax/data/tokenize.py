"""Text to OLMo shards, and byte-level BPE training, with HF `tokenizers` (the tokenizer a local file).

Input: JSONL (one document per line, its `text` field), .txt (one document per
file), or directories of them (recursively, in sorted order); each may be
.gz or .zst compressed; local paths or, through olmax.storage, gs:// and s3://
objects and prefixes and https:// files. Output, in a new or empty directory
(local or in a bucket):

- `part-TTTTT-PPPPP.npy`: raw headerless uint16 (vocab <= 65536) or uint32 tokens,
  EOS after every document, documents whole, at most `shard_tokens` per shard;
- `part-TTTTT-PPPPP.docs.npz`: the sidecar, `token_offsets` [documents + 1]
  (document d is tokens [offsets[d], offsets[d + 1]), its EOS included) and
  `text_bytes` [documents] (UTF-8 bytes of its text, for bits per byte);
- `mix.txt`: OLMo-core's `label,path` mix file over the shards;
- `shards.json`: their token dtype, vocab size and EOS id (reading them as
  another dtype is an error);
- `tokenize.json`: what was run and the `data.*` settings that read the result.

The input files are read by tasks: consecutive files are gathered into one task
until they hold min(shard_tokens, TASK_BYTES) bytes (a larger file is a task of
its own). Task T writes its documents, in order, into the shards part-T-00000,
part-T-00001, ...: the output is a function of the inputs and settings alone, the
same bytes whatever runs the tasks. The `processes` engine runs them one after
another on this host, the documents of each tokenized by worker processes; the
`ray` engine runs each as a Ray task on a cluster, which reads its inputs and
writes its shards itself (olmax.data.tokenize_ray).

Each shard is committed on its own: written beside (in a bucket, uploaded), then
its record written into `.tokenize/`, the commit. The same command run again on
an unfinished output resumes each task after its last committed shard, as a Ray
task retried after its worker or node was lost does. The mix file, shards.json
and tokenize.json are written when every task is done, and `.tokenize/` removed.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import hashlib
import importlib.util
import io
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from olmax import storage
from olmax.data.shards import DataError, write_shards_record
from olmax.errors import MissingObject
from olmax.outputs import check_new_output

TEXT_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt"}
COMPRESSIONS = ("", ".gz", ".zst")
CHUNK_BYTES = 1 << 20
# Small files are gathered into tasks of at least this many stored bytes (at most shard_tokens of them): every
# task ends in a short shard, whose last partial instance the loader drops; at a byte or more per token that is
# under 0.1% of a task's tokens at sequence length 8192.
TASK_BYTES = 1 << 25
WORK = ".tokenize"  # the plan, the records of committed shards and tasks, and staging directories
ENGINES = ("processes", "ray")
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


@dataclass
class TokenizeResult:
    shards: list[str]
    mix_file: str
    documents: int
    tokens: int
    text_bytes: int
    skipped_documents: int
    seconds: float
    vocab_size: int
    eos_id: int
    pad_id: int | None
    token_dtype: str


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
            import zstandard

            yield io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
        else:
            yield raw


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


def load_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(read_tokenizer(path))


def read_tokenizer(path: str | os.PathLike) -> str:
    """The text of a tokenizer.json (local or in a bucket), checked to load."""
    from tokenizers import Tokenizer

    if storage.is_remote(path):
        text = storage.read_text(str(path))
    elif Path(path).is_dir():
        raise DataError(f"tokenizer file {path} is a directory; pass the tokenizer.json file (e.g. in it)")
    elif not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist; pass a local tokenizer.json or train one with "
                        "`olmax tokenizer train`")
    else:
        text = Path(path).read_text()
    try:
        Tokenizer.from_str(text)
    except Exception as err:
        raise DataError(f"tokenizer file {path} does not load ({err}); pass a HF tokenizers tokenizer.json") from None
    return text


def special_id(tokenizer, token: str, path) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise DataError(f"tokenizer {path} has no token {token!r}; name its end-of-document token with --eos-token")
    return token_id


# Worker state: each worker process (a Ray worker too) loads the tokenizer once.
_worker: dict = {}


def init_worker(tokenizer_json: str, eos_id: int, dtype: str, skip_bad: bool, one_of_many: bool) -> None:
    """Load the tokenizer into this process; `one_of_many`: beside other workers, whose cores the tokenizer's own
    Rust threads would only fight for."""
    from tokenizers import Tokenizer

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


def tokenize_corpus(
    inputs: list[str],
    out_dir: str | os.PathLike,
    *,
    tokenizer_path: str | os.PathLike,
    eos_token: str = EOS_TOKEN,
    shard_tokens: int = 1 << 28,
    workers: int | None = None,
    label: str | None = None,
    progress: bool = True,
    engine: str = "processes",
    address: str | None = None,
    skip_bad: bool = False,
) -> TokenizeResult:
    """Tokenize the inputs into shards + sidecars + mix file in out_dir (new or empty, or the unfinished output of
    this same command, which it finishes). `engine="ray"` runs the tasks on the Ray cluster at `address` (default:
    a local one started for the command, with `workers` CPUs)."""
    from tokenizers import Tokenizer

    started = time.perf_counter()
    _check_engine(engine, address, workers)
    files = find_inputs(inputs)
    tokenizer_json = read_tokenizer(tokenizer_path)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer_name = str(tokenizer_path) if storage.is_remote(tokenizer_path) else str(Path(tokenizer_path).resolve())
    eos_id = special_id(tokenizer, eos_token, tokenizer_path)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    out = str(out_dir) if storage.is_remote(out_dir) else os.path.abspath(out_dir)
    settings = Settings(out, eos_id, dtype, shard_tokens, skip_bad)
    tasks = plan_tasks(files, shard_tokens)
    plan = {"inputs": files, "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
            "eos_token": eos_token, "shard_tokens": shard_tokens}
    done = _resume_or_start(out, json.loads(json.dumps(plan)))
    pending = [task for task in tasks if task.index not in done]
    done_files = [size for task in tasks if task.index in done for _, _, size in task.files]
    line = ProgressLine(progress, len(files), sum(size for _, size in files), len(done_files), sum(done_files))
    try:
        if engine == "ray":
            from olmax.data.tokenize_ray import run_on_ray

            done.update(run_on_ray(pending, settings, tokenizer_json, address, workers, line))
        else:
            done.update(_run_here(pending, settings, tokenizer_json, workers, Progress(line)))
    finally:
        line.close()
    records = [done[task.index] for task in tasks]
    names = [name for record in records for name in record["shards"]]
    if not names:
        storage.remove(out)  # it holds nothing but the work directory
        raise DataError(f"the inputs {inputs} hold no documents with text (empty ones are skipped)")
    label = label or (storage.basename(out) if storage.is_remote(out) else Path(out).resolve().name)
    storage.write_bytes(storage.join(out, "mix.txt"), "".join(f"{label},{name}\n" for name in names).encode())
    write_shards_record(out, names, token_dtype=dtype, vocab_size=vocab_size, eos_id=eos_id)
    counts = {key: sum(r[key] for r in records) for key in ("documents", "tokens", "text_bytes", "skipped_documents")}
    shown = str(out_dir)
    result = TokenizeResult(
        shards=[storage.join(shown, n) for n in names], mix_file=storage.join(shown, "mix.txt"), **counts,
        seconds=time.perf_counter() - started, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id,
        token_dtype=dtype,
    )
    # The record is the same bytes for the same inputs and settings, wherever the output is: no time, no out path.
    summary = {**asdict(result), "shards": names, "mix_file": "mix.txt",
               "tokenizer": tokenizer_name, "inputs": [f for f, _ in files], "engine": engine}
    del summary["seconds"]
    storage.write_bytes(storage.join(out, "tokenize.json"), (json.dumps(summary, indent=1) + "\n").encode())
    storage.remove(storage.join(out, WORK))
    return result


def _check_engine(engine: str, address: str | None, workers: int | None) -> None:
    if engine not in ENGINES:
        raise DataError(f"--engine {engine}: not one of {', '.join(ENGINES)}")
    if address is not None and engine != "ray":
        raise DataError("--address names a Ray cluster: give it with --engine ray")
    if engine == "ray" and address is not None and workers is not None:
        raise DataError("--workers sets the CPUs of a local Ray; the tasks use every CPU of the cluster at --address: "
                        "leave --workers out")
    if engine == "ray" and workers == 0:
        raise DataError("--workers 0 starts a Ray with no CPU to run the tasks on: give 1 or more")
    if engine == "ray" and importlib.util.find_spec("ray") is None:
        raise DataError("--engine ray needs Ray, which is not installed: pip install 'olmax[ray]'")


def _resume_or_start(out: str, plan: dict) -> dict[int, dict]:
    """The records of the tasks an earlier run of this command on `out` finished ({} for a new or empty `out`,
    where the plan is written)."""
    work = storage.join(out, WORK)
    plan_path = storage.join(work, "plan.json")
    if storage.exists(plan_path):
        if json.loads(storage.read_text(plan_path)) != plan:
            raise DataError(f"{out} holds the unfinished output of a tokenize of other inputs or settings: run that "
                            f"command again to finish it, or delete {out}")
        names = [name for name in storage.listdir(work) if name.startswith("task-")]
        with ThreadPoolExecutor(16) as pool:
            records = pool.map(lambda name: json.loads(storage.read_text(storage.join(work, name))), names)
        return {int(name[5:10]): record for name, record in zip(names, records)}
    check_new_output(out, "tokenize", DataError)
    storage.write_bytes(plan_path, json.dumps(plan).encode())
    return {}


def _run_here(tasks: list[Task], settings: Settings, tokenizer_json: str, workers: int | None,
              progress: Progress) -> dict[int, dict]:
    """The `processes` engine: the tasks one after another, their chunks tokenized by `workers` processes (0:
    in this one, with the tokenizer's own threads)."""
    workers = os.cpu_count() if workers is None else workers
    args = (tokenizer_json, settings.eos_id, settings.dtype, settings.skip_bad)
    if workers == 0:
        init_worker(*args, one_of_many=False)
        return {task.index: run_task(task, settings, map, progress) for task in tasks}
    with multiprocessing.get_context("spawn").Pool(workers, initializer=init_worker, initargs=(*args, True)) as pool:

        def encode_map(fn, chunks):
            """pool.imap, reading no more than 2 chunks a worker ahead (imap reads all of its input at once)."""
            ahead = collections.deque()
            for chunk in chunks:
                ahead.append(pool.apply_async(fn, (chunk,)))
                if len(ahead) > 2 * workers:
                    yield ahead.popleft().get()
            while ahead:
                yield ahead.popleft().get()

        return {task.index: run_task(task, settings, encode_map, progress) for task in tasks}


def train_tokenizer(
    inputs: list[str], out_path: str | os.PathLike, *, vocab_size: int, progress: bool = True
) -> str:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with EOS id 0 and pad id 1; save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_path)
    if out.is_dir():
        raise DataError(f"{out} is a directory; give the tokenizer file to write, e.g. {out / 'tokenizer.json'}")
    if out.exists():
        raise DataError(f"{out} exists; give a new file name, or delete it to train the tokenizer again")
    files = find_inputs(inputs)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator((text for path, _ in files for text in read_documents(path)), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    tokenizer.save(str(partial))
    os.replace(partial, out)
    return str(out)
