"""What every `olmax launch` mode shares: render the job, submit it, follow it until it ends, and decide from how it
ended and the run's committed progress whether to run it again.

The decision follows `olmax train`'s exit codes (olmax.errors.ExitCode):

    FINISHED (0)      the step target is reached; stop.
    not `retried`     bad input (2), diverged (3), disk full (74): retrying cannot help; stop.
    PREEMPTED (75)    stopped by a signal after writing a checkpoint: run again at once, not a failure.
    other/signal      crashed: run again after a backoff.

A failure is a crash, or a "preemption" that wrote no new checkpoint (a job that exits 75 in a loop must not
spin for ever). The n-th failure in a row waits `backoff * factor**(n-1)` seconds, capped at `backoff_max`; an
attempt that advanced the latest checkpoint resets the count, and `max_retries` failures in a row without
progress give up. A run that keeps making progress is never given up on. A crash after the final checkpoint
was written (e.g. in shutdown) counts as finished.

The local supervisor and the Slurm launcher make these decisions themselves (`Launcher.run`); a TPU pod's
workers and a JobSet's pods are started once, the JobSet's failure policy making the same decisions from the
same codes. Every attempt is one line of RECORDS/launch.jsonl, in one schema (`Launcher.judge`), RECORDS being
`launch.records_dir`, else the run directory, else for a run in a bucket its URL mirrored under runs/ here
(`records_mirror`: two bucket runs of one name never share records), for one on a cluster's disks runs/NAME here.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import select
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from olmax import storage
from olmax.config import RunConfig, load_config, writable_dir
from olmax.data.shards import resolve_sources
from olmax.errors import NOT_RETRIED, ExitCode
from olmax.progress import SILENCE
from olmax.run_dir import RunDir, open_own, writing
from olmax.runtime import release_stop_signals


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
    module's docstring)."""

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


def records_mirror(url: str) -> Path:
    """The records directory here of a run in a bucket: its URL mirrored under runs/ (s3://bucket/x ->
    runs/s3/bucket/x), one per run: two runs of one name in two buckets or prefixes never share records."""
    return Path("runs", *url.replace("://", "/", 1).strip("/").split("/"))


def launch_dir(cfg: RunConfig, run_dir_is_here: bool = True) -> Path:
    """The directory `olmax launch` keeps its records in (launch.jsonl, job scripts and manifests, Slurm's
    output): `launch.records_dir`, else the run directory, else on this filesystem `records_mirror` of a run in a
    bucket (which has no appending), runs/{name} of one whose run directory is on other machines' disks
    (`run_dir_is_here=False`: a TPU pod's workers, a JobSet's pods)."""
    if cfg.launch.records_dir is not None:
        return writable_dir(Path(cfg.launch.records_dir.format(name=cfg.name)), "launch.records_dir")
    if storage.is_remote(cfg.run_location):
        return writable_dir(records_mirror(cfg.run_location), "output_dir (records here: launch.records_dir)")
    if not run_dir_is_here:
        return writable_dir(Path("runs", cfg.name), "launch.records_dir")
    return writable_dir(cfg.run_dir, "output_dir")


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


@dataclass(frozen=True)
class Attempt:
    """How one run of the job ended: one line of launch.jsonl, with the policy's decision added."""

    started: float  # time.time()
    exit_code: int  # the one that describes the attempt: the first process to fail, the job script's
    exit_codes: list[int]  # one per process where the launcher sees them (local), else [exit_code]
    reason: str
    checkpoint_before: int
    checkpoint_after: int
    processes: int
    job_id: str | None = None  # Slurm's
    job_run: int = 1  # 1 for a job's first run, 2 after its first requeue, ...


