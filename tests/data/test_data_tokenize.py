"""`olmax tokenize`, `olmax tokenizer train`, `olmax synth-data`: text -> shards that the loader reads."""

import argparse
import gzip
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

from olmax.cli import main
from olmax.config import DataConfig
from olmax.data import DataError, build_loader
from olmax.data.cli import add_commands
from olmax.data.shards import read_mix_file
from olmax.data.tokenize import load_tokenizer, read_documents, tokenize_corpus, train_tokenizer
from olmax.errors import RunDirError

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
    assert summary["shards"] == [Path(p).name for p in result.shards] and summary["mix_file"] == "mix.txt"
    assert summary["tokens"] == sum(np.fromfile(p, dtype=np.uint16).size for p in result.shards)
    config = DataConfig(mix_file=result.mix_file, sequence_length=32, eos_id=0, pad_id=1, token_dtype="uint16")
    batch = next(build_loader(config, global_batch_instances=4, vocab_size=result.vocab_size))
    assert batch["input_ids"].shape == (4, 32)


def digests(out):
    """{file name: sha256} of every file of an output directory."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(out).rglob("*")) if p.is_file()}


def test_worker_count_does_not_change_the_output(tmp_path, corpus):
    inputs, _, tokenizer = corpus
    for workers in (0, 2):
        tokenize_corpus(inputs, tmp_path / str(workers), tokenizer_path=tokenizer, shard_tokens=3000, workers=workers,
                        label="toy", progress=False)
    assert digests(tmp_path / "0") == digests(tmp_path / "2")
    assert len([name for name in digests(tmp_path / "0") if name.endswith(".docs.npz")]) > 2


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
    with pytest.raises(DataError, match=r"broken\.jsonl\.gz: cannot read it \(BadGzipFile"):
        list(read_documents(broken))
    cut = gzip.compress(b"".join(b'{"text": "%d"}\n' % i for i in range(50_000)))
    broken.write_bytes(cut[: len(cut) // 2])
    with pytest.raises(DataError, match=r"broken\.jsonl\.gz: cannot read past line \d+ \(EOFError"):
        tokenize_corpus([str(broken)], tmp_path / "e", tokenizer_path=tokenizer, workers=0, progress=False)
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"table\.csv: not a \.jsonl/\.json/\.txt file"):
        tokenize_corpus([str(tmp_path / "table.csv")], tmp_path / "c", tokenizer_path=tokenizer, progress=False)
    with pytest.raises(DataError, match=r"no token '<\|eot\|>'"):
        tokenize_corpus([str(bad)], tmp_path / "d", tokenizer_path=tokenizer, eos_token="<|eot|>", progress=False)


def test_a_truncated_zst_fails_as_a_truncated_gz_does_and_all_its_frames_are_read(tmp_path, corpus):
    """zstandard's stream reader ends silently where a file was cut short, and after its first frame: a directory
    with half a .zst beside a good file tokenized with exit 0, the rest of its documents missing (with --skip-bad
    too, its torn last line counted as skipped)."""
    _, _, tokenizer = corpus
    lines = [b'{"text": "%d"}\n' % i for i in range(50_000)]
    whole = zstandard.ZstdCompressor().compress(b"".join(lines))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(lines[0])
    (tmp_path / "in" / "b.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    for skip_bad in (False, True):
        with pytest.raises(DataError, match=r"b\.jsonl\.zst: cannot read past line \d+ \(EOFError: the file ends "
                                            "inside a zstd frame"):
            tokenize_corpus([str(tmp_path / "in")], tmp_path / f"out-{skip_bad}", tokenizer_path=tokenizer, workers=0,
                            skip_bad=skip_bad, progress=False)
    frames = tmp_path / "frames.jsonl.zst"  # as `cat a.zst b.zst` or a multi-threaded zstd writes one
    frames.write_bytes(b"".join(zstandard.ZstdCompressor().compress(b"".join(lines[i : i + 20_000]))
                                for i in range(0, len(lines), 20_000)))
    assert list(read_documents(frames)) == [str(i) for i in range(50_000)]


@pytest.mark.parametrize("argv, message", [
    (["--label", "a,b"], "--label 'a,b' cannot label a mix file's `label,path` lines: give a --label of one line"),
    (["--label", "a\nb"], "--label 'a\\nb' cannot label"),
    (["--label", " web"], "--label ' web' cannot label"),
    (["--label", "#web"], "--label '#web' cannot label"),
    (["--label", ""], "--label '' cannot label"),
    (["--out-name", "a,b"], "the name of --out, 'a,b', the default --label, cannot label"),
    (["--workers", "-1"], "--workers -1: give the number of tokenizer processes, 0 (none: this one) or more"),
    (["--shard-tokens", "0"], "--shard-tokens 0: give the most tokens a shard holds, 1 or more"),
    (["--shard-tokens", "-1"], "--shard-tokens -1: give"),
    (["--engine", "ray", "--address", "garbage"], "--address garbage: not a Ray cluster's address (Invalid address "
                                                  "format: garbage); give the address of its head node"),
])
def test_bad_settings_are_one_line_before_anything_is_written(tmp_path, corpus, capsys, argv, message):
    """A label OLMo-core's mix file cannot hold (mix.txt written, and training refusing it), a negative worker
    count (a traceback), a shard of no tokens (a shard a document), an address Ray cannot read (a traceback, the
    output begun): exit 2, one line, no output directory."""
    inputs, _, tokenizer = corpus
    out = tmp_path / (argv[1] if argv[0] == "--out-name" else "out")
    settings = [] if argv[0] == "--out-name" else argv
    assert main(["tokenize", *inputs, "--tokenizer", tokenizer, "--out", str(out), "--quiet", *settings]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"olmax: DataError: {message}") and err.count("\n") == 1, err
    assert not out.exists()


def test_a_finished_output_is_done_for_the_same_command_and_refused_to_another(tmp_path, corpus, capsys):
    """The same command on its finished output (killed after its last commit, while it removed its work directory,
    or after it ended) exits 0 and writes nothing; another command's is refused as an output that is not empty."""
    inputs, _, tokenizer = corpus
    out = tmp_path / "out"
    argv = ["tokenize", *inputs[:2], "--tokenizer", tokenizer, "--out", out, "--workers", 0, "--quiet"]
    run_cli(*argv)
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert "mix.txt" in written and not [name for name in written if name.startswith(".tokenize")]
    for leftover in (None, "task-00000.json"):
        if leftover:  # a kill while the work directory was removed: what is left of it
            (out / ".tokenize").mkdir()
            (out / ".tokenize" / leftover).write_text("{}")
        capsys.readouterr()
        run_cli(*argv)
        assert "(--out holds the finished output of this same command: nothing to do)" in capsys.readouterr().out
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written
    for other in (["--label", "other"], ["--shard-tokens", 1000], ["--eos-token", "<|pad|>"]):
        with pytest.raises(DataError, match="is not empty .* new or empty directory"):
            run_cli(*argv, *other)


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



