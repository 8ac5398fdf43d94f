"""Bad input fails with an error naming the file and the fix; fingerprints; mix files."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from olmax.config import DataConfig
from olmax.data import DataError, build_loader
from olmax.data.shards import Source, read_mix_file, write_mix_file

VOCAB = 1000


def shard(path, tokens, dtype=np.uint16):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return str(path)


def loader_for(paths=(), *, mix_file=None, length=16, batch=4, vocab=VOCAB, dtype="uint16", **data):
    config = DataConfig(paths=list(paths), mix_file=mix_file, sequence_length=length, eos_id=0, pad_id=1,
                        token_dtype=dtype, **data)
    return build_loader(config, global_batch_instances=batch, vocab_size=vocab)


@pytest.fixture
def good(tmp_path):
    return [shard(tmp_path / f"good-{i}.npy", np.arange(100 + 10 * i) % 500) for i in range(3)]


def test_missing_shard(tmp_path, good):
    with pytest.raises(DataError, match=r"shard .*nope\.npy does not exist"):
        loader_for([*good, str(tmp_path / "nope.npy")])


def test_empty_shard(tmp_path, good):
    with pytest.raises(DataError, match=r"empty\.npy is empty; remove it"):
        loader_for([*good, shard(tmp_path / "empty.npy", [])])


def test_size_not_a_multiple_of_the_token(tmp_path, good):
    path = tmp_path / "odd.npy"
    path.write_bytes(b"\x01\x00" * 40 + b"\x01")
    with pytest.raises(DataError, match=r"odd\.npy: 81 bytes is not a multiple of the 2-byte uint16 token"):
        loader_for([*good, str(path)])


def test_token_id_beyond_vocab_at_startup(tmp_path, good):
    with pytest.raises(DataError, match=r"big\.npy: token id 1234 at token 5 >= vocab size 1000"):
        loader_for([*good, shard(tmp_path / "big.npy", [3] * 5 + [1234] + [3] * 50)])


def test_token_id_beyond_vocab_in_a_later_batch(tmp_path):
    tokens = np.full(20_000, 7)
    tokens[12_345] = 4321  # past the startup check of the shard's head
    loader = loader_for([shard(tmp_path / "late.npy", tokens)], length=16, batch=4)
    with pytest.raises(DataError, match=r"late\.npy: token id 4321 at token 12345 >= vocab size 1000"):
        for _ in range(loader.batches_per_epoch):
            next(loader)


def test_uint16_shard_read_as_uint32_fails_at_startup(tmp_path):
    path = shard(tmp_path / "small.npy", np.full(4000, 300))
    with pytest.raises(DataError, match=r"small\.npy: token id 19661100 .* data.token_dtype is wrong \(it is uint32\)"):
        loader_for([path], dtype="uint32", length=16)


def test_sequence_longer_than_a_shard(tmp_path, good):
    with pytest.raises(DataError, match=r"short\.npy holds 10 tokens, fewer than data.sequence_length 16"):
        loader_for([*good, shard(tmp_path / "short.npy", range(10))])


def test_fewer_instances_than_a_global_batch(good):
    with pytest.raises(DataError, match=r"fewer than one global batch of 64"):
        loader_for(good, batch=64)


def test_batch_not_divisible_by_processes(good):
    config = DataConfig(paths=good, sequence_length=16, eos_id=0, pad_id=1, token_dtype="uint16")
    with pytest.raises(DataError, match="not divisible by the 3 processes"):
        build_loader(config, global_batch_instances=4, vocab_size=VOCAB, process_index=0, process_count=3)


def test_no_data_or_both_sources(tmp_path, good):
    with pytest.raises(DataError, match="set data.paths"):
        loader_for([])
    with pytest.raises(DataError, match="either data.paths or data.mix_file"):
        loader_for(good, mix_file=str(tmp_path / "mix.txt"))


def test_mix_file_round_trip_and_relative_paths(tmp_path, good):
    mix = tmp_path / "mix.txt"
    write_mix_file(mix, [Source("web", good[0]), Source("code", good[1]), Source("code", good[2])])
    assert mix.read_text().splitlines() == ["web,good-0.npy", "code,good-1.npy", "code,good-2.npy"]
    sources = read_mix_file(mix)
    assert [s.label for s in sources] == ["web", "code", "code"]
    assert loader_for(mix_file=str(mix)).fingerprint == loader_for(good).fingerprint


@pytest.mark.parametrize("line", ["just-a-path.npy", "a,b,c.npy", ",x.npy"])
def test_mix_line_that_does_not_parse(tmp_path, line):
    mix = tmp_path / "mix.txt"
    mix.write_text(f"# a comment\n\nweb,good.npy\n{line}\n")
    with pytest.raises(DataError, match=r"mix\.txt:4: .* must be `label,path`"):
        read_mix_file(mix)


def test_mix_file_errors(tmp_path):
    with pytest.raises(DataError, match="mix file .*absent.txt does not exist"):
        read_mix_file(tmp_path / "absent.txt")
    mix = tmp_path / "olmo.txt"
    mix.write_text("web,preprocessed/{TOKENIZER}/part-0.npy\n")
    with pytest.raises(DataError, match=r"olmo\.txt:1: .*\{TOKENIZER\} placeholder; set data.mix_tokenizer"):
        read_mix_file(mix)


def test_published_mix_with_tokenizer_placeholder_and_base_dir(tmp_path, good):
    """AI2's mix files as published: paths relative to a base directory, with a {TOKENIZER} placeholder."""
    base = tmp_path / "ai2-llm"
    for i, shard in enumerate(good):
        target = base / "preprocessed" / f"src{i}" / "allenai" / "dolma2-tokenizer" / "part-0.npy"
        target.parent.mkdir(parents=True)
        shutil.copy(shard, target)
    mix = tmp_path / "mixes" / "OLMo-mix.txt"
    mix.parent.mkdir()
    mix.write_text("".join(f"src{i},preprocessed/src{i}/{{TOKENIZER}}/part-0.npy\n" for i in range(len(good))))
    sources = read_mix_file(mix, base_dir=str(base), tokenizer="allenai/dolma2-tokenizer")
    assert [s.label for s in sources] == [f"src{i}" for i in range(len(good))]
    assert all(Path(s.path).is_file() for s in sources)
    published = loader_for(mix_file=str(mix), mix_base_dir=str(base), mix_tokenizer="allenai/dolma2-tokenizer")
    assert np.array_equal(next(published)["input_ids"], next(loader_for(good))["input_ids"])


