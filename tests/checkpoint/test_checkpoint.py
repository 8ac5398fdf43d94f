"""The one checkpoint reader: checksums of every array and of the meta, one error for an unusable checkpoint,
fallback without stray output, and every kind of path that names a checkpoint."""

import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from olmax.checkpoint import CheckpointError, Checkpointer, UnreadableCheckpoint, checksums
from olmax.config import CheckpointConfig, load_config
from olmax.interop import InteropError
from olmax.model.weights import load_olmax
from olmax.model import families
from olmax.parallel.mesh import make_layout
from olmax.train.trainer import train


def _overrides(run_dir, shards, *extra):
    return [f"data.paths={json.dumps(shards)}", f"output_dir={run_dir}", "mesh.fsdp=1", *extra]


def _train(run_dir, shards, *extra):
    return train(load_config("tiny", _overrides(run_dir, shards, *extra)), quiet=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory, shards):
    """12 steps, checkpoints 5 and 10, and the losses of steps 6 to 12 of the continuous run."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    history = _train(run_dir, shards, "train.steps=12", "train.stop_after=10", "checkpoint.every=5")
    reference = tmp_path_factory.mktemp("reference") / "run"
    shutil.copytree(run_dir, reference)
    continued = _train(reference, shards, "train.steps=12", "checkpoint.every=5")
    return run_dir, [h["train/CE loss"] for h in history[5:] + continued]


def _largest_file(directory):
    return max((f for f in glob.glob(f"{directory}/**", recursive=True) if os.path.isfile(f)), key=os.path.getsize)


def _resume_falls_back_to_5(run_dir, shards, losses, caplog, message):
    with caplog.at_level(logging.WARNING):
        resumed = _train(run_dir, shards, "train.steps=12", "checkpoint.every=5")
    assert message in caplog.text and "trying the one before it" in caplog.text
    assert [h["step"] for h in resumed] == list(range(6, 13))
    assert [h["train/CE loss"] for h in resumed] == losses
    assert glob.glob(f"{run_dir}/checkpoints/10.unreadable-*"), "the corrupted checkpoint is set aside"


def test_flipped_bytes_in_a_tensor_file_fall_back_to_the_previous_checkpoint(tmp_path, run, shards, caplog):
    run_dir, losses = run
    shutil.copytree(run_dir, tmp_path / "run")
    tensors = _largest_file(tmp_path / "run" / "checkpoints" / "10" / "params")
    data = bytearray(open(tensors, "rb").read())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # the size stays the same
    open(tensors, "wb").write(bytes(data))
    _resume_falls_back_to_5(tmp_path / "run", shards, losses, caplog, "the checksum of params[")


def test_an_edited_loader_state_falls_back_to_the_previous_checkpoint(tmp_path, run, shards, caplog):
    run_dir, losses = run
    shutil.copytree(run_dir, tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / "10" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["data"]["batches_processed"] += 1  # still valid JSON, a different data position
    path.write_text(json.dumps(meta))
    _resume_falls_back_to_5(tmp_path / "run", shards, losses, caplog, "the checksum of its meta differs")


def test_a_checkpoint_without_checksums_is_read_with_a_warning(tmp_path, run, shards, caplog):
    """As written by olmax before it recorded checksums."""
    run_dir, losses = run
    shutil.copytree(run_dir, tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / "10" / "meta" / "metadata"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "checksums"}))
    with caplog.at_level(logging.WARNING):
        resumed = _train(tmp_path / "run", shards, "train.steps=12", "checkpoint.every=5")
    assert "10 has no checksums olmax computes (written by an older olmax); not verified" in caplog.text
    assert [h["train/CE loss"] for h in resumed] == losses[5:]


def test_checksums_are_the_same_on_any_devices_and_on_the_host(cfg, params):
    on_host = checksums(params)
    assert len(on_host) == len(jax.tree.leaves(params))
    layout = make_layout(cfg.mesh)
    assert layout.mesh.shape["fsdp"] == 8
    sharded = jax.device_put(params, layout.shardings(families.param_axes(cfg.model), params))
    assert checksums(sharded) == checksums(jax.device_put(params, jax.devices()[0])) == on_host
    flipped = jax.tree.map(np.copy, params)
    flipped["blocks"]["w1"].reshape(-1).view(np.uint32)[12345] ^= 1 << 7
    assert {k for k, v in checksums(flipped).items() if on_host[k] != v} == {"['blocks']['w1']"}
    moved = jax.tree.map(np.copy, params)  # the same values in other places: a position is part of the sum
    moved["embed"][[3, 4]] = moved["embed"][[4, 3]]
    assert checksums(moved)["['embed']"] != on_host["['embed']"]


def test_the_stray_tracebacks_of_failed_reads_are_gone(tmp_path, run):
    """Orbax's abandoned TensorStore reads printed 'Exception ignored in: <coroutine ...>', 'Event loop is
    closed', 'exception was never retrieved' tracebacks and 'never awaited' warnings long after a failed read;
    30 failed reads in a row printed hundreds of them. Now stderr holds what the script prints, nothing else."""
    run_dir, _ = run
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    for item in ("params", "opt_state"):
        for path in glob.glob(f"{tmp_path}/checkpoints/*/{item}/ocdbt.process_0/d/*"):
            if os.path.getsize(path) > 5000:
                data = open(path, "rb").read()
                open(path, "wb").write(data[: len(data) // 3])
    script = textwrap.dedent(f"""
        import gc, sys
        from olmax.checkpoint import Checkpointer, UnreadableCheckpoint
        from olmax.config import load_config
        from olmax.parallel.mesh import make_layout
        from olmax.train.step import abstract_state
        cfg = load_config("tiny", ["mesh.fsdp=1"])
        checkpointer = Checkpointer({str(tmp_path / "checkpoints")!r}, cfg.checkpoint, read_only=True)
        abstract = abstract_state(cfg, make_layout(cfg.mesh))
        for attempt in range(15):
            for step in checkpointer.all_steps():
                try:
                    checkpointer.restore(step, abstract)
                except UnreadableCheckpoint:
                    print("unreadable", step, file=sys.stderr)
            gc.collect()
        checkpointer.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines() == ["unreadable 5", "unreadable 10"] * 15, done.stderr[-3000:]


