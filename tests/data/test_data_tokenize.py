"""`olmax tokenize`, `olmax tokenizer train`, `olmax synth-data`: text -> shards that the loader reads."""

import argparse
import gzip
import json

import numpy as np
import pytest
import zstandard

from olmax.config import DataConfig
from olmax.data import DataError, build_loader
from olmax.data.cli import add_commands
from olmax.data.shards import read_mix_file
from olmax.data.tokenize import load_tokenizer, read_documents, tokenize_corpus, train_tokenizer

WORDS = "the a data model token shard loader epoch batch seed order train ünïcödé 数据 🙂".split()


def make_documents(count, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 60)))) + "\n" for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as JSONL, JSONL.gz, JSONL.zst and .txt files, and a tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    documents = make_documents(300, 0)
    jsonl = [json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents)]
    (root / "plain.jsonl").write_text("".join(jsonl[:150]) + "\n")  # a blank line is no document
    (root / "packed.jsonl.gz").write_bytes(gzip.compress("".join(jsonl[150:225]).encode()))
    (root / "packed.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(jsonl[225:]).encode()))
    texts = root / "texts"
    texts.mkdir()
    extra = make_documents(3, 1)
    for i, text in enumerate(extra):
        (texts / f"doc-{i}.txt").write_text(text)
    inputs = [str(root / "plain.jsonl"), str(root / "packed.jsonl.gz"), str(root / "packed.jsonl.zst"), str(texts)]
    tokenizer = train_tokenizer(inputs, root / "tokenizer.json", vocab_size=300, progress=False)
    return inputs, documents + extra, tokenizer


def decode_shards(result, tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    texts, text_bytes = [], []
    for path in result.shards:
        tokens = np.fromfile(path, dtype=result.token_dtype)
        sidecar = np.load(path.removesuffix(".npy") + ".docs.npz")
        offsets = sidecar["token_offsets"]
        assert offsets[0] == 0 and offsets[-1] == len(tokens)
        for start, end in zip(offsets[:-1], offsets[1:]):
            assert tokens[end - 1] == result.eos_id and result.eos_id not in tokens[start : end - 1]
            texts.append(tokenizer.decode(tokens[start : end - 1].tolist(), skip_special_tokens=False))
        text_bytes.extend(sidecar["text_bytes"].tolist())
    return texts, text_bytes


@pytest.mark.parametrize("workers", [0, 2])
def test_tokenize_round_trip(tmp_path, corpus, workers):
    inputs, documents, tokenizer = corpus
    result = tokenize_corpus(inputs, tmp_path / "out", tokenizer_path=tokenizer, shard_tokens=2000,
                             workers=workers, label="toy", progress=False)
    assert (result.token_dtype, result.eos_id, result.pad_id, result.vocab_size) == ("uint16", 0, 1, 300)
    assert len(result.shards) > 3
    texts, text_bytes = decode_shards(result, tokenizer)
    assert texts == documents
    assert text_bytes == [len(d.encode()) for d in documents]
    assert result.documents == len(documents) and result.text_bytes == sum(text_bytes)
    assert all(np.fromfile(p, dtype=np.uint16).size <= 2000 for p in result.shards)
    assert [(s.label, s.path) for s in read_mix_file(result.mix_file)] == [("toy", p) for p in result.shards]
    summary = json.loads((tmp_path / "out" / "tokenize.json").read_text())
    assert summary["tokens"] == sum(np.fromfile(p, dtype=np.uint16).size for p in result.shards)
    config = DataConfig(mix_file=result.mix_file, sequence_length=32, eos_id=0, pad_id=1, token_dtype="uint16")
    batch = next(build_loader(config, global_batch_instances=4, vocab_size=result.vocab_size))
    assert batch["input_ids"].shape == (4, 32)


def test_worker_count_does_not_change_the_output(tmp_path, corpus):
    inputs, _, tokenizer = corpus
    outputs = [tokenize_corpus(inputs, tmp_path / str(w), tokenizer_path=tokenizer, shard_tokens=3000, workers=w,
                               progress=False) for w in (0, 2)]
    for first, second in zip(outputs[0].shards, outputs[1].shards, strict=True):
        assert open(first, "rb").read() == open(second, "rb").read()


def test_large_vocab_gives_uint32_shards(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("w1 w69999 w5")
    result = tokenize_corpus([str(tmp_path / "in.txt")], tmp_path / "out", tokenizer_path=tmp_path / "big.json",
                             workers=0, progress=False)
    assert result.token_dtype == "uint32"
    assert np.fromfile(result.shards[0], dtype=np.uint32).tolist() == [3, 70001, 7, 0]


def test_bad_text_input(tmp_path, corpus):
    _, _, tokenizer = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no string `text` field"):
        tokenize_corpus([str(bad)], tmp_path / "a", tokenizer_path=tokenizer, workers=0, progress=False)
    bad.write_text('{"text": "fine"}\n\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not JSON"):
        list(read_documents(bad))
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not JSON"):
        tokenize_corpus([str(bad)], tmp_path / "b", tokenizer_path=tokenizer, workers=1, progress=False)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"broken\.jsonl\.gz: cannot read it"):
        list(read_documents(broken))
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"table\.csv: not a \.jsonl/\.json/\.txt file"):
        tokenize_corpus([str(tmp_path / "table.csv")], tmp_path / "c", tokenizer_path=tokenizer, progress=False)
    with pytest.raises(DataError, match=r"no token '<\|eot\|>'"):
        tokenize_corpus([str(bad)], tmp_path / "d", tokenizer_path=tokenizer, eos_token="<|eot|>", progress=False)


def test_refuses_a_directory_that_is_not_empty(tmp_path, corpus):
    inputs, _, tokenizer = corpus
    tokenize_corpus(inputs[:1], tmp_path, tokenizer_path=tokenizer, workers=0, progress=False)
    with pytest.raises(DataError, match="is not empty .* new or empty directory"):
        tokenize_corpus(inputs[:1], tmp_path, tokenizer_path=tokenizer, workers=0, progress=False)


def run_cli(*argv):
    parser = argparse.ArgumentParser(prog="olmax")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    args.func(args)


def test_cli_commands(tmp_path, corpus, capsys):
    inputs, _, _ = corpus
    run_cli("tokenizer", "train", *inputs, "--vocab-size", 280, "--out", tmp_path / "tok.json", "--quiet")
    assert load_tokenizer(tmp_path / "tok.json").get_vocab_size() == 280
    run_cli("tokenize", *inputs, "--tokenizer", tmp_path / "tok.json", "--out", tmp_path / "shards",
            "--workers", 0, "--quiet")
    assert f"data.mix_file={tmp_path / 'shards' / 'mix.txt'} data.token_dtype=uint16" in capsys.readouterr().out
    run_cli("synth-data", "--out", tmp_path / "synth", "--tokens", 50_000, "--shards", 2)
    assert len(read_mix_file(tmp_path / "synth" / "mix.txt")) == 2


def test_inputs_with_only_empty_texts_are_an_error_not_a_shard_of_eos(tmp_path, corpus):
    _, _, tokenizer = corpus
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": "  \\n"}\n')
    (tmp_path / "empty.txt").write_text("")
    for name in ("empty.jsonl", "empty.txt"):
        with pytest.raises(DataError, match="hold no documents with text"):
            tokenize_corpus([str(tmp_path / name)], tmp_path / f"out-{name}", tokenizer_path=tokenizer, workers=0,
                            progress=False)
        assert not (tmp_path / f"out-{name}").exists()


def test_the_partial_output_of_a_tokenize_killed_outright_is_removed_by_the_next(tmp_path, corpus):
    import subprocess
    import sys
    import time

    inputs, _, tokenizer = corpus
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": d * 40}) + "\n" for d in make_documents(5_000, 2)))
    out = tmp_path / "shards"
    proc = subprocess.Popen([sys.executable, "-m", "olmax.cli", "tokenize", str(big), "--tokenizer", tokenizer,
                             "--out", str(out), "--workers", "0", "--quiet"])
    partial = tmp_path / f".shards.partial-{proc.pid}"
    while not partial.exists():  # the event: the command has started writing
        assert proc.poll() is None, "tokenize ended before it was killed"
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert partial.exists() and not out.exists()
    tokenize_corpus(inputs[:1], out, tokenizer_path=tokenizer, workers=0, progress=False)
    assert not partial.exists() and (out / "mix.txt").is_file()
