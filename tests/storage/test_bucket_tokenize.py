"""`olmax tokenize` from and to buckets (its tokenizer in one too), through faults: the bytes the same inputs give
on local disk."""

from __future__ import annotations

import gzip
import hashlib
import json

import numpy as np
import zstandard

from olmax import storage
from olmax.data.tokenize import tokenize_corpus, train_tokenizer


def _corpus(root):
    """JSONL, JSONL.gz, JSONL.zst and .txt files of random words, and a tokenizer trained on them."""
    rng = np.random.default_rng(0)
    words = "the a data model token shard bucket ünïcödé 数据 🙂".split()
    lines = [json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(1, 200))))}) + "\n" for _ in range(600)]
    root.mkdir()
    (root / "a.jsonl").write_text("".join(lines[:200]))
    (root / "b.jsonl.gz").write_bytes(gzip.compress("".join(lines[200:400]).encode()))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(lines[400:]).encode()))
    (root / "d.txt").write_text("one document, the whole file\n")
    return train_tokenizer([str(root)], root.parent / "tokenizer.json", vocab_size=300, progress=False)


def _digests(root, names):
    return {name: hashlib.sha256(storage.read_bytes(storage.join(root, name))).hexdigest() for name in names}


def test_tokenize_from_gcs_to_s3_through_faults_writes_the_local_bytes(stores, tmp_path):
    tokenizer = _corpus(tmp_path / "text")
    local = tokenize_corpus([str(tmp_path / "text")], tmp_path / "out", tokenizer_path=tokenizer, shard_tokens=6000,
                            workers=0, label="web", progress=False)
    storage.upload(tmp_path / "text", f"gs://{stores.bucket}/text")
    storage.upload(tokenizer, f"gs://{stores.bucket}/tokenizer.json")
    stores.set_faults(share=0.1)
    out = f"s3://{stores.bucket}/shards"
    remote = tokenize_corpus([f"gs://{stores.bucket}/text"], out, tokenizer_path=f"gs://{stores.bucket}/tokenizer.json",
                             shard_tokens=6000, workers=0, label="web", progress=False)
    assert stores.s3.faults > 0 and stores.gcs.faults > 0
    names = [storage.basename(p) for p in local.shards]
    assert remote.shards == [storage.join(out, name) for name in names] and len(names) > 4
    files = [*names, *(n.replace(".npy", ".docs.npz") for n in names), "mix.txt", "shards.json"]
    assert storage.listdir(out) == sorted([*files, "tokenize.json"])  # no work directory left
    assert _digests(out, files) == _digests(str(tmp_path / "out"), files)
    record = json.loads(storage.read_text(f"{out}/tokenize.json"))
    assert record["inputs"] == [f"gs://{stores.bucket}/text/{n}" for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst",
                                                                            "d.txt")]
    assert record == {**json.loads((tmp_path / "out" / "tokenize.json").read_text()), "inputs": record["inputs"],
                      "tokenizer": f"gs://{stores.bucket}/tokenizer.json"}
