"""Mid-training mixes (data.sources) against ai2-olmo-core's SourceMixtureDatasetConfig and NumpyFSLDataLoader."""

import os

import numpy as np
import pytest

from olmax.config import ConfigError, DataConfig, SourceConfig, validate
from olmax.data import DataError, build_loader
from olmax.data.mixture import select_mixture
from olmax.data.shards import Source, write_mix_file
from olmax.data.synthetic import write_synthetic_shards

olmo_data = pytest.importorskip("olmo_core.data")
from olmo_core.data.numpy_dataset import NumpyFSLDatasetConfig  # noqa: E402
from olmo_core.data.source_mixture import (  # noqa: E402
    SourceMixtureConfig,
    SourceMixtureDatasetConfig,
    SourceMixtureList,
)
from olmo_core.exceptions import OLMoConfigurationError  # noqa: E402
from test_data_order import advance_together, olmo_core_batches  # noqa: E402

VOCAB, EOS, PAD, SEED = 512, 0, 1, 34521
LENGTH, BATCH = 32, 16
# name -> (ratio, max_repetition_ratio); math needs 2.35 passes over itself in "repeated".
MIXES = {
    "ratios": ({"web": (0.6, 1.0), "code": (0.3, 1.0), "math": (0.1, 1.0)}, 12_000),
    "repeated": ({"web": (0.5, 1.0), "code": (0.3, 1.0), "math": (0.2, 3.0)}, 20_000),
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three sources of generated documents, several uneven shards each."""
    root = tmp_path_factory.mktemp("sources")
    sizes = {"web": (30_000, 3), "code": (8_000, 2), "math": (1_700, 3)}
    return {name: write_synthetic_shards(root / name, vocab_size=VOCAB, eos_id=EOS, n_tokens=tokens, n_shards=count,
                                         seed=seed)
            for seed, (name, (tokens, count)) in enumerate(sizes.items())}


def data_config(paths_by_source, spec, requested, *, fractions=None, **extra):
    sources = [SourceConfig(name=name, ratio=ratio, paths=paths_by_source[name], max_repetition_ratio=repeat,
                            max_source_fraction=(fractions or {}).get(name, 1.0))
               for name, (ratio, repeat) in spec.items()]
    return DataConfig(sources=sources, requested_tokens=requested, sequence_length=LENGTH, eos_id=EOS, pad_id=PAD,
                      token_dtype="uint16", seed=SEED, **extra)


def olmo_core_mixture(paths_by_source, spec, requested, *, global_batch=BATCH, fractions=None):
    return SourceMixtureDatasetConfig(
        source_list=SourceMixtureList(sources=[
            SourceMixtureConfig(source_name=name, target_ratio=ratio, paths=paths_by_source[name],
                                max_repetition_ratio=repeat, max_source_fraction=(fractions or {}).get(name, 1.0))
            for name, (ratio, repeat) in spec.items()
        ]),
        requested_tokens=requested, global_batch_size=global_batch * LENGTH, seed=5, render_tables=False, quiet=True,
    )


@pytest.fixture(scope="module", params=sorted(MIXES))
def mix(request, shards, tmp_path_factory):
    """(name, OLMo-core's prepared NumpyFSLDatasetMixture) as NumpyFSLDatasetConfig.build makes it."""
    spec, requested = MIXES[request.param]
    work_dir = tmp_path_factory.mktemp(f"olmo-core-{request.param}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OLMO_DATA_PREP_WORKERS", "1")
        dataset = NumpyFSLDatasetConfig.from_src_mix(
            olmo_core_mixture(shards, spec, requested),
            tokenizer=olmo_data.TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD),
            sequence_length=LENGTH, work_dir=str(work_dir),
        ).build()
        dataset.prepare()
    return request.param, dataset


def olmo_core_loader(dataset, *, rank, world):
    return olmo_data.NumpyFSLDataLoader(
        dataset, collator=olmo_data.DataCollator(pad_token_id=PAD), global_batch_size=BATCH * LENGTH,
        work_dir=dataset.work_dir, seed=SEED, dp_world_size=world, dp_rank=rank, fs_local_rank=0, num_threads=0,
    )


def mixture_loader(shards, name, *, rank=0, world=1, **extra):
    spec, requested = MIXES[name]
    return build_loader(data_config(shards, spec, requested, **extra), global_batch_instances=BATCH,
                        vocab_size=VOCAB, process_index=rank, process_count=world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_same_batches_as_olmo_core_over_epochs(shards, mix, world):
    name, dataset = mix
    for rank in range(world):
        loader = mixture_loader(shards, name, rank=rank, world=world)
        ours = loader.reader.shards
        assert [(os.path.basename(s.path), n) for s, n in zip(ours.sources, ours.instances)] == [
            (os.path.basename(str(path)), end - start) for path, (start, end) in zip(dataset.paths, dataset.offsets)
        ]
        reference = olmo_core_loader(dataset, rank=rank, world=world)
        assert loader.batches_per_epoch == reference.total_batches
        count = 0
        for expected in olmo_core_batches(reference, epochs=2):
            np.testing.assert_array_equal(next(loader)["input_ids"], expected["input_ids"].numpy())
            count += 1
        assert count == 2 * reference.total_batches
        loader.close()


@pytest.mark.parametrize("world", [2, 4])
def test_resume_matches_olmo_core(shards, mix, world):
    """A position saved by one process is resumed by `world` processes, in epoch 1, through epoch 2."""
    name, dataset = mix
    ours, theirs = advance_together(mixture_loader(shards, name), olmo_core_loader(dataset, rank=0, world=1), 7)
    for rank in range(world):
        loader = mixture_loader(shards, name, rank=rank, world=world)
        loader.load_state_dict(ours)
        resumed = olmo_core_loader(dataset, rank=rank, world=world)
        resumed.load_state_dict(theirs)
        count = 0
        for expected in olmo_core_batches(resumed, epochs=2):
            np.testing.assert_array_equal(next(loader)["input_ids"], expected["input_ids"].numpy())
            count += 1
        assert count == 2 * resumed.total_batches - 7


def sized_sources(root, sizes_by_source):
    """Shards of zeros: the selection depends on their sizes only."""
    paths = {}
    for name, sizes in sizes_by_source.items():
        (root / name).mkdir()
        paths[name] = [str(root / name / f"part-{i}.npy") for i in range(len(sizes))]
        for path, size in zip(paths[name], sizes):
            np.zeros(size, dtype=np.uint16).tofile(path)
    return paths


SIZES = {"web": [50_001, 70_123, 9_990, 31], "code": [20_000, 17_777], "math": [14_321, 2_222, 999]}
SELECTIONS = [  # (ratio, max_repetition_ratio) by source, requested tokens, global batch, max_source_fraction
    ({"web": (0.6, 1.0), "code": (0.3, 1.0), "math": (0.1, 1.0)}, 100_000, 16, None),
    ({"web": (0.6, 1.0), "code": (0.3, 1.0), "math": (0.1, 1.0)}, 100_000, 7, None),
    ({"web": (0.2, 1.0), "code": (0.7, 1.0), "math": (0.1, 1.0)}, 50_003, 16, None),
    ({"web": (0.34, 1.0), "code": (0.33, 2.0), "math": (0.33, 10.0)}, 130_000, 16, None),
    ({"web": (0.5, 1.0), "code": (0.25, 1.0), "math": (0.25, 4.0)}, 100, 16, None),
    ({"web": (0.8, 1.0), "code": (0.1, 1.0), "math": (0.1, 2.0)}, 150_000, 16, {"web": 0.95, "math": 0.9}),
    ({"web": (1.0, 1.0)}, 77_777, 3, None),
]


@pytest.mark.parametrize("spec, requested, global_batch, fractions", SELECTIONS)
def test_same_tokens_per_shard_as_olmo_core(tmp_path, spec, requested, global_batch, fractions):
    paths = sized_sources(tmp_path, {name: SIZES[name] for name in spec})
    mixture = olmo_core_mixture(paths, spec, requested, global_batch=global_batch, fractions=fractions).build(
        npdtype=np.uint16, sequence_length=LENGTH)
    mixture.filter_zero_token_paths = True  # as NumpyFSLDatasetConfig.build
    sources, instances = select_mixture(data_config(paths, spec, requested, fractions=fractions),
                                        global_batch_instances=global_batch)
    assert [(s.path, n * LENGTH) for s, n in zip(sources, instances)] == [
        (path, tokens) for (path, _), tokens in mixture.to_index().items()
    ]
    labels = [s.label for s in sources]
    assert labels == sorted(labels, key=list(spec).index)  # global instance ids in source order


@pytest.mark.parametrize("ratios", [(0.6, 0.3, 0.1), (0.2, 0.7, 0.1), (0.1, 0.45, 0.45)])
def test_source_token_fractions_match_the_ratios(tmp_path, ratios):
    paths = sized_sources(tmp_path, {"web": [150_000, 90_001], "code": [100_000, 80_000, 1_234], "math": [200_000]})
    spec = {name: (ratio, 1.0) for name, ratio in zip(paths, ratios)}
    sources, instances = select_mixture(data_config(paths, spec, 150_000), global_batch_instances=BATCH)
    total = sum(instances)
    assert total * LENGTH >= 150_000 and total % BATCH == 0
    for name, ratio in zip(paths, ratios):
        selected = sum(n for s, n in zip(sources, instances) if s.label == name)
        assert selected / total == pytest.approx(ratio, abs=0.003), name


def test_repetition_reads_the_source_again_from_its_head(shards):
    loader = mixture_loader(shards, "repeated")
    ours = loader.reader.shards
    math = [(s.path, int(offset), n) for s, offset, n in zip(ours.sources, ours.offsets, ours.instances)
            if s.label == "math"]
    assert [path for path, _, _ in math] == shards["math"] * 3  # two whole passes and a partial one
    for (path, first, n), (again, second, m) in zip(math, math[3:]):
        assert path == again and m <= n
        np.testing.assert_array_equal(ours.read(np.arange(second, second + m)), ours.read(np.arange(first, first + m)))


def test_more_tokens_than_a_source_gives_is_an_error_as_in_olmo_core(shards):
    spec, requested = MIXES["repeated"]
    without_repetition = {**spec, "math": (0.2, 1.0)}
    with pytest.raises(OLMoConfigurationError, match="Insufficient tokens for source: math"):
        olmo_core_mixture(shards, without_repetition, requested).build(npdtype=np.uint16, sequence_length=LENGTH)
    with pytest.raises(DataError, match=r"data.sources 'math': ratio 0.2 of data.requested_tokens 20000 is 4000 "
                                        r"tokens, more than the \d+ it may give .* raise its max_repetition_ratio"):
        build_loader(data_config(shards, without_repetition, requested), global_batch_instances=BATCH,
                     vocab_size=VOCAB)
    with pytest.raises(DataError, match=r"'web': .* x max_source_fraction 0.2 x"):
        build_loader(data_config(shards, spec, requested, fractions={"web": 0.2}), global_batch_instances=BATCH,
                     vocab_size=VOCAB)


def test_sources_from_mix_file_labels(tmp_path, shards):
    mix = tmp_path / "mix.txt"
    write_mix_file(mix, [Source(name, path) for name in ("math", "web", "code") for path in shards[name]])
    spec, requested = MIXES["ratios"]
    labeled = DataConfig(mix_file=str(mix), sources=[SourceConfig(name=name, ratio=ratio)
                                                     for name, (ratio, _) in spec.items()],
                         requested_tokens=requested, sequence_length=LENGTH, eos_id=EOS, pad_id=PAD,
                         token_dtype="uint16", seed=SEED)
    loader = build_loader(labeled, global_batch_instances=BATCH, vocab_size=VOCAB)
    listed = mixture_loader(shards, "ratios")
    assert loader.fingerprint == listed.fingerprint
    np.testing.assert_array_equal(next(loader)["input_ids"], next(listed)["input_ids"])
    unlabeled = labeled.model_copy(update={"sources": [*labeled.sources[:2], SourceConfig(name="books", ratio=0.2)]})
    with pytest.raises(DataError, match="data.mix_file has no line labeled 'books'"):
        build_loader(unlabeled, global_batch_instances=BATCH, vocab_size=VOCAB)


def test_resume_names_what_changed(shards):
    spec, requested = MIXES["ratios"]
    loader = mixture_loader(shards, "ratios")
    next(loader)
    state = loader.state_dict()

    def resume(config):
        build_loader(config, global_batch_instances=BATCH, vocab_size=VOCAB).load_state_dict(state)

    more_web = {**spec, "web": (0.7, 1.0), "code": (0.2, 1.0)}
    with pytest.raises(DataError, match=r"source web ratio 0.6 -> 0.7; source code ratio 0.3 -> 0.2; instances"):
        resume(data_config(shards, more_web, requested))
    with pytest.raises(DataError, match=r"data.requested_tokens 12000 -> 11000"):
        resume(data_config(shards, spec, 11_000))
    with pytest.raises(DataError, match=r"source code max_repetition_ratio 1.0 -> 2.0"):
        resume(data_config(shards, {**spec, "code": (0.3, 2.0)}, requested))
    with pytest.raises(DataError, match=r"data.sources unset"):
        resume(DataConfig(paths=shards["web"], sequence_length=LENGTH, eos_id=EOS, pad_id=PAD, token_dtype="uint16",
                          seed=SEED))
    with pytest.raises(DataError, match=r"data.seed 34521 -> 5"):
        resume(data_config(shards, spec, requested).model_copy(update={"seed": 5}))
    resume(data_config(shards, spec, requested))


@pytest.mark.parametrize("data, message", [
    ({"sources": [{"name": "a", "ratio": 0.5, "paths": ["x"]}, {"name": "b", "ratio": 0.4, "paths": ["y"]}],
      "requested_tokens": 10}, "ratios must sum to 1, got 0.9"),
    ({"sources": [{"name": "a", "ratio": 1.0, "paths": ["x"]}]}, "data.sources needs data.requested_tokens"),
    ({"requested_tokens": 10, "paths": ["x"]}, "data.requested_tokens is set but data.sources is empty"),
    ({"sources": [{"name": "a", "ratio": 1.0, "paths": ["x"]}], "requested_tokens": 10, "paths": ["x"]},
     "either data.paths or data.sources"),
    ({"sources": [{"name": "a", "ratio": 0.5, "paths": ["x"]}, {"name": "a", "ratio": 0.5, "paths": ["y"]}],
      "requested_tokens": 10}, "names must be unique"),
    ({"sources": [{"name": "a", "ratio": 1.0}], "requested_tokens": 10}, r"\['a'\] list no paths"),
    ({"sources": [{"name": "a", "ratio": 1.0, "paths": ["x"]}], "requested_tokens": 10, "mix_file": "m.txt"},
     "data.mix_file is unused"),
    ({"sources": [{"name": "a", "ratio": 1.0, "paths": ["x"], "max_repetition_ratio": 0.5}], "requested_tokens": 10},
     r"data.sources.0.max_repetition_ratio: Input should be greater than or equal to 1"),
    ({"sources": [{"name": "a", "ratio": 0, "paths": ["x"]}], "requested_tokens": 10},
     r"data.sources.0.ratio: Input should be greater than 0"),
])
def test_bad_mixture_configs(data, message):
    with pytest.raises(ConfigError, match=message):
        validate({"model": {"vocab_size": VOCAB}, "data": {"eos_id": EOS, "pad_id": PAD, **data}})
