"""Joining the cluster without OLMAX_* variables: JAX's detection (Slurm here), and the processes that must not
train alone."""

import json
import subprocess
import sys

import numpy as np
import pytest
from testlib import child_env, read_jsonl

from olmax.config import load_config
from olmax.config import ConfigError
from olmax.launch.distributed import ClusterError, join_cluster
from olmax.launch.supervisor import free_port
from olmax.train.trainer import train

CLUSTER_ENV = ("OLMAX_COORDINATOR", "OLMAX_NUM_PROCESSES", "OLMAX_PROCESS_ID", "OLMAX_LOCAL_DEVICES",
               "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID",
               "OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_ID", "JOB_COMPLETION_INDEX")


@pytest.fixture
def bare_env(monkeypatch):
    for name in CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, says", [
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
     "Slurm job 7 of 2 tasks, but not one of its srun tasks"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI rank without OMPI_MCA_orte_hnp_uri"),
    ({"TPU_WORKER_ID": "3"}, "TPU worker 3"),
    ({"JOB_COMPLETION_INDEX": "1"}, "pod 1 of an indexed Kubernetes Job"),
])
def test_a_process_of_a_job_it_cannot_join_refuses_to_train_alone(bare_env, env, says):
    for name, value in env.items():
        bare_env.setenv(name, value)
    with pytest.raises(ClusterError, match=says) as err:
        join_cluster()
    assert "OLMAX_COORDINATOR" in str(err.value) and "\n" not in str(err.value)


def test_a_cluster_variable_that_is_not_a_number_is_one_line(bare_env):
    """It was a ValueError traceback (libtpu once left TPU_WORKER_ID="WARNING: could not determine ...")."""
    bare_env.setenv("TPU_WORKER_ID", "WARNING: could not determine TPU worker number")
    with pytest.raises(ConfigError, match="TPU_WORKER_ID='WARNING: could not determine TPU worker number' must be "
                                          "an integer"):
        join_cluster()


def test_one_task_or_the_first_pod_is_a_single_process_run(bare_env):
    bare_env.setenv("SLURM_JOB_ID", "7")
    bare_env.setenv("SLURM_NTASKS", "1")
    bare_env.setenv("JOB_COMPLETION_INDEX", "0")
    assert join_cluster().kind == "single process"
    for name, value in {"SLURM_STEP_NODELIST": "node[001-004]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        bare_env.setenv(name, value)
    assert join_cluster().kind == "slurm"  # a one-task step: nothing to join


def test_train_refuses_in_a_slurm_batch_script_of_two_tasks_exit_2_one_line(tmp_path):
    env = {**child_env(1), "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0"}
    for name in ("SLURM_STEP_NODELIST", *CLUSTER_ENV[:3]):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-m", "olmax.cli", "train", "tiny", f"output_dir={tmp_path}/run"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("olmax: ClusterError: this is Slurm job 7")
    assert not (tmp_path / "run").exists()


STEPS = 6


def _overrides(shards, run_dir):
    # One row per device per micro-step: each device then holds the same rows whether the two devices are two
    # processes (process p loads columns p::2) or one process's two, so the losses are bitwise the same.
    return [f"data.paths={json.dumps(shards)}", f"output_dir={run_dir}", f"train.steps={STEPS}", "checkpoint.every=3",
            "train.micro_batch_per_device=1", "mesh.fsdp=2"]


@pytest.mark.slow
def test_two_slurm_tasks_form_one_run_equal_to_one_process(tmp_path, shards):
    """Two `olmax train` processes with the variables `srun -n2` sets and no OLMAX_*: one run."""
    run = tmp_path / "slurm"
    base = {k: v for k, v in child_env(1).items() if k not in CLUSTER_ENV}
    # JAX's Slurm coordinator is the first node of the step on a port derived from the job id, or this one.
    base |= {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "127.0.0.1",
             "JAX_COORDINATOR_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-m", "olmax.cli", "train", "tiny", *_overrides(shards, run)],
                              env={**base, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "olmax: process 0 of 2 (slurm)" in outputs[0] and "1 cpu device per process, 2 in all" in outputs[0]
    for i in range(2):
        log = (run / "logs" / f"host-0{i}.log").read_text()
        assert f"olmax: process {i} of 2 (slurm)" in log and log.rstrip().endswith("finished")
    logged = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))  # process 0 alone wrote them

    reference = train(load_config("tiny", _overrides(shards, tmp_path / "one_process")), quiet=True)
    assert [m["train/CE loss"] for m in logged] == [m["train/CE loss"] for m in reference]
    np.testing.assert_array_equal([m["optim/total grad norm"] for m in logged],
                                  [m["optim/total grad norm"] for m in reference])
