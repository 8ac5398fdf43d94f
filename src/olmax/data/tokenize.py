"""Text to OLMo shards, and byte-level BPE training, with HF `tokenizers` from local files only.

Input: JSONL (one document per line, its `text` field), .txt (one document per
file), or directories of them (recursively, in sorted order); each may be
.gz or .zst compressed. Output, in a new or empty directory (written beside it
and renamed when complete, so a failed run leaves nothing behind):

- `part-NNNNN.npy`: raw headerless uint16 (vocab <= 65536) or uint32 tokens,
  EOS after every document, documents whole, about `shard_tokens` per shard;
- `part-NNNNN.docs.npz`: the sidecar, `token_offsets` [documents + 1] (document
  d is tokens [offsets[d], offsets[d + 1]), its EOS included) and `text_bytes`
  [documents] (UTF-8 bytes of its text, for bits per byte);
- `mix.txt`: OLMo-core's `label,path` mix file over the shards;
- `shards.json`: their token dtype, vocab size and EOS id (reading them as
  another dtype is an error);
- `tokenize.json`: what was run and the `data.*` settings that read the result.

Worker processes tokenize chunks of documents; the writer keeps input order, so
the output is the same for any number of workers.
"""

from __future__ import annotations

import gzip
import io
import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from olmax.data.shards import DataError, Source, write_mix_file, write_shards_record
from olmax.outputs import new_output_dir

TEXT_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt"}
COMPRESSIONS = ("", ".gz", ".zst")
CHUNK_BYTES = 1 << 20
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


@dataclass
class TokenizeResult:
    shards: list[str]
    mix_file: str
    documents: int
    tokens: int
    text_bytes: int
    seconds: float
    vocab_size: int
    eos_id: int
    pad_id: int | None
    token_dtype: str


def text_kind(path: Path) -> str | None:
    name = path.name
    for compression in COMPRESSIONS:
        for suffix, kind in TEXT_KINDS.items():
            if name.endswith(suffix + compression):
                return kind
    return None


def find_inputs(inputs: list[str]) -> list[Path]:
    """The text files named or found (sorted, recursively) under the named directories."""
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and text_kind(p))
            if not found:
                raise DataError(f"{path} holds no .jsonl/.json/.txt files (optionally .gz/.zst); point at the text")
            files.extend(found)
        elif path.is_file():
            if not text_kind(path):
                raise DataError(f"{path}: not a .jsonl/.json/.txt file (optionally .gz/.zst); convert it or rename it")
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist")
    return files


def open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.name.endswith(".zst"):
        import zstandard

        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_documents(path: Path) -> Iterator[str]:
    """The documents of one input file, in order."""
    for number, text in _raw_documents(path):
        yield _parse(path, text, number)


def _raw_documents(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, raw line) for JSONL (parsed by the workers), (0, whole text) for .txt."""
    kind = text_kind(path)
    try:
        with open_text(path) as f:
            if kind == "txt":
                yield 0, f.read()
                return
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield number, line
    except DataError:
        raise
    except Exception as err:  # gzip, zstd, decoding and I/O errors alike: the file is unreadable
        raise DataError(f"{path}: cannot read it as UTF-8 text ({err}); fix or remove the file") from None


def _parse(path: Path, line: str, number: int = 0) -> str:
    if text_kind(path) == "txt":
        return line
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: not JSON ({err}); each line must be a JSON object with a `text` field") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{path}:{number}: no string `text` field; each line must be a JSON object with one")
    return text


def load_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer

    if Path(path).is_dir():
        raise DataError(f"tokenizer file {path} is a directory; pass the tokenizer.json file (e.g. in it)")
    if not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist; pass a local tokenizer.json or train one with "
                        "`olmax tokenizer train`")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:
        raise DataError(f"tokenizer file {path} does not load ({err}); pass a HF tokenizers tokenizer.json") from None


def special_id(tokenizer, token: str, path) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise DataError(f"tokenizer {path} has no token {token!r}; name its end-of-document token with --eos-token")
    return token_id


# Worker state: each worker process loads the tokenizer once.
_worker: dict = {}


def _init_worker(tokenizer_path: str, eos_id: int, dtype: str) -> None:
    _worker.update(tokenizer=load_tokenizer(tokenizer_path), eos_id=eos_id, dtype=np.dtype(dtype))


def _encode_chunk(chunk: tuple[str, list[tuple[int, str]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens with EOS after each document, tokens per document, text bytes per document)."""
    path, raw = chunk
    # A document without text would be a lone EOS in the shards: it is not a document.
    texts = [text for number, line in raw if (text := _parse(Path(path), line, number)).strip()]
    encodings = _worker["tokenizer"].encode_batch_fast(texts, add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encodings], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=_worker["dtype"])
    ends = np.cumsum(lengths)
    for encoding, end, length in zip(encodings, ends.tolist(), lengths.tolist()):
        tokens[end - length : end - 1] = encoding.ids
    tokens[ends - 1] = _worker["eos_id"]
    text_bytes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    return tokens, lengths, text_bytes


