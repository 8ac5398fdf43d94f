"""`olmax launch --slurm` on a real one-node Slurm (slurmctld + slurmd + munged on 127.0.0.1, 2 CPUs).

The session fixture installs Debian's slurm-wlm and munge when slurmctld is missing (as root, as on a fresh CI
machine), writes a slurm.conf into a scratch directory and starts the daemons as children of this process; they
are stopped at the end, whatever happened. Without root the real-Slurm tests are skipped, saying so.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from testlib import apt_install, cpu_devices, read_jsonl

from olmax.cli import main
from olmax.config import load_config
from olmax.launch.slurm import batch_script
from olmax.launch.supervisor import free_port
from olmax.train.trainer import train

SLURM_CONF = """\
ClusterName=olmaxtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Slurm holds a requeued job back until the old run's credential expires (cred_expire, 120 s by default).
AuthInfo=socket={scratch}/munge.socket,cred_expire=10
StateSaveLocation={scratch}/state
SlurmdSpoolDir={scratch}/spool
SlurmctldPidFile={scratch}/slurmctld.pid
SlurmdPidFile={scratch}/slurmd.pid
SlurmctldLogFile={scratch}/slurmctld.log
SlurmdLogFile={scratch}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# The tasks checkpoint between SIGTERM and SIGKILL.
KillWait=120
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
DAEMON_START_SECONDS = 120


