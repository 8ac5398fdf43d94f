"""Held-out sets as documents, and the fixed rows the evaluations read them in.

A set is token shards (documents, each ending with EOS, as `olmax tokenize`
writes them). Document boundaries come from the tokenize sidecar
`part-NNNNN.docs.npz` when there is one (it also gives each document's UTF-8
byte count, for bits per byte), else from the EOS tokens.

Each document is scored on its own, Paloma style, the way lm-eval's
`loglikelihood_rolling` scores a text: the first token is predicted from EOS
(the context a document start has in the training stream), every token
exactly once, in windows of `sequence_length` predictions; a window after the
first is filled up with the tokens before it, so every prediction has as much
context as fits. Rows are padded, padded positions carry weight 0.

The rows depend on nothing but the set, the token budget and the seed: not on
training order, device count or batch size. A budget takes whole documents in
the order of a permutation seeded by `seed`, until it is met.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmax import storage
from olmax.data.shards import TOKEN_DTYPES, DataError, count_tokens, read_mix_file

SCAN_TOKENS = 1 << 24  # tokens scanned for EOS at a time, so a large shard never sits in memory whole


@dataclass
class Shard:
    path: str
    tokens: np.ndarray  # read-only memmap of the whole shard
    offsets: np.ndarray  # int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]], EOS included
    text_bytes: np.ndarray | None  # int64 [documents], from the sidecar; None without one


@dataclass
class EvalSet:
    label: str
    shards: list[Shard]

    @property
    def documents(self) -> int:
        return sum(len(s.offsets) - 1 for s in self.shards)

    @property
    def has_bytes(self) -> bool:
        return all(s.text_bytes is not None for s in self.shards)


@dataclass
class Rows:
    """One row per window: which set and document it scores, and which of its tokens."""

    set_index: np.ndarray  # int32 [rows]
    shard: np.ndarray  # int32 [rows], index into the set's shards
    doc_start: np.ndarray  # int64 [rows], first token of the document in the shard
    start: np.ndarray  # int64 [rows], first token (within the document) this row predicts
    end: np.ndarray  # int64 [rows], one past the last

    def __len__(self) -> int:
        return len(self.start)


@dataclass
class Selection:
    """The documents of each set an evaluation reads, and the rows it reads them in."""

    sets: list[EvalSet]
    sequence_length: int
    documents: list[int]  # per set
    tokens: list[int]  # predictions per set
    text_bytes: list[int | None]  # per set; None when a shard of the set has no sidecar
    rows: Rows


def sidecar_path(shard: str | os.PathLike) -> str:
    """SHARD's documents sidecar: its name with the suffix replaced by `.docs.npz` (a path or a URL)."""
    return os.path.splitext(str(shard))[0] + ".docs.npz"


def _document_offsets(path: str, tokens: np.ndarray, eos_id: int) -> np.ndarray:
    ends = [np.flatnonzero(tokens[i : i + SCAN_TOKENS] == eos_id) + i + 1 for i in range(0, len(tokens), SCAN_TOKENS)]
    offsets = np.concatenate([[0], *ends]).astype(np.int64)
    if offsets[-1] != len(tokens):
        raise DataError(
            f"shard {path} does not end with EOS (id {eos_id}): it is truncated, or data.eos_id / data.token_dtype "
            "do not match the tokenizer that wrote it"
        )
    return offsets


def open_shard(path: str, *, token_dtype: str, eos_id: int, setting: str = "data.token_dtype") -> Shard:
    """The shard as its documents, after the checks training applies to a shard (its dtype record included);
    `setting` is what chooses the dtype, named in the errors. A shard in a bucket is read whole into memory
    (eval sets are small; training reads byte ranges)."""
    count_tokens(path, token_dtype, setting)
    dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    if storage.is_remote(path):
        tokens = np.frombuffer(storage.read_bytes(path), dtype=dtype)
    else:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    side = sidecar_path(path)
    if not storage.exists(side) or storage.is_dir(side):
        return Shard(path, tokens, _document_offsets(path, tokens, eos_id), None)
    with np.load(io.BytesIO(storage.read_bytes(side))) as sidecar:
        offsets = sidecar["token_offsets"].astype(np.int64)
        text_bytes = sidecar["text_bytes"].astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != len(tokens) or len(text_bytes) != len(offsets) - 1 or np.any(np.diff(offsets) < 1):
        raise DataError(
            f"sidecar {side} does not describe {path} ({len(tokens)} tokens, sidecar says {int(offsets[-1])}); "
            "re-run `olmax tokenize`, or delete the sidecar to find documents by EOS (no bits per byte then)"
        )
    return Shard(path, tokens, offsets, text_bytes)


def open_eval_set(label: str, paths: list[str], *, token_dtype: str, eos_id: int,
                  setting: str = "data.token_dtype") -> EvalSet:
    if not paths:
        raise DataError(f"eval set {label!r} has no shards")
    return EvalSet(label, [open_shard(p, token_dtype=token_dtype, eos_id=eos_id, setting=setting) for p in paths])