def committed_shards(out):
    return sorted(p.name for p in (out / ".tokenize").glob("part-*.json"))


def test_a_bad_line_fails_its_shard_and_a_rerun_with_skip_bad_goes_on_past_it(tmp_path, corpus):
    _, _, tokenizer = corpus
    lines = [json.dumps({"text": d}).encode() + b"\n" for d in make_documents(6000, 3)]  # chunks of 1 MB: 2 or 3
    lines[5000] = b'{"text": "caf\xe9"}\n'  # Latin-1, not UTF-8
    lines[5500] = b'{"title": "no text"}\n'
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.jsonl").write_bytes(b"".join(lines))
    out = tmp_path / "out"
    run = dict(tokenizer_path=tokenizer, shard_tokens=50_000, workers=2, label="toy", progress=False)
    with pytest.raises(DataError, match=r"bad\.jsonl:5001: not UTF-8 .*--skip-bad"):
        tokenize_corpus([str(tmp_path / "in")], out, **run)
    records = [json.loads((out / ".tokenize" / name).read_text()) for name in committed_shards(out)]
    assert records and records[-1]["resume_at"] <= 5000  # nothing of the bad line's shard is committed
    assert sorted(p.name for p in out.glob("*.npy")) == [r["shard"] for r in records] and not (out / "mix.txt").exists()
    result = tokenize_corpus([str(tmp_path / "in")], out, **run, skip_bad=True)
    assert (result.documents, result.skipped_documents) == (5998, 2)
    assert json.loads((out / "tokenize.json").read_text())["skipped_documents"] == 2
    tokenize_corpus([str(tmp_path / "in")], tmp_path / "fresh", **run, skip_bad=True)
    assert digests(out) == digests(tmp_path / "fresh")