def test_every_reader_takes_a_run_directory_a_checkpoints_directory_or_a_step(run, caplog):
    run_dir, _ = run
    with caplog.at_level(logging.WARNING, logger="absl"):
        latest = load_olmax(run_dir)
    assert not caplog.records, "no absl warnings on a read-only open"
    for path, step in ((run_dir / "checkpoints", 10), (run_dir / "checkpoints" / "5", 5)):
        cfg, params, found = load_olmax(path)
        assert found == step and cfg.model == latest[0].model
    assert load_olmax(run_dir / "checkpoints")[1]["embed"].tobytes() == latest[1]["embed"].tobytes()
    with pytest.raises(CheckpointError, match="metadata is a file, not an olmax checkpoint; give a run directory"):
        load_olmax(run_dir / "checkpoints" / "10" / "meta" / "metadata")
    with pytest.raises(CheckpointError, match="checkpoints/7 does not exist; give a run directory"):
        load_olmax(run_dir / "checkpoints" / "7")
    with pytest.raises(CheckpointError, match="holds no olmax checkpoint of step 7"):
        load_olmax(run_dir, step=7)


def test_an_unreadable_checkpoint_is_one_error_for_every_reader(tmp_path, run, shards):
    run_dir, _ = run
    shutil.copytree(run_dir, tmp_path / "run")
    (tmp_path / "run" / "checkpoints" / "10" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(UnreadableCheckpoint, match=r"checkpoints/10 is unreadable \(JSONDecodeError.*read another "
                                                   r"step \(.*checkpoints/N\)"):
        load_olmax(tmp_path / "run")
    assert load_olmax(tmp_path / "run" / "checkpoints" / "5")[2] == 5
    with pytest.raises(UnreadableCheckpoint, match="checkpoint.init_from: .*10 is unreadable"):
        _train(tmp_path / "warm", shards, "train.steps=2", f"checkpoint.init_from={tmp_path / 'run'}")
    assert not (tmp_path / "warm").exists()
    with pytest.raises(UnreadableCheckpoint):
        Checkpointer(tmp_path / "run" / "checkpoints", CheckpointConfig(), read_only=True).read_meta(10)


def test_hf_rope_settings_olmax_does_not_implement_are_refused():
    hf = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, "eos_token_id": 0, "sliding_window": 8,
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert {kind: r.theta for kind, r in families.from_hf(hf, "ok").model.rope.items()} == \
        {"global": 1e4, "sliding": 1e4}
    for extra, named in (({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear' is not"),
                         ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not"),
                         ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported")):
        with pytest.raises(InteropError, match=named):
            families.from_hf({**hf, **extra}, "refused")
    unknown = {**hf, "rope_parameters": {kind: {**entry, "low_freq_factor": 1.0}
                                         for kind, entry in hf["rope_parameters"].items()}}
    with pytest.raises(InteropError, match="fields olmax does not implement: \\['low_freq_factor'\\]"):
        families.from_hf(unknown, "refused")
