"""`olmax launch slurm`: the run as a Slurm batch job, submitted again until it is done.

The batch script (written to RECORDS/slurm/job.sh, RECORDS being the run directory, or
launch.records_dir; runs/s3/BUCKET/PATH here for a run in a bucket) starts one `srun` task per process;
each task is an `olmax train` that joins the others through JAX's Slurm detection. The
job asks for `--requeue` and a SIGTERM `signal_seconds` before its time limit: on that
signal, or a preemption's, every task checkpoints after the same step and exits 75, and
the script requeues the job (same job id), which resumes from that checkpoint.

This launcher submits the script with `sbatch` and watches the job with `scontrol`. Each
run of the job (the first and every requeued one) is an attempt, judged as local
launches judge theirs (olmax.launch.supervisor.RetryPolicy): a requeue that advanced the
latest checkpoint runs again as soon as Slurm lets it (it holds a requeued job back until
the old run's credential expires, 2 minutes by default); one that did not is a failure and
is held back for the backoff too (`scontrol update StartTime`); a job that ends without finishing the run is
submitted again after the backoff; bad input (exit 2) never is. Every attempt goes to
RECORDS/launch.jsonl with its job id. While the job waits or runs, the launcher says its state
and the run's last committed step when the state changes, and every `status_seconds` while it
does not. SIGTERM/SIGINT to the launcher cancel the job (its tasks checkpoint within Slurm's
KillWait) and the launcher exits 75.

Every value the script takes from the config is checked first (olmax.launch.values): a name,
partition, time or sbatch line that would change what the script runs is exit 2.
"""

from __future__ import annotations

import datetime
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from olmax.config import RunConfig
from olmax.errors import ExitCode, SlurmError
from olmax.launch import values
from olmax.launch.launcher import Attempt, Launcher, exit_reason, latest_checkpoint_step, launch_dir
from olmax.run_dir import RunDir, own_dir, replace_own

# Job states after which Slurm will not run the job again by itself (a requeued job goes back to PENDING).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT"}
POLL_SECONDS = 30.0
STATUS_SECONDS = 600.0


def batch_script(cfg: RunConfig, config: str, overrides: list[str], python: str = sys.executable) -> str:
    """The job script of `olmax train config overrides` (`python` on the nodes), every value from the config
    checked (exit 2 for one that is not a plain word or in Slurm's format)."""
    slurm = cfg.launch.slurm
    name = values.plain("name", cfg.name)
    records = launch_dir(cfg).resolve()
    output = values.plain("output_dir (or launch.records_dir)", str(RunDir(records).slurm_output("%j")))
    if "%" in str(records):
        values.refuse("output_dir (or launch.records_dir)", str(records), "sbatch reads '%' in --output as a pattern")
    options = [f"--job-name={name}", f"--nodes={slurm.nodes}",
               f"--ntasks-per-node={slurm.tasks_per_node}"]
    options += [f"--gpus-per-task={slurm.gpus_per_task}"] if slurm.gpus_per_task else []
    options += [f"--time={values.slurm_time(slurm.time)}"] if slurm.time else []
    options += [f"--{key}={values.slurm_name(f'launch.slurm.{key}', getattr(slurm, key))}"
                for key in ("partition", "account") if getattr(slurm, key)]
    options += ["--requeue", f"--signal=TERM@{slurm.signal_seconds}", "--open-mode=append", f"--output={output}",
                *map(values.sbatch_option, slurm.sbatch_lines)]
    lines = ["#!/bin/bash", "# Written by `olmax launch slurm`, which submits it with sbatch and watches the job.",
             *(f"#SBATCH {option}" for option in options)]
    if slurm.gpus_per_task:
        lines += ["# Each task sees its own GPUs as 0..G-1; JAX would otherwise take only the one numbered SLURM_LOCALID.",
                  f"export JAX_LOCAL_DEVICE_IDS={','.join(str(i) for i in range(slurm.gpus_per_task))}"]
    lines += [
        "# One task per process; they join one run through JAX's Slurm detection. A task that exits non-zero",
        "# (a crash, or 75 from the watchdog when a peer froze) ends the others, which would wait for it for ever.",
        f"srun --kill-on-bad-exit=1 {shlex.join([python, '-m', 'olmax.cli', 'train', config, *overrides])}",
        "code=$?",
        f"# {ExitCode.PREEMPTED:d}: every task checkpointed after a SIGTERM (the time limit is near, or a preemption): "
        "run again.",
        f'if [ "$code" -eq {ExitCode.PREEMPTED:d} ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def script_path(records: Path) -> Path:
    return RunDir(records).slurm_script


def _slurm(*argv: str) -> subprocess.CompletedProcess:
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"`{argv[0]}` is not on PATH: run `olmax launch slurm` where Slurm's commands are "
                         "(a login node of the cluster)")
    return subprocess.run(argv, capture_output=True, text=True)