class Launcher:
    """One mode of `olmax launch`. `render` is the job as text (a command line, a batch script, a manifest) and
    what --dry-run prints; `run` submits it and, for launchers that follow their jobs (`follow`), submits again
    until the run is done."""

    mode = ""  # the subcommand: local, slurm, tpu-pod, k8s
    run_dir_is_here = True  # the run directory is a path on this machine (or a bucket), not on the job's hosts

    def __init__(self, config: str, overrides: list[str] = (), *, backoff: Backoff = Backoff(), max_retries: int = 50,
                 target: str | None = None, sleep=None, echo=None, started: float | None = None):
        if max_retries < 0:
            raise ValueError(f"need max_retries >= 0, got {max_retries}")
        self.config, self.overrides = config, list(overrides)
        self.cfg = load_config(config, self.overrides, target)  # a bad config fails here, before anything starts
        self.records = launch_dir(self.cfg, self.run_dir_is_here)
        self.run_location = self.cfg.run_location
        self.target_step = self.cfg.train.steps
        self.policy = RetryPolicy(self.target_step, backoff, max_retries)
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self._stop_signal: int | None = None
        self._signals: list[int] = []  # SIGTERM/SIGINT as they came; the main thread acts on them (`wait`)
        self._acted = 0  # of them
        self._wakeup = self._wake = None  # while `run` runs, a pipe a signal writes to, waking `wait`
        self.sleep = sleep or self.wait  # a signal cuts a backoff short
        self.started = time.time() if started is None else started  # for the goodput record's launcher start-up
        self._attempt = 0

    # ---- what each mode provides -------------------------------------------------------------

    def render(self) -> str:
        raise NotImplementedError

    def submit(self):
        """Start the job; returns what `follow` follows."""
        raise NotImplementedError

    def follow(self, job) -> tuple[int | None, float]:
        """Wait for the job's end, judging each of its runs (`judge`): (the launcher's exit code, or None to
        submit again; seconds to wait first)."""
        raise NotImplementedError

    def stop(self, sig: int, again: bool) -> None:
        """Pass a SIGTERM/SIGINT on to the job (`again`: a second one)."""

    def holding(self):
        """A context held for the whole launch (the local supervisor holds the run's lock)."""
        return nullcontext()

    def check(self) -> list[str]:
        """Before a cluster job is printed or submitted: refuse (exit 2) what its processes would refuse at once,
        and return what cannot work there for all this machine can tell, as warnings (`path_warning`)."""
        data = self.cfg.data
        if not data.sources and not (data.mix_file and not data.paths):
            resolve_sources(data.paths, data.mix_file)  # no data, or two kinds: `olmax train`'s own refusal
        paths = {"output_dir": self.cfg.run_location, "data.mix_file": data.mix_file, "data.mix_base_dir":
                 data.mix_base_dir, **{f"data.paths[{i}]": path for i, path in enumerate(data.paths)},
                 **{f"data.sources[{s.name}]": path for s in data.sources for path in s.paths}}
        return [warning for field, path in paths.items() if path and not storage.is_remote(path)
                if (warning := self.path_warning(field, str(path)))]

    def path_warning(self, field: str, path: str) -> str | None:
        """Why a local path (`field`'s) may not work where the job runs, if it may not."""
        return None

    # ---- the protocol ------------------------------------------------------------------------

    def run(self) -> int:
        """Jobs until done; the exit code for `olmax launch` (0 finished, 2 bad input, 3 diverged, 74 disk
        full, 75 stopped by a signal, 1 gave up after max_retries failures in a row)."""
        handlers, wakeup = {}, None
        self._wakeup, self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
            # the interpreter writes to it as a signal arrives, before a bytecode boundary runs the handler: a
            # `wait` about to block in select wakes at once
            wakeup = signal.set_wakeup_fd(self._wake, warn_on_full_buffer=False)
        try:
            with self.holding():
                release_stop_signals()  # one that came while the CLI started up, holding it, stops the run now
                self._attempt = previous_attempts(self.records)  # numbered over every launch of the run
                while True:
                    self.act_on_signals()
                    if self._stop_signal is not None:
                        self.echo("olmax launch: stopped before the next attempt")
                        return ExitCode.PREEMPTED
                    result, sleep = self.follow(self.submit())
                    if result is not None:
                        return result
                    if sleep:
                        self.sleep(sleep)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if wakeup is not None:
                signal.set_wakeup_fd(wakeup)
            os.close(self._wakeup)
            os.close(self._wake)
            self._wakeup = self._wake = None

    def _on_signal(self, sig, frame) -> None:
        """Note the signal for the main thread, which acts on it (`wait`, `act_on_signals`): a handler runs on the
        main thread between two of its bytecodes, wherever that is, so it takes no lock (printing, a
        threading.Event and starting a process all take one, perhaps one the main thread holds at that moment)."""
        self._signals.append(sig)

    def wait(self, seconds: float) -> None:
        """Wait up to `seconds`, less when a stop signal comes, and act on the signals that came; a long wait says
        every 25 s how long it has gone on and how much of it is left (no silence over progress.SILENCE)."""
        began = time.monotonic()
        while len(self._signals) == self._acted and (left := seconds - (time.monotonic() - began)) > 0:
            select.select([self._wakeup] if self._wakeup is not None else [], [], [], min(left, SILENCE * 5 / 6))
            waited = time.monotonic() - began
            if len(self._signals) == self._acted and waited < seconds:
                self.echo(f"olmax launch: [{waited:.0f} s] waiting {seconds - waited:.0f} s more before attempt "
                          f"{self._attempt + 1} (backoff after {self.policy.failures_in_a_row} failure(s) in a row)")
        self.act_on_signals()

    def act_on_signals(self) -> None:
        """Pass the signals that came on to the job (`stop`); the first one stops the launch."""
        if self._wakeup is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wakeup, 4096)
        while self._acted < len(self._signals):
            sig, again = self._signals[self._acted], self._stop_signal is not None
            self._acted += 1
            self._stop_signal = self._stop_signal or sig
            self.stop(sig, again)

    def judge(self, attempt: Attempt, again: str = "restart") -> tuple[int | None, float]:
        """Decide what follows `attempt`, append it to launch.jsonl and say it: (exit code or None, sleep)."""
        self._attempt += 1
        result, action, sleep = self.policy.decide(
            finished=attempt.exit_code == ExitCode.FINISHED and all(c == ExitCode.FINISHED for c in attempt.exit_codes),
            code=attempt.exit_code, before=attempt.checkpoint_before, after=attempt.checkpoint_after,
            stopped_by=self._stop_signal, again=again)
        record = {
            "attempt": self._attempt, "launcher": self.mode, "job_id": attempt.job_id, "job_run": attempt.job_run,
            "started": datetime.datetime.fromtimestamp(attempt.started).isoformat(timespec="seconds"),
            "seconds": round(time.time() - attempt.started, 3), "processes": attempt.processes,
            "exit_code": attempt.exit_code, "exit_codes": attempt.exit_codes, "reason": attempt.reason,
            "checkpoint_before": attempt.checkpoint_before, "checkpoint_after": attempt.checkpoint_after,
            "target_step": self.target_step, "action": action, "sleep": sleep,
            "failures_in_a_row": self.policy.failures_in_a_row,
        }
        self.records.mkdir(parents=True, exist_ok=True)
        path = RunDir(self.records).launch_records
        with writing(path), open_own(path, append=True) as f:
            f.write(json.dumps(record) + "\n")
        job = f" (Slurm job {attempt.job_id} run {attempt.job_run})" if attempt.job_id else ""
        codes = ", ".join(f"process {i}: {exit_reason(c)}" for i, c in enumerate(attempt.exit_codes))
        self.echo(f"olmax launch: attempt {self._attempt}{job} {attempt.reason} after {record['seconds']:.1f} s "
                  f"(checkpoint {attempt.checkpoint_before} -> {attempt.checkpoint_after} of {self.target_step}"
                  + (f"; {codes}" if len(attempt.exit_codes) > 1 else "") + f"); {action}")
        return result, sleep
