"""`olmax launch --slurm` on a two-node cluster (network namespaces on a private bridge, tests/launch/netns_cluster.py)
with the run in a bucket (moto's S3 server on the bridge address): the nodes share no directory the run writes.

One run of two nodes, one task each (gloo over the bridge addresses), survives a node dying (every process of
node 2, its slurmd included, killed in the middle of training: the job fails, the run resumes on both nodes once
node 2 is back) and then a node freezing (node 2's training process SIGSTOPped: the watchdog of node 1's process
ends the job with exit 75 naming it, the job is run again). Every step is logged once, and the losses are a
one-process run's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import numpy as np
import pytest
from netns_cluster import CONTROLLER, NODES, kill_namespace, on_node, start_moto, two_node_cluster
from test_launch_train import read_jsonl
from testlib import cpu_devices

from olmax import storage
from olmax.config import load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.launch.supervisor import latest_checkpoint_step
from olmax.train.trainer import train

STEPS, HANG_TIMEOUT = 16, 60  # a loaded 2-core machine has taken over 20 s for a step and a checkpoint
FIRST, SECOND = NODES  # olmaxnode1 (process 0, the coordinator), olmaxnode2 (process 1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The two-node cluster and the S3 server on its bridge: (cluster, the S3 variables)."""
    with two_node_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        moto, url = start_moto(cluster.scratch)
        try:
            yield cluster, {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        finally:
            moto.terminate()
            moto.wait(timeout=30)


def _on(node: str, code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(on_node(node, [sys.executable, "-c", code]), env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_each_node_resolves_the_first_node_of_the_step_and_names_a_coordinator_it_cannot_reach(cluster):
    cluster, _ = cluster
    env = {**os.environ, "SLURM_JOB_ID": "4100", "SLURM_STEP_NODELIST": "olmaxnode[1-2]", "JAX_PLATFORMS": "cpu"}
    code = ("from jax._src.clusters.slurm_cluster import SlurmCluster; "
            "from olmax.launch.distributed import coordinator_address; print(coordinator_address(SlurmCluster))")
    for node in NODES:  # the names resolve only through the nodes' hosts files
        out = _on(node, code, env)
        assert out.stdout.strip() == f"{NODES[FIRST]}:{4100 % 4096 + 61440}", out.stderr[-2000:]
    # Process 1 of a Slurm step on node 2 whose process 0 never started: the error names the address and port.
    out = _on(SECOND, "from olmax.launch.distributed import join_cluster; join_cluster()",
              {**env, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
               "OLMAX_COORDINATOR_TIMEOUT": "3"})
    assert out.returncode == 1
    assert (f"process 1 of 2 (slurm) on {SECOND} could not reach the coordinator at address {NODES[FIRST]} port "
            f"{4100 % 4096 + 61440} within 3 s") in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, parent pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _processes(node: str) -> dict[int, tuple[int, list[str]]]:
    """{pid: (parent pid, command line)} of the processes running on `node` (in its network namespace)."""
    out = {}
    for pid in subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            parent = int(_stat(int(pid))[1])
        except (FileNotFoundError, ProcessLookupError):  # it ended since
            continue
        out[int(pid)] = (parent, argv)
    return out


def _training_process(node: str) -> int | None:
    """The pid of the `olmax train` task running on `node` (Python itself, not an `srun` naming it), None if there
    is none."""
    return next((pid for pid, (_, argv) in _processes(node).items() if argv[1:4] == ["-m", "olmax.cli", "train"]),
                None)


def _checkpoint(run: str, at_least: int):
    """A condition for `_wait`: the run's latest committed step once it is `at_least` or more."""
    return lambda: (latest := latest_checkpoint_step(run)) >= at_least and latest


def _wait(what: str, condition, launcher: subprocess.Popen, timeout: float = 600, poll: float = 0.1, explain=str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}) waiting for {what}: {explain()}"
        assert time.monotonic() < deadline, f"not after {timeout} s: {what}: {explain()}"
        time.sleep(poll)
    return result


@pytest.mark.slow
def test_a_two_node_job_survives_a_dead_node_and_a_frozen_one_and_matches_one_process(cluster, tmp_path, monkeypatch,
                                                                                        capsys):
    """Cost: two nodes in network namespaces training 16 steps, a node killed and one frozen past the hang
    timeout, and the one-process reference: the waits are the watchdog's real timeouts."""
    cluster, s3 = cluster
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"]).create_bucket(Bucket="multinode")
    shards = write_synthetic_shards(tmp_path / "tokens", vocab_size=512, eos_id=0, n_tokens=60_000, n_shards=2,
                                    seed=0, token_dtype="uint16")
    remote_shards = []
    for shard in shards:  # the data in the bucket too: the nodes share no disk
        remote_shards.append(f"s3://multinode/tokens/{Path(shard).name}")
        storage.upload(Path(shard), remote_shards[-1])
    run, records = "s3://multinode/run", tmp_path / "records"
    common = [f"data.paths={json.dumps(remote_shards)}", f"train.steps={STEPS}", "train.micro_batch_per_device=1"]
    env = {**cluster.env, **s3, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_devices(1),
           "OLMAX_COORDINATOR_TIMEOUT": "120"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "olmax.cli", "launch", "--slurm", "--poll-seconds=0.5", "--retry-backoff=1",
         "--max-retries=3", "tiny", *common, f"output_dir={run}", "checkpoint.every=2", "checkpoint.keep_last=2",
         "mesh.fsdp=-1", "launch.slurm.nodes=2", "launch.slurm.tasks_per_node=1",
         f"train.hang_timeout={HANG_TIMEOUT}", f"launch.records_dir={records}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # A node dies: every process of node 2 (slurmd, slurmstepd, the task) killed once checkpoint 4 is in.
        killed_at = _wait("checkpoint 4", _checkpoint(run, 4), launcher)
        killed, died = kill_namespace(SECOND), time.monotonic()
        assert killed and cluster.slurmd[SECOND].wait(timeout=30) == -signal.SIGKILL
        # Node 2 comes back once Slurm took it for down (its job failed or requeued); the run resumes on both.
        _wait("node 2 down", lambda: "down" in cluster.node_states()[SECOND], launcher, timeout=120)
        cluster.start_slurmd(SECOND)
        resumed_at = _wait("a checkpoint after the resume", _checkpoint(run, killed_at + 1), launcher)
        resumed = time.monotonic() - died

        # A node freezes: node 2's training process SIGSTOPped in the middle of training, after the resume (found
        # at once, while it surely runs; stopped two checkpoints later).
        frozen_pid = _wait("node 2's training process", lambda: _training_process(SECOND), launcher, timeout=60)
        _wait(f"checkpoint {resumed_at + 2}", _checkpoint(run, resumed_at + 2), launcher)
        os.kill(frozen_pid, signal.SIGSTOP)
        froze = time.monotonic()
        _wait("the training process to stop", lambda: _stat(frozen_pid)[0] == "T", launcher, timeout=10)
        running = {node: _processes(node) for node in NODES}
        outputs = lambda: "".join(p.read_text() for p in (records / "slurm").glob("*.out"))  # noqa: E731
        _wait("the watchdog's line", lambda: "olmax: watchdog:" in outputs(), launcher, timeout=600, poll=0.05,
              # the timeout grows with the slowest step (synchronous bucket saves)
              explain=lambda: f"{frozen_pid} frozen of {running}\n{outputs()[-6000:]}")
        detected = time.monotonic() - froze
        output = launcher.communicate(timeout=900)[0]
    finally:
        launcher.kill()
    jobs = outputs()
    assert launcher.returncode == 0, f"{output}\n{jobs[-6000:]}"
    # Process 0's watchdog speaks. Slurm ends the step with SIGCONT before SIGTERM, so the frozen process may run
    # again for a moment and its own watchdog speak too (no step for a minute, its coordinator gone): exit 75.
    lines = [x for x in jobs.splitlines() if x.startswith("olmax: watchdog:")]
    first = [x for x in lines if x.startswith("olmax: watchdog: process 0 of 2 finished no step for ")]
    assert len(first) == 1, lines
    line = first[0]
    assert f"process 1 on {SECOND} stopped making progress" in line and "exiting 75" in line, line
    assert all(x.startswith("olmax: watchdog: process 1 of 2 finished no step for ") and "process 0 (the coordinator) "
               "did not answer" in x and "exiting 75" in x for x in lines if x != line), lines

    attempts = read_jsonl(records / "launch.jsonl")
    assert len(attempts) == 3 and attempts[-1]["reason"] == "finished", attempts
    dead, frozen = attempts[:2]
    assert dead["checkpoint_before"] == 0 and dead["checkpoint_after"] >= 4, dead
    # Process 0 exits 75; process 1, its coordinator gone, aborts (JAX) or exits 75 (its watchdog): srun's code is the
    # larger, so the script requeues the job when process 1 was ended first or exited 75, else the launcher submits it
    # again.
    assert frozen["reason"] in ("requeued", "crashed (exit 134)"), frozen
    assert frozen["checkpoint_after"] > frozen["checkpoint_before"], frozen
    assert jobs.count("olmax: process 0 of 2 (slurm) on olmaxnode1") == 3, jobs[-6000:]

    logged = [json.loads(line) for line in storage.read_bytes(storage.join(run, "metrics.jsonl")).splitlines()]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    reference = train(load_config("tiny", [*common, "mesh.fsdp=2", f"output_dir={tmp_path / 'one_process'}"]),
                      quiet=True)
    np.testing.assert_allclose([m["train/CE loss"] for m in logged], [m["train/CE loss"] for m in reference],
                               rtol=3e-7, atol=0)
    with capsys.disabled():
        print(f"\ntwo nodes ({', '.join(f'{n} {a}' for n, a in NODES.items())}, controller and S3 on "
              f"{CONTROLLER[1]}): node 2 killed after checkpoint {killed_at} ({len(killed)} processes), a checkpoint "
              f"after the resume {resumed:.1f} s later (checkpoint {resumed_at}); node 2's training process frozen, "
              f"the watchdog (train.hang_timeout={HANG_TIMEOUT}) spoke after {detected:.1f} s:\n{line}\n"
              + "".join(f"attempt {a['attempt']}: job {a['job_id']} run {a['job_run']} {a['reason']}, checkpoint "
                        f"{a['checkpoint_before']} -> {a['checkpoint_after']} in {a['seconds']:.0f} s; {a['action']}\n"
                        for a in attempts), end="")
