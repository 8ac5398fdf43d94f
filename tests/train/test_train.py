import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from olmax.config import ConfigError, load_config
from olmax.train.trainer import train

METRIC_NAMES = {
    "train/CE loss", "train/Z loss", "optim/total grad norm", "optim/LR (group 0)", "optim/step skipped",
    "throughput/total tokens", "throughput/device/TPS", "throughput/device/MFU", "train/masked instances (%)",
    "io/retries",
}


def _cfg(tmp_path, shards, name, *overrides):
    return load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path}/{name}",
                                "mesh.fsdp=1", *overrides])


def _losses(history):
    return [h["train/CE loss"] for h in history]


def test_resumed_run_matches_continuous_run_bitwise(tmp_path, shards):
    continuous = train(_cfg(tmp_path, shards, "a", "train.steps=8", "checkpoint.every=4"), quiet=True)
    first = train(_cfg(tmp_path, shards, "b", "train.steps=8", "train.stop_after=4", "checkpoint.every=4"),
                  quiet=True)
    resumed = train(_cfg(tmp_path, shards, "b", "train.steps=8", "checkpoint.every=4"), quiet=True)
    assert [h["step"] for h in resumed] == list(range(5, 9)), "checkpoint 4 resumes at step 5"
    assert _losses(first + resumed) == _losses(continuous)
    logged = [json.loads(line) for line in Path(tmp_path, "b", "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, 9))
    assert METRIC_NAMES <= set(logged[1])
    # The first step of each attempt compiled the train step: marked, with no throughput nor MFU (its time is
    # mostly the compile's); the others have them and no mark.
    compiled = [m["step"] for m in logged if m.get("throughput/step compiled") == 1]
    assert compiled == [1, 5] and [m["step"] for m in logged if "throughput/device/TPS" not in m] == compiled
    assert not any("throughput/device/MFU" in m for m in logged if m["step"] in compiled)
    assert list(Path(tmp_path, "b", "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(int(p.name) for p in Path(tmp_path, "b", "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]


@pytest.mark.slow
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
    with pytest.raises(ConfigError, match=r"train.global_batch_instances 16 must be divisible by data-parallel size 8 "
                                          r"x train.micro_batch_per_device 3 = 24;"):
        train(_cfg(tmp_path, shards, "bad", "mesh.fsdp=8", "train.micro_batch_per_device=3"), quiet=True)
    with pytest.raises(ConfigError, match=r"train.global_batch_instances 12 must be divisible by the data-parallel "
                                          r"size 8 \(mesh data x fsdp x expert\); change the global batch or the mesh"):
        train(_cfg(tmp_path, shards, "bad", "mesh.fsdp=8", "train.global_batch_instances=12"), quiet=True)
    assert not Path(tmp_path, "bad").exists()


def test_a_run_whose_parameters_become_infinite_stops_without_writing_them(tmp_path, synth_mix, capsys):
    """1e39 is a finite float, but infinite as the float32 learning rate: step 1 makes the parameters infinite."""
    from olmax.cli import main
    from olmax.errors import ExitCode

    run = tmp_path / "run"
    code = main(["train", "tiny", "mesh.fsdp=1", "train.steps=6", "checkpoint.every=1", "optim.lr=1e39",
                 "schedule.warmup_steps=0", f"data.mix_file={synth_mix}", f"output_dir={run}"])
    err = capsys.readouterr().err
    assert code == ExitCode.DIVERGED and code not in (0, 1, 2, 75), err
    assert "the run diverged: the parameters are NaN or infinite (checked before writing checkpoint 1)" in err
    assert "lower optim.lr" in err.lower() and "Traceback" not in err
    assert not list((run / "checkpoints").glob("[0-9]*"))
    # Without a checkpoint due, the first loss that is not finite finds it (step 2's, on step 1's parameters).
    code = main(["train", "tiny", "mesh.fsdp=1", "train.steps=6", "checkpoint.every=6", "optim.lr=1e39",
                 "schedule.warmup_steps=0", f"data.mix_file={synth_mix}", f"output_dir={tmp_path}/run2"])
    assert code == ExitCode.DIVERGED and "(train/CE loss nan at step 2)" in capsys.readouterr().err


def test_the_run_compiles_its_step_with_its_targets_flag_profile(tmp_path, synth_mix, monkeypatch):
    """`olmax train` gives its step's compile the flag profile of the target its devices make (`olmax compile`
    predicted the program compiled with it): a flag the compiler does not know fails the run."""
    from olmax.cli import main
    from olmax.scale import targets

    import jax

    monkeypatch.setattr(targets, "flag_profile", lambda target: {"xla_no_such_flag": True})
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_flag"):
        main(["train", "tiny", "mesh.fsdp=1", "train.steps=1", "model.n_layers=1", "model.layer_pattern=[global]",
              f"data.mix_file={synth_mix}", f"output_dir={tmp_path}/run"])


def test_a_head_gradient_in_the_compute_dtype_of_a_float32_run_is_said_to_change_nothing(tmp_path, synth_mix,
                                                                                          caplog):
    """`impl.logits_grad=compute` where the compute dtype is float32 changed nothing and said nothing: with
    compute_dtype float32 it is refused; with auto on CPUs (float32) the run says so."""
    from olmax.cli import main
    from olmax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="logits_grad=compute takes the LM head's gradient in the compute dtype, "
                       "and compute_dtype is float32: it would change nothing"):
        load_config("tiny", ["impl.logits_grad=compute", "impl.compute_dtype=float32"])
    assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=1", "model.n_layers=1", "model.layer_pattern=[global]",
                 "impl.logits_grad=compute", f"data.mix_file={synth_mix}", f"output_dir={tmp_path}/run"]) == 0
    assert [r.getMessage() for r in caplog.records if "logits_grad" in r.getMessage()] == [
        "impl.logits_grad=compute takes the LM head's gradient in the compute dtype, float32 on these devices "
        "(impl.compute_dtype auto): it changes nothing here"]


@pytest.mark.parametrize("name, make", [("checkpoints", Path.touch), ("tensorboard", Path.touch),
                                        ("metrics.jsonl", Path.mkdir)])
def test_an_output_path_taken_by_the_wrong_kind_is_refused_before_training(tmp_path, synth_mix, capsys, name, make):
    from olmax.cli import main

    (tmp_path / "run").mkdir()
    make(tmp_path / "run" / name)
    assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", f"data.mix_file={synth_mix}",
                 f"output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{tmp_path}/run/{name} is a " in err and "set another output_dir" in err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [name]


def test_a_read_only_output_dir_is_refused_before_training(tmp_path, synth_mix, capsys):
    from olmax.cli import main

    mount = tmp_path / "ro"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                                                  check=False).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        for run in (mount, mount / "run"):  # the directory itself, and one to be made in it
            assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", f"data.mix_file={synth_mix}",
                         f"output_dir={run}"]) == 2
            err = capsys.readouterr().err
            assert len(err.splitlines()) == 1 and f"output_dir {run}: {mount} is not writable" in err, err
            assert "set another output_dir" in err
    finally:
        subprocess.run(["umount", str(mount)], check=True)