def wait_for(what: str, ready, daemons: list, logs: list, timeout: float = DAEMON_START_SECONDS):
    deadline = time.monotonic() + timeout
    while not (result := ready()):
        dead = [d.args[0] for d in daemons if d.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text()[-1500:] if p.exists() else '(none)'}" for p in logs)
            pytest.fail(f"{what}: " + (f"{dead} exited" if dead else f"not after {timeout} s") + f"\n{tails}")
        time.sleep(0.1)
    return result


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) of a running one-node Slurm cluster."""
    if os.geteuid() != 0:
        pytest.skip("the real-Slurm tests install slurm-wlm and run its daemons as root; this process is not root")
    if shutil.which("slurmctld") is None:
        apt_install("slurm-wlm", "munge")
    scratch = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool"):
        (scratch / d).mkdir()
    key = scratch / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = scratch / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], scratch=scratch,
                                      ctld_port=free_port(), d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    logs = [scratch / "munged.log", scratch / "slurmctld.log", scratch / "slurmd.log"]
    daemons = []
    try:
        # In the foreground (-F, -D): children of this process, stopped by their own pids below.
        daemons.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={scratch}/munge.socket", f"--key-file={key}",
             f"--pid-file={scratch}/munged.pid", f"--log-file={logs[0]}", f"--seed-file={scratch}/munge.seed"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for("munged", lambda: (scratch / "munge.socket").exists(), daemons, logs)
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))

        def idle():
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            return out.stdout.strip() == "idle"
        wait_for("the Slurm node to be idle", idle, daemons, logs)
        yield env
    finally:
        if len(daemons) == 3:  # no job outlives the cluster (slurmstepd would keep its tasks running)
            subprocess.run(["scancel", "--full", "--partition=test"], env=env, capture_output=True, timeout=60)
            deadline = time.monotonic() + 180
            while subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True,
                                 timeout=60).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def test_the_batch_script_asks_for_requeue_a_warning_signal_and_one_srun_task_per_process(tmp_path):
    overrides = [f"output_dir={tmp_path}/run", "launch.slurm.nodes=4", "launch.slurm.tasks_per_node=8",
                 "launch.slurm.gpus_per_task=1", 'launch.slurm.time="2-00:00:00"', "launch.slurm.partition=gpu",
                 "launch.slurm.account=lab", 'launch.slurm.sbatch_lines=["--qos=high", "--exclusive"]']
    script = batch_script(load_config("olmo3_7b", overrides), "olmo3_7b", overrides, python="/venv/bin/python")
    options = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert options == ["--job-name=olmo3_7b_stage1", "--nodes=4", "--ntasks-per-node=8", "--gpus-per-task=1",
                       "--time=2-00:00:00", "--partition=gpu", "--account=lab", "--requeue", "--signal=TERM@300",
                       "--open-mode=append", f"--output={tmp_path}/run/slurm/%j.out", "--qos=high", "--exclusive"]
    assert "export JAX_LOCAL_DEVICE_IDS=0\n" in script
    assert "\nsrun --kill-on-bad-exit=1 /venv/bin/python -m olmax.cli train olmo3_7b output_dir=" in script
    assert 'if [ "$code" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi\nexit "$code"\n' in script


DATA = 'data.paths=["gs://tokens/part-0.npy"]'  # a preview refuses a config without data, as train does


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys):
    assert main(["launch", "slurm", "--dry-run", "tiny", f"output_dir={tmp_path}/run", DATA,
                 "launch.slurm.tasks_per_node=2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --ntasks-per-node=2\n" in out and "\nsrun " in out
    assert not (tmp_path / "run").exists()
    assert main(["launch", "--slurm", "--nprocs", "2", "tiny"]) == 2
    assert "drop --nprocs" in capsys.readouterr().err
    assert main(["launch", "slurm", "tiny", "launch.slurm.time=1:00:00"]) == 2
    assert 'quote the time limit ("1:00:00")' in capsys.readouterr().err


def test_the_old_spelling_prints_the_same_script_and_one_line_saying_so(tmp_path, capsys):
    run = [f"output_dir={tmp_path}/run", DATA, "launch.slurm.tasks_per_node=2"]
    assert main(["launch", "slurm", "--dry-run", "tiny", *run]) == 0
    new = capsys.readouterr()
    assert main(["launch", "--slurm", "--dry-run", "tiny", *run]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and new.err == ""
    assert old.err.splitlines() == ["olmax: --slurm is the old spelling, kept for one release: write `olmax launch "
                                    "slurm ...` (olmax launch --help)"]


STEPS, STOP_AFTER = 20, 16  # signalled at checkpoint 4: 12 steps before the stop, room for a loaded machine


def _overrides(shards, run_dir, *more):
    # One row per device per micro-step: two processes of one device each then hold the same rows as one
    # process's two devices, so the losses are bitwise those of the one-process run.
    return [f"data.paths={json.dumps(shards)}", f"output_dir={run_dir}", f"train.steps={STEPS}", "checkpoint.every=1",
            "checkpoint.keep_last=2", "train.micro_batch_per_device=1", *more]


def _launch(env, run, shards, tasks, *more):
    return subprocess.Popen(
        [sys.executable, "-m", "olmax.cli", "launch", "slurm", "--poll-seconds=0.2", "--retry-backoff=1",
         "--max-retries=1", "tiny", *_overrides(shards, run, f"launch.slurm.tasks_per_node={tasks}", *more)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _squeue(env) -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()


@pytest.mark.slow
def test_slurm_job_signalled_midway_is_requeued_resumes_then_continues_on_one_task(slurm, tmp_path, shards, capsys):
    """Cost: a real slurmctld/slurmd, the job trained, signalled, requeued and resumed: three trainings of the
    tiny model in Slurm's processes."""
    run = tmp_path / "run"
    # Every task one CPU device; the compilation cache of the session (conftest) is shared with the tasks.
    env = {**slurm, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_devices(1)}

    # 2 tasks to step 20; SIGTERM to the tasks (as before the time limit) once checkpoint 4 is written.
    launcher = _launch(env, run, shards, 2, "mesh.fsdp=-1", f"train.stop_after={STOP_AFTER}")
    try:
        deadline = time.monotonic() + 600
        while not (run / "checkpoints" / "4").is_dir():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
            time.sleep(0.02)
        [job] = _squeue(env)
        subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True)
        first_output = launcher.communicate(timeout=900)[0]
    finally:
        launcher.kill()
    records = read_jsonl(run / "launch.jsonl")
    jobs = "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run / "slurm").glob("*.out")))
    assert launcher.returncode == 0 and len(records) == 2, f"{first_output}\n{jobs}"
    first, second = records
    assert first["job_id"] == second["job_id"] == job, f"{records}\n{first_output}\n{jobs}"  # requeued: the same job
    assert (first["job_run"], first["reason"], first["action"]) == (1, "requeued", "run again now")
    assert 4 <= first["checkpoint_after"] < STOP_AFTER
    assert (second["job_run"], second["reason"], second["checkpoint_after"]) == (2, "finished", STOP_AFTER)
    # while the requeued job waits (Slurm holds it until the old run's credential expires), the launcher says so
    waiting = f"olmax launch: Slurm job {job} run 2: PENDING ("
    assert f"{waiting}" in first_output and "; last committed step " in first_output.split(waiting, 1)[1], first_output
    assert all(r["launcher"] == "slurm" and r["exit_codes"] == [r["exit_code"]] for r in records)
    job_output = (run / "slurm" / f"{job}.out").read_text()
    assert job_output.count("olmax: process 0 of 2 (slurm)") == 2, job_output
    assert (run / "logs" / "host-01.log").read_text().count("olmax: process 1 of 2 (slurm)") == 2

    # Elastic: the same run continued by a job of 1 task (2 devices: same global batch, other process count).
    launcher = _launch({**env, "OLMAX_LOCAL_DEVICES": "2"}, run, shards, 1)
    try:
        second_output = launcher.communicate(timeout=900)[0]
    finally:
        launcher.kill()
    assert launcher.returncode == 0, second_output
    third = read_jsonl(run / "launch.jsonl")[2]
    assert third["job_id"] != job and (third["reason"], third["checkpoint_before"], third["checkpoint_after"]) == (
        "finished", STOP_AFTER, STEPS)
    assert "olmax: process 0 of 1 (slurm)" in (run / "slurm" / f"{third['job_id']}.out").read_text()
    with capsys.disabled():
        print(f"\nSlurm job {job} (2 tasks) signalled at checkpoint 4 of the run, requeued as job {second['job_id']} "
              f"(run {second['job_run']}), finished step {STOP_AFTER}; job {third['job_id']} (1 task) finished step "
              f"{STEPS}:\n{first_output}{second_output}", end="")

    logged = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    reference = train(load_config("tiny", _overrides(shards, tmp_path / "one_process", "mesh.fsdp=2")), quiet=True)
    assert [m["train/CE loss"] for m in logged] == [m["train/CE loss"] for m in reference]