def test_fingerprint_ignores_directories_but_not_names_or_sizes(tmp_path, good):
    moved = tmp_path / "moved"
    moved.mkdir()
    copies = [shutil.copy(p, moved) for p in good]
    assert loader_for(copies).fingerprint == loader_for(good).fingerprint
    assert loader_for(good, length=8).fingerprint != loader_for(good).fingerprint
    assert loader_for(good[::-1]).fingerprint != loader_for(good).fingerprint
    assert loader_for(good, vocab=2000).fingerprint != loader_for(good).fingerprint


def test_resume_on_other_data_names_what_changed(good):
    loader = loader_for(good)
    next(loader)
    state = loader.state_dict()
    with pytest.raises(DataError, match=r"sequence_length 16 -> 8"):
        loader_for(good, length=8).load_state_dict(state)
    with pytest.raises(DataError, match=r"number of shards 3 -> 2"):
        loader_for(good[:2]).load_state_dict(state)
    with pytest.raises(DataError, match=r"data.seed 34521 -> 5"):
        loader_for(good, seed=5).load_state_dict(state)
    shard(good[1], np.arange(200) % 500)
    with pytest.raises(DataError, match=r"shard 1: good-1.npy \(220 bytes\) -> good-1.npy \(400 bytes\)"):
        loader_for(good).load_state_dict(state)
    allowed = loader_for(good, allow_fingerprint_change=True)
    allowed.load_state_dict(state)
    assert allowed.state_dict()["batches_processed"] == 1


def test_tokenizer_file_that_does_not_load(tmp_path):
    from olmax.data.tokenize import load_tokenizer

    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer file .*tokenizer\.json does not load"):
        load_tokenizer(bad)
    with pytest.raises(DataError, match=r"tokenizer file .*missing\.json does not exist"):
        load_tokenizer(tmp_path / "missing.json")