def test_a_tokenize_killed_outright_is_finished_by_the_same_command_skipping_what_it_committed(tmp_path, corpus):
    inputs, _, tokenizer = corpus
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": d * 10}) + "\n" for d in make_documents(4_000, 2)))
    out = tmp_path / "shards"
    argv = ["tokenize", str(big), *inputs, "--tokenizer", tokenizer, "--label", "toy", "--shard-tokens", "20000",
            "--workers", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "olmax.cli", *argv, "--out", str(out), "--quiet"])
    while len(committed_shards(out) if (out / ".tokenize").exists() else []) < 2:  # the event: shards committed
        assert proc.poll() is None, "tokenize ended before it was killed"
    proc.send_signal(signal.SIGSTOP)  # stopped, it holds its lock: the same command beside it is refused
    with pytest.raises(RunDirError, match=f"--out {out} is in use by another run .host {socket.gethostname()}, "
                                          f"PID {proc.pid}, per {out}/.tokenize.lock"):
        run_cli(*argv, "--out", out, "--quiet")
    proc.kill()
    proc.wait()
    committed = {name: (out / name).stat().st_ino for name in
                 (n.replace(".json", suffix) for n in committed_shards(out) for suffix in (".npy", ".docs.npz"))}
    assert committed and not (out / "mix.txt").exists()
    with pytest.raises(DataError, match="holds the unfinished output of a tokenize of other inputs or settings"):
        run_cli(*argv[:-4], "--shard-tokens", 30000, "--workers", 0, "--out", out, "--quiet")
    run_cli(*argv, "--out", out, "--quiet")
    assert {name: (out / name).stat().st_ino for name in committed} == committed  # not written again
    run_cli(*argv, "--out", tmp_path / "whole", "--quiet")
    assert digests(out) == digests(tmp_path / "whole")
    assert not (out / ".tokenize").exists()


def test_progress_line(tmp_path, corpus, capsys):
    inputs, _, tokenizer = corpus
    tokenize_corpus(inputs, tmp_path / "out", tokenizer_path=tokenizer, shard_tokens=2000, workers=0)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("tokenize 6/6 files: ") and " read, 303 documents, " in last, last
    assert " tokens written, " in last and " tokens/s, ETA 00:00" in last, last


def test_ray_is_imported_only_for_the_ray_engine(tmp_path, corpus):
    inputs, _, tokenizer = corpus
    code = ("import sys; from olmax.cli import main; code = main(sys.argv[1:]); "
            "assert 'ray' not in sys.modules; sys.exit(code)")
    argv = [sys.executable, "-c", code, "tokenize", *inputs, "--tokenizer", tokenizer, "--workers", "0", "--quiet"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([*argv, "--out", str(tmp_path / "out")], env=env).returncode == 0
    wrong = subprocess.run([*argv, "--out", str(tmp_path / "other"), "--address", "127.0.0.1:1"], env=env,
                           capture_output=True, text=True)
    assert (wrong.returncode, wrong.stderr) == (2, "olmax: DataError: --address names a Ray cluster: give it with "
                                                   "--engine ray\n")
    assert not (tmp_path / "other").exists()
