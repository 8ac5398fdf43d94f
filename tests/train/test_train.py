import json
from pathlib import Path

import numpy as np
import pytest

from olmax.config import ConfigError, load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.train.trainer import train

METRIC_NAMES = {
    "train/CE loss", "train/Z loss", "optim/total grad norm", "optim/LR (group 0)", "optim/step skipped",
    "throughput/total tokens", "throughput/device/TPS", "throughput/device/MFU", "train/masked instances (%)",
    "io/retries",
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    return write_synthetic_shards(out, vocab_size=512, eos_id=0, n_tokens=200_000, n_shards=2, seed=0,
                                  token_dtype="uint16")


def _cfg(tmp_path, shards, name, *overrides):
    return load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path}/{name}",
                                "mesh.fsdp=1", *overrides])


def _losses(history):
    return [h["train/CE loss"] for h in history]


def test_resumed_run_matches_continuous_run_bitwise(tmp_path, shards):
    continuous = train(_cfg(tmp_path, shards, "a", "train.steps=20", "checkpoint.every=10"), quiet=True)
    first = train(_cfg(tmp_path, shards, "b", "train.steps=20", "train.stop_after=10", "checkpoint.every=10"),
                  quiet=True)
    resumed = train(_cfg(tmp_path, shards, "b", "train.steps=20", "checkpoint.every=10"), quiet=True)
    assert [h["step"] for h in resumed] == list(range(11, 21)), "checkpoint 10 resumes at step 11"
    assert _losses(first + resumed) == _losses(continuous)
    logged = [json.loads(line) for line in Path(tmp_path, "b", "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, 21))
    assert METRIC_NAMES <= set(logged[0])
    assert list(Path(tmp_path, "b", "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(int(p.name) for p in Path(tmp_path, "b", "checkpoints").iterdir() if p.name.isdigit()) == [10, 20]


def test_loss_decreases_on_the_generated_language(tmp_path, shards):
    history = train(_cfg(tmp_path, shards, "c", "train.steps=40", "checkpoint.every=40"), quiet=True)
    assert np.mean(_losses(history)[-5:]) < np.mean(_losses(history)[:5]) - 0.5


@pytest.mark.slow
def test_losses_agree_across_meshes(tmp_path, shards):
    runs = {}
    for mesh in ("mesh.fsdp=1", "mesh.fsdp=2", "mesh.fsdp=4", "mesh.fsdp=8", "mesh.data=2 mesh.fsdp=2 mesh.tensor=2",
                 "mesh.fsdp=4 mesh.expert=2"):  # stages: tests/parallel/test_pipeline.py
        name = mesh.replace(" ", "_").replace("=", "").replace(".", "").replace("[", "").replace("]", "")
        runs[mesh] = _losses(train(_cfg(tmp_path, shards, name, "train.steps=6", "checkpoint.every=6",
                                        *mesh.split()), quiet=True))
    reference = runs["mesh.fsdp=1"]
    for mesh, losses in runs.items():
        np.testing.assert_allclose(losses, reference, rtol=2e-5, err_msg=mesh)


def test_gradient_accumulation_equals_one_big_batch(tmp_path, shards):
    whole = train(_cfg(tmp_path, shards, "whole", "train.steps=6", "checkpoint.every=6"), quiet=True)
    accumulated = train(_cfg(tmp_path, shards, "acc", "train.steps=6", "checkpoint.every=6",
                             "train.micro_batch_per_device=4"), quiet=True)
    np.testing.assert_allclose(_losses(accumulated), _losses(whole), rtol=2e-6)
    norms = [[h["optim/total grad norm"] for h in run] for run in (whole, accumulated)]
    np.testing.assert_allclose(norms[0], norms[1], rtol=2e-5)


def test_indivisible_global_batch_is_refused_before_anything_is_written(tmp_path, shards):
    with pytest.raises(ConfigError, match="train.global_batch_instances 16 must be divisible"):
        train(_cfg(tmp_path, shards, "bad", "train.micro_batch_per_device=3"), quiet=True)
    with pytest.raises(ConfigError, match="divisible"):
        train(_cfg(tmp_path, shards, "bad", "mesh.fsdp=-1", "train.global_batch_instances=12"), quiet=True)
    assert not Path(tmp_path, "bad").exists()
