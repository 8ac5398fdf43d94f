"""`olmax launch --slurm`: the run as a Slurm batch job, submitted again until it is done.

The batch script (written to RECORDS/slurm/job.sh, RECORDS being the run directory, or
launch.records_dir; runs/NAME for a run in a bucket) starts one `srun` task per process;
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
RECORDS/launch.jsonl with its job id. SIGTERM/SIGINT to the launcher cancel the job (its
tasks checkpoint within Slurm's KillWait) and the launcher exits 75.
"""

from __future__ import annotations

import datetime
import json
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from olmax.config import RunConfig, load_config
from olmax.errors import ExitCode, SlurmError
from olmax.launch.supervisor import (
    Backoff,
    RetryPolicy,
    exit_reason,
    latest_checkpoint_step,
    launch_dir,
    previous_attempts,
)
from olmax.run_dir import RunDir
from olmax.runtime import release_stop_signals

# Job states after which Slurm will not run the job again by itself (a requeued job goes back to PENDING).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT"}
POLL_SECONDS = 30.0


def batch_script(cfg: RunConfig, config: str, overrides: list[str], python: str = sys.executable) -> str:
    slurm = cfg.launch.slurm
    records = launch_dir(cfg).resolve()
    options = [f"--job-name={cfg.name}", f"--nodes={slurm.nodes}", f"--ntasks-per-node={slurm.tasks_per_node}"]
    options += [f"--gpus-per-task={slurm.gpus_per_task}"] if slurm.gpus_per_task else []
    options += [f"--{key}={getattr(slurm, key)}" for key in ("time", "partition", "account") if getattr(slurm, key)]
    options += ["--requeue", f"--signal=TERM@{slurm.signal_seconds}", "--open-mode=append",
                f"--output={RunDir(records).slurm_output('%j')}", *slurm.sbatch_lines]
    lines = ["#!/bin/bash", "# Written by `olmax launch --slurm`, which submits it with sbatch and watches the job.",
             *(f"#SBATCH {option}" for option in options)]
    if slurm.gpus_per_task:
        lines += ["# Each task sees its own GPUs as 0..G-1; JAX would otherwise take only the one numbered SLURM_LOCALID.",
                  f"export JAX_LOCAL_DEVICE_IDS={','.join(str(i) for i in range(slurm.gpus_per_task))}"]
    lines += [
        "# One task per process; they join one run through JAX's Slurm detection.",
        f"srun {shlex.join([python, '-m', 'olmax.cli', 'train', config, *overrides])}",
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
        raise SlurmError(f"`{argv[0]}` is not on PATH: run `olmax launch --slurm` where Slurm's commands are "
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


class SlurmLauncher:
    """Submits `config overrides` as a Slurm job and watches it until the run finishes (see the module's doc)."""

    def __init__(self, config: str, overrides: list[str] = (), *, backoff: Backoff = Backoff(), max_retries: int = 50,
                 poll: float = POLL_SECONDS, python: str = sys.executable, sleep=None, echo=None):
        cfg = load_config(config, list(overrides))  # a bad config fails here, before anything is submitted
        self.records, self.run_location = launch_dir(cfg), cfg.run_location
        self.target_step = cfg.train.steps
        self.script = batch_script(cfg, config, list(overrides), python)
        self.policy = RetryPolicy(self.target_step, backoff, max_retries)
        self.poll = poll
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self._stop_signal: int | None = None
        self._stopping = threading.Event()
        self.sleep = sleep or self._stopping.wait  # a signal cuts a backoff short
        self._job: str | None = None
        self._attempt = 0

    def submit(self) -> str:
        path = script_path(self.records)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.script)
        out = _slurm("sbatch", "--parsable", str(path))
        if out.returncode != 0:
            error = (out.stderr.strip() or out.stdout.strip() or f"exit {out.returncode}").splitlines()[-1]
            raise SlurmError(f"sbatch refused {path}: {error}; fix launch.slurm in the config")
        return out.stdout.strip().split(";")[0]

    # ---- signals -----------------------------------------------------------------------------

    def _on_signal(self, sig, frame) -> None:
        if self._stop_signal is not None:
            return
        self._stop_signal = sig
        self._stopping.set()
        if self._job is not None:
            self.echo(f"olmax launch: {signal.Signals(sig).name}: cancelling Slurm job {self._job} (its tasks "
                      "checkpoint and stop)")
            _slurm("scancel", self._job)

    def run(self) -> int:
        """Jobs until done; the exit code for `olmax launch` (as for local launches)."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            release_stop_signals()  # one that came while the CLI started up, holding it, stops the launcher now
            self._attempt = previous_attempts(self.records)
            while True:
                if self._stop_signal is not None:
                    self.echo("olmax launch: stopped before the next submission")
                    return ExitCode.PREEMPTED
                self._job = self.submit()
                self.echo(f"olmax launch: submitted Slurm job {self._job} ({script_path(self.records)}); "
                          f"its output goes to {RunDir(self.records).slurm_output(self._job)}")
                result, sleep = self._watch(self._job)
                if result is not None:
                    return result
                if sleep:
                    self.sleep(sleep)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _watch(self, job: str) -> tuple[int | None, float]:
        """Follow one job to its end: (the launcher's exit code or None to submit again, seconds to wait first)."""
        runs_seen, started, before = 0, time.time(), latest_checkpoint_step(self.run_location)
        hold_until = None  # a backoff for the requeued job, applied once it is back in the queue
        while True:
            info = job_info(job)
            restarts = int(info.get("Restarts", runs_seen)) if info else runs_seen
            if restarts > runs_seen:  # Slurm requeued it: our script after exit 75, a preemption, `scontrol requeue`
                after = latest_checkpoint_step(self.run_location)
                result, sleep = self._record(job, runs_seen + 1, started, ExitCode.PREEMPTED, "requeued",
                                             before, after, again="run again")
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
                result, sleep = self._record(job, runs_seen + 1, started, code, reason, before, after,
                                                again="submit again")
                return result, sleep
            time.sleep(self.poll)

    def _record(self, job: str, run: int, started: float, code: int, reason: str, before: int, after: int,
                again: str) -> tuple[int | None, float]:
        self._attempt += 1
        result, action, sleep = self.policy.decide(finished=code == ExitCode.FINISHED, code=code, before=before,
                                                   after=after, stopped_by=self._stop_signal, again=again)
        record = {
            "attempt": self._attempt, "job_id": job, "job_run": run,
            "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "seconds": round(time.time() - started, 3), "exit_code": code, "reason": reason,
            "checkpoint_before": before, "checkpoint_after": after, "target_step": self.target_step,
            "action": action, "sleep": sleep, "failures_in_a_row": self.policy.failures_in_a_row,
        }
        self.records.mkdir(parents=True, exist_ok=True)
        with open(RunDir(self.records).launch_records, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.echo(f"olmax launch: attempt {self._attempt}: Slurm job {job} run {run} {reason} after "
                  f"{record['seconds']:.1f} s (checkpoint {before} -> {after} of {self.target_step}); {action}")
        return result, sleep