def _chunks(files: list[Path]) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    for path in files:
        chunk, size = [], 0
        for number, text in _raw_documents(path):
            chunk.append((number, text))
            size += len(text)
            if size >= CHUNK_BYTES:
                yield str(path), chunk
                chunk, size = [], 0
        if chunk:
            yield str(path), chunk


class ShardWriter:
    """Appends whole documents to part-NNNNN.npy, starting a new shard when the next would overflow it."""

    def __init__(self, out_dir: Path, shard_tokens: int):
        self.out_dir = out_dir
        self.shard_tokens = shard_tokens
        self.shards: list[str] = []
        self._file = None
        self._offsets: list[int] = [0]
        self._bytes: list[int] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: np.ndarray) -> None:
        start = 0
        for length, size in zip(lengths.tolist(), text_bytes.tolist()):
            if self._file is not None and self._offsets[-1] + length > self.shard_tokens:
                self._close_shard()
            if self._file is None:
                self._open_shard()
            self._file.write(memoryview(tokens[start : start + length]))
            self._offsets.append(self._offsets[-1] + length)
            self._bytes.append(size)
            start += length

    def _path(self) -> Path:
        return self.out_dir / f"part-{len(self.shards):05d}.npy"

    def _open_shard(self) -> None:
        self._file = open(self._path().with_name(self._path().name + ".partial"), "wb")
        self._offsets, self._bytes = [0], []

    def _close_shard(self) -> None:
        path = self._path()
        self._file.close()
        with open(path.with_suffix(".docs.npz.partial"), "wb") as f:
            np.savez(f, token_offsets=np.array(self._offsets, dtype=np.int64), text_bytes=np.array(self._bytes, dtype=np.int64))
        os.replace(path.with_suffix(".docs.npz.partial"), path.with_suffix(".docs.npz"))
        os.replace(self._file.name, path)
        self.shards.append(str(path))
        self._file = None

    def finish(self) -> list[str]:
        if self._file is not None:
            self._close_shard()
        return self.shards


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
) -> TokenizeResult:
    """Tokenize the inputs into shards + sidecars + mix file in out_dir (new or empty)."""
    started = time.perf_counter()
    files = find_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_path)
    eos_id = special_id(tokenizer, eos_token, tokenizer_path)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    out = Path(out_dir)
    workers = os.cpu_count() if workers is None else workers
    with new_output_dir(out, "tokenize", DataError) as partial:
        names, documents, tokens, text_bytes = _write_shards(files, partial, str(tokenizer_path), eos_id, dtype,
                                                             shard_tokens, workers, progress)
        if not names:
            raise DataError(f"the inputs {inputs} hold no documents with text (empty ones are skipped)")
        write_mix_file(partial / "mix.txt", [Source(label or out.resolve().name, str(partial / n)) for n in names])
        write_shards_record(partial, names, token_dtype=dtype, vocab_size=vocab_size, eos_id=eos_id)
        result = TokenizeResult(
            shards=[str(out / n) for n in names], mix_file=str(out / "mix.txt"), documents=documents, tokens=tokens,
            text_bytes=text_bytes, seconds=time.perf_counter() - started, vocab_size=vocab_size, eos_id=eos_id,
            pad_id=pad_id, token_dtype=dtype,
        )
        summary = {**asdict(result), "tokenizer": str(Path(tokenizer_path).resolve()),
                   "inputs": [str(f) for f in files]}
        (partial / "tokenize.json").write_text(json.dumps(summary, indent=1) + "\n")
    return result


def _write_shards(files: list[Path], out: Path, tokenizer_path: str, eos_id: int, dtype: str, shard_tokens: int,
                  workers: int, progress: bool) -> tuple[list[str], int, int, int]:
    """(shard file names, documents, tokens, text bytes) of the files tokenized into shards under `out`."""
    writer = ShardWriter(out, shard_tokens)
    chunks = _chunks(files)
    bar = _progress_bar(progress)
    documents = tokens = text_bytes = 0
    if workers == 0:
        _init_worker(tokenizer_path, eos_id, dtype)
        results = map(_encode_chunk, chunks)
        pool = None
    else:
        # Rust-side threads in each worker would only fight the other workers for the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer_path, eos_id, dtype)
        )
        results = pool.imap(_encode_chunk, chunks)
    try:
        for chunk_tokens, lengths, chunk_bytes in results:
            writer.add(chunk_tokens, lengths, chunk_bytes)
            documents += len(lengths)
            tokens += len(chunk_tokens)
            text_bytes += int(chunk_bytes.sum())
            bar.update(int(chunk_bytes.sum()))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    return [Path(p).name for p in writer.finish()], documents, tokens, text_bytes


def _progress_bar(enabled: bool):
    from tqdm import tqdm

    return tqdm(unit="B", unit_scale=True, desc="tokenize", disable=not enabled)


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
    tokenizer.train_from_iterator((text for path in files for text in read_documents(path)), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    tokenizer.save(str(partial))
    os.replace(partial, out)
    return str(out)