def job_info(job_id: str) -> dict[str, str] | None:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); None once Slurm has forgotten the job.
    When slurmctld does not answer, the state is UNKNOWN: the job may well be running, so it is asked again."""
    out = _slurm("scontrol", "show", "job", "--oneliner", job_id)
    if out.returncode != 0:
        return None if "Invalid job id" in out.stderr else {"JobState": "UNKNOWN"}
    return dict(field.split("=", 1) for field in out.stdout.split() if "=" in field)


def _exit_code(info: dict[str, str] | None) -> tuple[int, str]:
    """(the job script's exit code as the supervisor reads a child's, the outcome in words)."""
    if info is None:
        return ExitCode.FAILED, "unknown (Slurm no longer knows the job)"
    state = info["JobState"]
    status, sig = (int(x) for x in info.get("ExitCode", "0:0").split(":"))
    code = -sig if sig else status
    if state == "COMPLETED":
        return ExitCode.FINISHED, ExitCode.FINISHED.words
    if state == "FAILED":
        return code, exit_reason(code)
    return (code or ExitCode.FAILED), state.lower().replace("_", " ")  # timeout, node fail, cancelled, ...


def _eligible(info: dict[str, str]) -> datetime.datetime:
    """When a pending job may start (`EligibleTime`, local time), or now when Slurm does not say."""
    try:
        return datetime.datetime.fromisoformat(info.get("EligibleTime", ""))
    except ValueError:
        return datetime.datetime.now()


class SlurmLauncher(Launcher):
    """Submits `config overrides` as a Slurm job and watches it until the run finishes (see the module's doc)."""

    mode = "slurm"

    def __init__(self, config: str, overrides: list[str] = (), *, poll: float = POLL_SECONDS,
                 status_seconds: float = STATUS_SECONDS, python: str = sys.executable, **launcher):
        super().__init__(config, overrides, **launcher)
        self.script = batch_script(self.cfg, config, self.overrides, python)
        self.processes = self.cfg.launch.slurm.nodes * self.cfg.launch.slurm.tasks_per_node
        self.poll, self.status_seconds = poll, status_seconds
        self._job: str | None = None

    def render(self) -> str:
        return self.script

    def path_warning(self, field: str, path: str) -> str | None:
        if field == "output_dir" or Path(path).exists():
            return None  # the run directory is made where it is missing
        return (f"{field} {path} is not on this machine: the job's nodes must all see it at that path (a shared "
                "filesystem), or give a bucket URL")

    def submit(self) -> str:
        path = script_path(self.records)
        own_dir(path.parent)
        replace_own(path, self.script)
        out = _slurm("sbatch", "--parsable", str(path))
        if out.returncode != 0:
            error = (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}").splitlines()[-1]
            raise SlurmError(f"sbatch refused {path}: {error}; fix launch.slurm in the config")
        self._job = out.stdout.strip().split(";")[0]
        self.echo(f"olmax launch: submitted Slurm job {self._job} ({path}); its output goes to "
                  f"{RunDir(self.records).slurm_output(self._job)}")
        return self._job

    def stop(self, sig: int, again: bool) -> None:
        if not again and self._job is not None:
            self.echo(f"olmax launch: {signal.Signals(sig).name}: cancelling Slurm job {self._job} (its tasks "
                      "checkpoint and stop)")
            _slurm("scancel", self._job)

    def follow(self, job: str) -> tuple[int | None, float]:
        """Follow one job to its end: (the launcher's exit code or None to submit again, seconds to wait first)."""
        runs_seen, started, before = 0, time.time(), latest_checkpoint_step(self.run_location)
        hold_until = None  # a backoff for the requeued job, applied once it is back in the queue
        said, said_at = None, 0.0  # the state last reported, and when
        while True:
            info = job_info(job)
            restarts = int(info.get("Restarts", runs_seen)) if info else runs_seen
            if restarts > runs_seen:  # Slurm requeued it: our script after exit 75, a preemption, `scontrol requeue`
                after = latest_checkpoint_step(self.run_location)
                result, sleep = self.judge(Attempt(started, ExitCode.PREEMPTED, [ExitCode.PREEMPTED], "requeued", before,
                                                   after, self.processes, job, runs_seen + 1), again="run again")
                if result is not None:
                    _slurm("scancel", job)
                    return result, 0.0
                hold_until = datetime.datetime.now() + datetime.timedelta(seconds=sleep) if sleep else None
                runs_seen, started, before = restarts, time.time(), after
            if hold_until and info and info["JobState"] == "PENDING":
                # Slurm holds a requeued job back by itself until the old run's credential expires (it could
                # not start before): only ever later than that.
                if hold_until > _eligible(info):
                    _slurm("scontrol", "update", f"JobId={job}", f"StartTime={hold_until.isoformat(timespec='seconds')}")
                hold_until = None
            if info is None or info["JobState"] in ENDED:
                code, reason = _exit_code(info)
                after = latest_checkpoint_step(self.run_location)
                return self.judge(Attempt(started, code, [code], reason, before, after, self.processes, job,
                                          runs_seen + 1), again="submit again")
            state = _state(info)
            if state != said or time.monotonic() - said_at >= self.status_seconds:
                self.echo(f"olmax launch: Slurm job {job} run {runs_seen + 1}: {state}; last committed step "
                          f"{latest_checkpoint_step(self.run_location)} of {self.target_step}")
                said, said_at = state, time.monotonic()
            self.wait(self.poll)


def _state(info: dict[str, str]) -> str:
    """The job's state as a user reads it: `PENDING (BeginTime, eligible 2026-12-03T10:00:00)`, `RUNNING on node07`."""
    state, reason = info["JobState"], info.get("Reason", "None")
    if state == "PENDING":
        eligible = info.get("EligibleTime", "Unknown")
        return f"PENDING ({reason}" + (f", eligible {eligible})" if eligible not in ("Unknown", "None") else ")")
    nodes = info.get("NodeList", "")
    return f"{state} on {nodes}" if state == "RUNNING" and nodes not in ("", "(null)") else state
