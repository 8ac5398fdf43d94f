"""Multi-process training: 2 processes x 2 CPU devices (jax.distributed, gloo on 127.0.0.1) under `olmax launch`.

After a checkpoint one process (only) gets SIGTERM, as when a scheduler's notices arrive at different
steps: both must stop after the same step, checkpoint and exit 75; the launcher restarts the group at once
and it resumes. The losses must equal a single-process run on 4 devices of the same config: the global
batch is the same whatever the process count, each process having loaded only its columns of it.
"""

import json
import signal
import sys

import numpy as np
import pytest

from olmax.config import ConfigError, load_config
from olmax.launch.distributed import ClusterError, join_cluster
from olmax.launch.supervisor import Backoff, Supervisor
from olmax.train.trainer import train
from testlib import child_env, read_jsonl, signal_once_after_checkpoint, tensorboard_steps

# `olmax train` joining the run its OLMAX_* variables describe. (Calling join_cluster is harmless when
# `olmax train` calls it too.)
TRAIN_COMMAND = (sys.executable, "-c", "import sys; from olmax.launch.distributed import join_cluster; "
                 "join_cluster(); from olmax.cli import main; sys.exit(main())", "train")
STEPS = 12


def _overrides(shards, run_dir):
    return [f"data.paths={json.dumps(shards)}", f"output_dir={run_dir}", f"train.steps={STEPS}", "checkpoint.every=3"]


@pytest.mark.slow
def test_two_processes_preempt_together_resume_and_match_one_process(tmp_path, shards):
    """Cost: two jax.distributed processes trained, preempted and resumed, and the one-process reference."""
    run = tmp_path / "two_processes"
    env = child_env(2, OLMAX_LOCAL_DEVICES="2")
    sleeps = []
    supervisor = Supervisor("tiny", [*_overrides(shards, run), "mesh.fsdp=-1"], nprocs=2, command=TRAIN_COMMAND,
                            env=env, backoff=Backoff(0.1, 2, 1), max_retries=1, sleep=sleeps.append,
                            on_start=signal_once_after_checkpoint(run, 3, signal.SIGTERM, process=1))
    assert supervisor.run() == 0
    first, second = read_jsonl(run / "launch.jsonl")
    assert first["exit_codes"] == [75, 75], "both processes stop after the same step (else they hang)"
    assert 3 < first["checkpoint_after"] < STEPS and first["action"] == "restart now"
    assert sleeps == []
    assert second["exit_codes"] == [0, 0] and second["checkpoint_after"] == STEPS
    # Process 0 alone writes metrics: every step once.
    logged = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert tensorboard_steps(run / "tensorboard") == list(range(1, STEPS + 1))

    # The same run in this process on 4 of its 8 devices (one process, same mesh shape).
    reference = train(load_config("tiny", [*_overrides(shards, tmp_path / "one_process"), "mesh.fsdp=4"]), quiet=True)
    two, one = (np.array([m["train/CE loss"] for m in ms]) for ms in (logged, reference))
    # Not bitwise: a device holds other rows of the same global batch (process p loads columns p::2, one
    # process's devices take contiguous rows), so the partial sums and the all-reduce (gloo) round differently.
    np.testing.assert_allclose(two, one, rtol=3e-7, atol=0)
    norms = [np.array([m["optim/total grad norm"] for m in ms]) for ms in (logged, reference)]
    np.testing.assert_allclose(*norms, rtol=1e-5)


def test_join_cluster_is_single_process_without_the_variables_and_refuses_half_of_them(monkeypatch):
    for name in ("OLMAX_COORDINATOR", "OLMAX_PROCESS_ID", "OLMAX_NUM_PROCESSES", "OLMAX_LOCAL_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    assert join_cluster().kind == "single process"
    monkeypatch.setenv("OLMAX_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("OLMAX_PROCESS_ID", "2")
    with pytest.raises(ClusterError, match="OLMAX_NUM_PROCESSES"):
        join_cluster()
    monkeypatch.setenv("OLMAX_NUM_PROCESSES", "2")
    with pytest.raises(ClusterError, match="OLMAX_PROCESS_ID=2 must be below"):
        join_cluster()
    monkeypatch.setenv("OLMAX_LOCAL_DEVICES", "none")
    with pytest.raises(ConfigError, match="OLMAX_LOCAL_DEVICES='none' must be an integer >= 1"):
        join_cluster()
