"""Data and resume inputs that used to pass silently or get a run stuck: shard dtypes, shard directories,
half-written outputs, and global batch size changes over several resumes."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from olmax.config import load_config
from olmax.data import DataError, build_loader
from olmax.data.shards import read_mix_file
from olmax.data.synthetic import write_synthetic_shards
from olmax.data.tokenize import load_tokenizer, tokenize_corpus, train_tokenizer
from olmax.train.trainer import train


def _train(run_dir, shards, *extra):
    overrides = [f"data.paths={json.dumps(shards)}", f"output_dir={run_dir}", "mesh.fsdp=1", *extra]
    return train(load_config("tiny", overrides), quiet=True)


def _data(paths, token_dtype="uint16"):
    return load_config("tiny", [f"data.paths={json.dumps([str(p) for p in paths])}",
                                f"data.token_dtype={token_dtype}"]).data


@pytest.mark.slow
def test_two_resumes_after_a_global_batch_change_continue_the_data(tmp_path, shards):
    """10 steps of 16 instances, then 32 per step: resumed at 12 and again at 14, as a single resume to 14."""
    _train(tmp_path / "a", shards, "train.steps=10", "checkpoint.every=5")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    bigger = ["train.steps=14", "train.global_batch_instances=32", "checkpoint.every=2"]
    twice = _train(tmp_path / "a", shards, *bigger, "train.stop_after=12") + _train(tmp_path / "a", shards, *bigger)
    once = _train(tmp_path / "b", shards, *bigger)
    assert [h["step"] for h in twice] == [h["step"] for h in once] == [11, 12, 13, 14]
    assert [h["train/CE loss"] for h in twice] == [h["train/CE loss"] for h in once]
    # Tokens as processed: 10 steps of 16 x 64, then 32 x 64 per step.
    assert [h["throughput/total tokens"] for h in twice] == [10 * 16 * 64 + k * 32 * 64 for k in (1, 2, 3, 4)]


def test_resuming_past_the_target_says_so(tmp_path, shards, capsys):
    _train(tmp_path / "run", shards, "train.steps=5", "checkpoint.every=5")
    overrides = [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path / 'run'}", "mesh.fsdp=1", "train.steps=3"]
    assert train(load_config("tiny", overrides)) == []
    assert "nothing to train: the run is at step 5, at or past train.steps=3" in capsys.readouterr().out


def test_failed_train_on_bad_data_writes_nothing(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _train(tmp_path / "run", [str(tmp_path / "missing.npy")], "train.steps=2")
    assert not (tmp_path / "run").exists()


def test_uint32_shards_read_as_uint16_are_refused(tmp_path):
    paths = write_synthetic_shards(tmp_path / "u32", vocab_size=512, eos_id=0, n_tokens=50_000, n_shards=2, seed=0,
                                   token_dtype="uint32")
    with pytest.raises(DataError, match=r"written as uint32 tokens .*shards\.json says.*data\.token_dtype=uint32"):
        build_loader(_data(paths), global_batch_instances=16, vocab_size=512)
    assert next(build_loader(_data(paths, "uint32"), global_batch_instances=16, vocab_size=512))["input_ids"].any()
    # Foreign shards (no record of how they were written): the every-other-token-is-0 pattern gives them away.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for path in paths:
        (foreign / Path(path).name).write_bytes(Path(path).read_bytes())
    with pytest.raises(DataError, match=r"every other token is 0 or 1.*data\.token_dtype=uint32"):
        build_loader(_data(list(foreign.iterdir())), global_batch_instances=16, vocab_size=512)


def test_a_directory_is_not_a_shard_nor_a_mix_file(tmp_path, shards):
    with pytest.raises(DataError, match=r"shard .* is a directory, not a token shard"):
        build_loader(_data([Path(shards[0]).parent]), global_batch_instances=16, vocab_size=512)
    data = _data(shards)
    data.paths, data.mix_file = [], str(Path(shards[0]).parent)
    with pytest.raises(DataError, match=r"mix file .* is a directory"):
        build_loader(data, global_batch_instances=16, vocab_size=512)


def test_synth_data_refuses_a_directory_that_holds_files(tmp_path):
    args = dict(vocab_size=512, eos_id=0, n_tokens=20_000, n_shards=2, seed=0)
    first = write_synthetic_shards(tmp_path / "out", **args)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(DataError, match="is not empty .* new or empty directory"):
        write_synthetic_shards(tmp_path / "out", **{**args, "n_shards": 1, "seed": 1})
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert [s.path for s in read_mix_file(tmp_path / "out" / "mix.txt")] == first


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    words = "the a data model token shard loader epoch batch seed".split()
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 30))}) + "\n"
                                             for _ in range(200)))
    return root


def test_a_failed_tokenize_writes_no_mix_file_and_its_output_takes_no_other_command(tmp_path, text):
    tokenizer = train_tokenizer([str(text / "docs.jsonl")], tmp_path / "tokenizer.json", vocab_size=280,
                                progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: not JSON"):  # after the first file's shards were written
        tokenize_corpus([str(text / "docs.jsonl"), str(bad)], tmp_path / "out", tokenizer_path=tokenizer,
                        shard_tokens=500, workers=0, progress=False)
    assert list((tmp_path / "out").glob("*.npy")) and not (tmp_path / "out" / "mix.txt").exists()
    with pytest.raises(DataError, match=r"out holds the unfinished output of a tokenize of other inputs or settings: "
                                        r"run that command again to finish it, or delete .*out"):
        tokenize_corpus([str(text / "docs.jsonl")], tmp_path / "out", tokenizer_path=tokenizer, shard_tokens=500,
                        workers=0, progress=False)
    shutil.rmtree(tmp_path / "out")
    result = tokenize_corpus([str(text / "docs.jsonl")], tmp_path / "out", tokenizer_path=tokenizer,
                             shard_tokens=500, workers=0, progress=False)
    assert len(result.shards) > 5 and all(Path(p).is_file() for p in result.shards)
    assert [s.path for s in read_mix_file(result.mix_file)] == result.shards


def test_tokenizer_train_never_overwrites_and_names_a_directory(tmp_path, text):
    out = tmp_path / "tok.json"
    train_tokenizer([str(text / "docs.jsonl")], out, vocab_size=280, progress=False)
    before = out.read_bytes()
    with pytest.raises(DataError, match="tok.json exists; give a new file name"):
        train_tokenizer([str(text / "docs.jsonl")], out, vocab_size=300, progress=False)
    assert out.read_bytes() == before
    with pytest.raises(DataError, match=r"is a directory; give the tokenizer file to write, e\.g\. .*tokenizer\.json"):
        train_tokenizer([str(text / "docs.jsonl")], tmp_path, vocab_size=280, progress=False)
    with pytest.raises(DataError, match="tokenizer file .* is a directory; pass the tokenizer.json file"):
        load_tokenizer(tmp_path)