def shard_paths(paths: list[str], mix_file: str | None) -> list[str]:
    """The shards of an eval set given as paths or as a mix file (whose labels are not used)."""
    return [s.path for s in read_mix_file(mix_file, given_as="the eval set's mix_file")] if mix_file else list(paths)


def sets_from_argument(argument: str, *, token_dtype: str, eos_id: int, setting: str = "--token-dtype") -> list[EvalSet]:
    """`[LABEL=]PATH`: a shard, or a mix file (`.txt`). Without LABEL a mix file gives one set per label in
    it (Paloma's domains), and a shard is labeled by its file name."""
    label, sep, path = argument.partition("=")
    if not sep:
        label, path = "", argument
    if Path(path).suffix != ".txt":
        return [open_eval_set(label or Path(path).stem, [path], token_dtype=token_dtype, eos_id=eos_id,
                              setting=setting)]
    sources = read_mix_file(path, given_as="--data")
    groups = {label: sources} if label else {name: [s for s in sources if s.label == name]
                                              for name in dict.fromkeys(s.label for s in sources)}
    return [open_eval_set(name, [s.path for s in group], token_dtype=token_dtype, eos_id=eos_id, setting=setting)
            for name, group in groups.items()]


def choose_documents(lengths: np.ndarray, tokens: int | None, seed: int) -> np.ndarray:
    """Indices of the documents read, in the set's own order: all of them, or whole documents in the
    order of a permutation seeded by `seed` until `tokens` is met."""
    if tokens is None:
        return np.arange(len(lengths))
    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(lengths))
    taken = int(np.searchsorted(np.cumsum(lengths[order]), tokens)) + 1
    return np.sort(order[:taken])


def select(sets: list[EvalSet], *, sequence_length: int, tokens: int | None = None, seed: int = 0) -> Selection:
    """The documents each set contributes (`tokens` each, or all) and their rows, set after set.

    A document of n tokens gives ceil(n / sequence_length) rows; row k predicts its tokens
    [k * sequence_length, min((k + 1) * sequence_length, n)).
    """
    columns: dict[str, list] = {k: [] for k in ("set_index", "shard", "doc_start", "start", "end")}
    documents, predicted, text_bytes = [], [], []
    for index, eval_set in enumerate(sets):
        shard_of = np.concatenate([np.full(len(s.offsets) - 1, i, dtype=np.int32) for i, s in enumerate(eval_set.shards)])
        starts = np.concatenate([s.offsets[:-1] for s in eval_set.shards])
        lengths = np.concatenate([np.diff(s.offsets) for s in eval_set.shards])
        chosen = choose_documents(lengths, tokens, seed)
        lengths = lengths[chosen]
        per_doc = -(-lengths // sequence_length)
        window = np.arange(int(per_doc.sum())) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
        columns["set_index"].append(np.full(len(window), index, dtype=np.int32))
        columns["shard"].append(np.repeat(shard_of[chosen], per_doc))
        columns["doc_start"].append(np.repeat(starts[chosen], per_doc))
        columns["start"].append(window * sequence_length)
        columns["end"].append(np.minimum((window + 1) * sequence_length, np.repeat(lengths, per_doc)))
        documents.append(len(chosen))
        predicted.append(int(lengths.sum()))
        text_bytes.append(int(np.concatenate([s.text_bytes for s in eval_set.shards])[chosen].sum())
                          if eval_set.has_bytes else None)
    rows = Rows(*(np.concatenate(columns[k]) for k in ("set_index", "shard", "doc_start", "start", "end")))
    return Selection(sets, sequence_length, documents, predicted, text_bytes, rows)


def read_rows(selection: Selection, rows: slice, *, eos_id: int, pad_id: int, vocab_size: int, batch_rows: int):
    """A batch of `batch_rows` rows (the selection's rows, then padding rows of weight 0):
    inputs int32 [B, L], targets int32 [B, L], weights float32 [B, L]."""
    length = selection.sequence_length
    inputs = np.full((batch_rows, length), pad_id, dtype=np.int32)
    targets = np.zeros((batch_rows, length), dtype=np.int32)
    weights = np.zeros((batch_rows, length), dtype=np.float32)
    r = selection.rows
    for row, i in enumerate(range(*rows.indices(len(r)))):
        shard = selection.sets[r.set_index[i]].shards[r.shard[i]]
        start, end = int(r.start[i]), int(r.end[i])
        first = max(end - length, 0)  # the row's first target; earlier tokens than `start` are context only
        base = int(r.doc_start[i])
        tokens = np.asarray(shard.tokens[base + max(first - 1, 0) : base + end], dtype=np.int64)
        if len(tokens) and int(tokens.max()) >= vocab_size:
            raise DataError(f"eval shard {shard.path}: token id {int(tokens.max())} >= vocab size {vocab_size}; "
                            "the shard was made by another tokenizer or its token dtype is wrong")
        n = end - first
        targets[row, :n] = tokens[-n:]
        inputs[row, :n] = np.concatenate([[eos_id], tokens[:-1]]) if first == 0 else tokens[:-1]
        weights[row, start - first : n] = 1.0
    return inputs, targets, weights
