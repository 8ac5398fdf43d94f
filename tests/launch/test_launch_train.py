"""`olmax launch` over real training: a child killed mid-run is restarted and the run completes."""

import json
import os
import signal

import pytest

from olmax.launch.supervisor import Backoff, Supervisor
from testlib import child_env, read_jsonl, signal_once_after_checkpoint, tensorboard_steps


@pytest.mark.slow
def test_a_training_child_killed_mid_run_is_restarted_and_finishes(tmp_path, shards):
    run = tmp_path / "run"
    overrides = [f"data.paths={json.dumps(shards)}", f"output_dir={run}", "train.steps=12", "checkpoint.every=3",
                 "mesh.fsdp=-1"]
    sleeps = []
    supervisor = Supervisor("tiny", overrides, backoff=Backoff(0.1, 2, 1), max_retries=2, sleep=sleeps.append,
                            env=child_env(1), on_start=signal_once_after_checkpoint(run, 3, signal.SIGKILL))
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
                            env=child_env(1), on_start=try_to_take_it)
    assert supervisor.run() == 0 and len(refused) == 1
    assert [r["reason"] for r in read_jsonl(run / "launch.jsonl")] == ["finished"]
    with hold(run):  # released with the launch
        pass
