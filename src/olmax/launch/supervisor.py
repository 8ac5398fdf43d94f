"""Resume until done: run `olmax train` as child processes and restart them until the run finishes.

The trainer resumes from the run's latest checkpoint by itself, so a restart
is just running the same command again. What the exit says decides what
happens next (`olmax train`'s exit codes, olmax.errors.ExitCode):

    FINISHED (0)      the step target is reached; stop.
    not `retried`     bad input (2), diverged (3), disk full (74): retrying cannot help; stop.
    PREEMPTED (75)    stopped by a signal after writing a checkpoint: restart at once, not a failure.
    other/signal      crashed, or a storage outage (69): restart after a backoff.

A failure is a crash, or a "preemption" that wrote no new checkpoint (a child
that exits 75 in a loop must not spin for ever). The n-th failure in a row
waits `backoff * factor**(n-1)` seconds, capped at `backoff_max`; an attempt
that advanced the latest checkpoint resets the count, and `max_retries`
failures in a row without progress give up. A run that keeps making progress
is never given up on. A crash after the final checkpoint was written (e.g.
in shutdown) counts as finished.

Children run in their own process groups: SIGTERM/SIGINT to the launcher are
passed on (the run checkpoints and exits 75) and the launcher then exits 75
without restarting; if the launcher is killed outright, its children get
SIGTERM (Linux).

With `nprocs > 1` the attempt is a group of local processes of one
multi-process run (see olmax.launch.distributed): when one process fails the
others cannot go on (their collectives wait for it), so they are killed and
the whole group restarts.

Every attempt is printed and appended to launch.jsonl in the run directory (`launch.records_dir`, or
runs/NAME here for a run in a bucket).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from olmax import run_lock, storage
from olmax.config import RunConfig, load_config, writable_dir
from olmax.errors import NOT_RETRIED, ExitCode
from olmax.launch.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from olmax.run_dir import RunDir
from olmax.runtime import release_stop_signals

TRAIN_COMMAND = (sys.executable, "-m", "olmax.cli", "train")
# How long the other processes of a group may take to exit on their own once one has exited cleanly
# (finished, not retried or preempted: the others are finishing the same checkpoint or error) before they are killed.
STOP_GRACE_SECONDS = 60.0
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Backoff:
    initial: float = 300.0
    factor: float = 2.0
    maximum: float = 3600.0

    def delay(self, failures_in_a_row: int) -> float:
        return min(self.initial * self.factor ** (failures_in_a_row - 1), self.maximum)


@dataclass
class RetryPolicy:
    """What follows an attempt, from how it ended and whether it advanced the latest checkpoint (see the
    module's docstring); local launches and Slurm jobs share it."""

    target_step: int
    backoff: Backoff
    max_retries: int
    failures_in_a_row: int = 0

    def decide(self, *, finished: bool, code: int, before: int, after: int, stopped_by: int | None = None,
               again: str = "restart") -> tuple[int | None, str, float]:
        """(the launcher's exit code, or None to go on; the action in words; seconds to wait first)."""
        progressed = after > before
        if progressed:
            self.failures_in_a_row = 0
        if finished:
            return ExitCode.FINISHED, "done", 0.0
        if code in NOT_RETRIED:
            return code, f"stop: {exit_reason(code)} is not retried (see the error above)", 0.0
        if after >= self.target_step:
            return ExitCode.FINISHED, f"done: the final checkpoint {after} was written", 0.0
        if stopped_by is not None:
            return ExitCode.PREEMPTED, f"stop: the launcher got {signal.Signals(stopped_by).name}", 0.0
        if code == ExitCode.PREEMPTED and progressed:
            return None, f"{again} now", 0.0
        self.failures_in_a_row += 1
        if self.failures_in_a_row > self.max_retries:
            return (ExitCode.FAILED, f"give up: {self.failures_in_a_row} failures in a row "
                    f"(--max-retries {self.max_retries})", 0.0)
        sleep = self.backoff.delay(self.failures_in_a_row)
        return None, f"{again} in {sleep:g} s (retry {self.failures_in_a_row} of at most {self.max_retries} in a row)", sleep


def launch_dir(cfg: RunConfig) -> Path:
    """The directory `olmax launch` keeps its records in (launch.jsonl, job scripts and manifests, Slurm's
    output): `launch.records_dir`, else the run directory, else (a run in a bucket, which has no appending)
    runs/{name} on this filesystem."""
    records = cfg.launch.records_dir or ("runs/{name}" if storage.is_remote(cfg.run_location) else None)
    if records is None:
        return writable_dir(cfg.run_dir, "output_dir")
    return writable_dir(Path(records.format(name=cfg.name)), "launch.records_dir")


def previous_attempts(records: Path) -> int:
    log = RunDir(records).launch_records
    return len(log.read_text().splitlines()) if log.exists() else 0


def latest_checkpoint_step(run: str | Path) -> int:
    """The newest committed checkpoint's step of a run directory or bucket run, 0 if none."""
    return RunDir(run).latest_step() or 0


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    try:
        words = ExitCode(returncode).words
    except ValueError:
        words = None
    return words or f"crashed (exit {returncode})"


def _exit_with(launcher_pid: int, libc) -> None:
    """In a child before exec (Linux): SIGTERM when the launcher dies, even by SIGKILL, so that no trainer
    outlives it and races a relaunched one over the same run directory (it checkpoints and exits instead)."""
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher_pid:  # the launcher died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    """Runs `command + [config, *overrides]` (as `nprocs` processes) until the run finishes."""

    def __init__(
        self,
        config: str,
        overrides: list[str] = (),
        *,
        nprocs: int = 1,
        backoff: Backoff = Backoff(),
        max_retries: int = 50,
        command: tuple[str, ...] = TRAIN_COMMAND,
        env: dict[str, str] | None = None,
        stop_grace: float = STOP_GRACE_SECONDS,
        sleep=None,
        on_start=None,
        echo=None,
    ):
        if nprocs < 1 or max_retries < 0:
            raise ValueError(f"need nprocs >= 1 and max_retries >= 0, got {nprocs} and {max_retries}")
        cfg = load_config(config, list(overrides))  # a bad config fails here, before any child starts
        self.records, self.run_location = launch_dir(cfg), cfg.run_location
        # held for the whole run, so that its trainers know they run for it; a bucket run's lease is its trainer's
        self.held = self.records if storage.is_remote(self.run_location) else cfg.run_dir
        self.target_step = cfg.train.steps
        self.argv = [*command, config, *overrides]
        self.nprocs = nprocs
        self.policy = RetryPolicy(self.target_step, backoff, max_retries)
        self.env = dict(os.environ if env is None else env)
        self.stop_grace = stop_grace
        self.on_start = on_start  # called with the list of Popen handles of each attempt (tests inject faults)
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self._stop_signal: int | None = None
        self._stopping = threading.Event()
        self.sleep = sleep or self._stopping.wait  # a signal cuts a backoff short
        self._procs: list[subprocess.Popen] = []

    # ---- one attempt -------------------------------------------------------------------------

    def _child_envs(self) -> list[dict[str, str]]:
        if self.nprocs == 1:
            return [self.env]
        coordinator = f"127.0.0.1:{free_port()}"  # a fresh port: the last attempt's may still be bound
        return [{**self.env, ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(self.nprocs),
                 ENV_PROCESS_ID: str(i)} for i in range(self.nprocs)]

    def _kill(self, proc: subprocess.Popen, sig: int) -> None:
        # Each child leads its own process group: the signal reaches whatever it started too.
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def _run_group(self) -> tuple[list[int], int]:
        """Start the processes and wait for all; (exit codes, the process whose exit describes the attempt:
        the first to fail, else the first to exit)."""
        # libc is loaded here, not in the forked child (loading a library after fork can deadlock).
        preexec = functools.partial(_exit_with, os.getpid(), ctypes.CDLL(None)) if sys.platform == "linux" else None
        self._procs = [subprocess.Popen(self.argv, env=env, start_new_session=True, preexec_fn=preexec)
                       for env in self._child_envs()]
        procs = self._procs
        if self._stop_signal is not None:  # a signal arrived while the processes were starting
            self._forward(self._stop_signal)
        if self.on_start:
            self.on_start(procs)
        exit_order, deadline = [], None
        while True:
            codes = [p.poll() for p in procs]
            exit_order += [i for i, c in enumerate(codes) if c is not None and i not in exit_order]
            if None not in codes:
                break
            if exit_order and deadline is None:
                if any(codes[i] not in (ExitCode.FINISHED, *NOT_RETRIED, ExitCode.PREEMPTED) for i in exit_order):
                    deadline = time.monotonic()  # a crash: the others are stuck waiting for it in a collective
                else:
                    deadline = time.monotonic() + self.stop_grace
            if deadline is not None and time.monotonic() >= deadline:
                for p in procs:
                    if p.poll() is None:
                        self._kill(p, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(POLL_SECONDS)
        self._procs = []
        return codes, next((i for i in exit_order if codes[i] != ExitCode.FINISHED), exit_order[0])

    # ---- signals -----------------------------------------------------------------------------

    def _forward(self, sig: int) -> None:
        for p in self._procs:
            if p.poll() is None:
                self._kill(p, sig)

    def _on_signal(self, sig, frame) -> None:
        if self._stop_signal is not None:  # a second signal: stop waiting for a clean exit
            self._forward(signal.SIGKILL)
            return
        self._stop_signal = sig
        self._stopping.set()
        self.echo(f"olmax launch: {signal.Signals(sig).name}: stopping the run (it checkpoints and exits); "
                  "signal again to kill it")
        self._forward(sig)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    # ---- the loop ----------------------------------------------------------------------------

    def _log(self, record: dict) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        with open(RunDir(self.records).launch_records, "a") as f:
            f.write(json.dumps(record) + "\n")
        codes = ", ".join(f"process {i}: {exit_reason(c)}" for i, c in enumerate(record["exit_codes"]))
        self.echo(
            f"olmax launch: attempt {record['attempt']} {record['reason']} after {record['seconds']:.1f} s "
            f"(checkpoint {record['checkpoint_before']} -> {record['checkpoint_after']} of {self.target_step}"
            + (f"; {codes}" if self.nprocs > 1 else "") + f"); {record['action']}"
        )

    def run(self) -> int:
        """Attempts until done; the exit code for `olmax launch` (0 finished, 2 bad input, 3 diverged,
        74 disk full, 75 stopped by a signal, 1 gave up after max_retries failures in a row)."""
        previous = self._install_signal_handlers()
        try:
            with run_lock.hold(self.held) as holder:
                self.env[run_lock.ENV_RUN_LOCK] = holder
                release_stop_signals()  # one that came while the CLI started up, holding it, stops the run now
                return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        attempt = previous_attempts(self.records)  # numbered over every launch of the run
        while True:
            if self._stop_signal is not None:
                self.echo("olmax launch: stopped before the next attempt")
                return ExitCode.PREEMPTED
            attempt += 1
            before = latest_checkpoint_step(self.run_location)
            self.echo(f"olmax launch: attempt {attempt} from checkpoint {before} of {self.target_step}"
                      + (f" ({self.nprocs} processes)" if self.nprocs > 1 else "") + f": {shlex.join(self.argv)}")
            started = time.time()
            codes, first = self._run_group()
            after = latest_checkpoint_step(self.run_location)
            code = codes[first]
            reason = exit_reason(code) + (f" (process {first})" if self.nprocs > 1 and code != 0 else "")
            record = {
                "attempt": attempt, "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
                "seconds": round(time.time() - started, 3), "nprocs": self.nprocs, "exit_codes": codes,
                "reason": reason, "checkpoint_before": before, "checkpoint_after": after,
                "target_step": self.target_step,
            }
            result, record["action"], record["sleep"] = self.policy.decide(
                finished=all(c == ExitCode.FINISHED for c in codes), code=code, before=before, after=after,
                stopped_by=self._stop_signal)
            record["failures_in_a_row"] = self.policy.failures_in_a_row
            self._log(record)
            if result is not None:
                return result
            if record["sleep"]:
                self.sleep(record["sleep"])


def launch(config: str, overrides: list[str] = (), **kwargs) -> int:
    return Supervisor(config, overrides, **kwargs).run()
