"""`olmax launch` over real training: a child killed mid-run is restarted and the run completes."""

import json
import os
import signal
from pathlib import Path

import pytest
from olmax.eval.curves import read_events

from olmax.data.synthetic import write_synthetic_shards
from olmax.launch.supervisor import Backoff, Supervisor
from testlib import child_env, signal_once_when


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_synthetic_shards(tmp_path_factory.mktemp("shards"), vocab_size=512, eos_id=0, n_tokens=200_000,
                                  n_shards=2, seed=0, token_dtype="uint16")


def signal_once_after_checkpoint(run_dir: Path, step: int, sig: int, process: int = 0):
    """An on_start hook: in the first attempt, send `sig` to `process` as soon as checkpoint `step` is committed."""
    return signal_once_when(lambda: (run_dir / "checkpoints" / str(step)).is_dir(), sig, process)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tensorboard_steps(log_dir: Path, tag: str = "train/CE loss") -> list[int]:
    """The steps of `tag` as TensorBoard shows them (a resume's purge marker drops later steps of earlier files)."""
    return sorted(read_events(log_dir).get(tag, {}))


@pytest.mark.slow
def test_a_training_child_killed_mid_run_is_restarted_and_finishes(tmp_path, shards):
    run = tmp_path / "run"
    overrides = [f"data.paths={json.dumps(shards)}", f"output_dir={run}", "train.steps=12", "checkpoint.every=3",
                 "mesh.fsdp=-1"]
    sleeps = []
    supervisor = Supervisor("tiny", overrides, backoff=Backoff(0.1, 2, 1), max_retries=2, sleep=sleeps.append,
                            env=child_env(tmp_path / "jax-cache", 1), on_start=signal_once_after_checkpoint(run, 3, signal.SIGKILL))
    assert supervisor.run() == 0
    first, second = read_jsonl(run / "launch.jsonl")
    assert first["reason"] == "killed by SIGKILL" and 3 <= first["checkpoint_after"] < 12
    assert second["reason"] == "finished" and second["checkpoint_after"] == 12
    assert sleeps == [0.1]
    # Both metric streams hold every step once: the steps up to the checkpoint were on disk before it existed.
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 13))
    assert tensorboard_steps(run / "tensorboard") == list(range(1, 13))


def test_the_launcher_holds_the_run_directory_and_its_trainer_runs_under_it(tmp_path, synth_mix):
    from olmax.run_lock import RunDirError, hold

    run = tmp_path / "run"
    refused = []

    def try_to_take_it(procs):
        with pytest.raises(RunDirError, match=f"PID {os.getpid()}\\b") as err, hold(run):
            pass
        refused.append(str(err.value))

    supervisor = Supervisor("tiny", [f"data.mix_file={synth_mix}", f"output_dir={run}", "train.steps=2",
                                     "checkpoint.every=2", "mesh.fsdp=-1"],
                            env=child_env(tmp_path / "jax-cache", 1), on_start=try_to_take_it)
    assert supervisor.run() == 0 and len(refused) == 1
    assert [r["reason"] for r in read_jsonl(run / "launch.jsonl")] == ["finished"]
    with hold(run):  # released with the launch
        pass
