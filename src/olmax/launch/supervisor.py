"""`olmax launch local`: run `olmax train` as child processes here and restart them until the run finishes.

The trainer resumes from the run's latest checkpoint by itself, so a restart is just running the same command
again; what the exit says decides what happens next (olmax.launch.launcher: the exit code contract, the
backoff, the records).

Children run in their own process groups: SIGTERM/SIGINT to the launcher are passed on (the run checkpoints
and exits 75) and the launcher then exits 75 without restarting; if the launcher is killed outright, its
children get SIGTERM (Linux).

With `nprocs > 1` the attempt is a group of local processes of one multi-process run (see
olmax.launch.distributed): when one process fails the others cannot go on (their collectives wait for it), so
they are killed and the whole group restarts.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

from olmax import run_lock, storage
from olmax.launch.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from olmax.errors import NOT_RETRIED, ExitCode
from olmax.runtime import LAUNCHER_STARTED
from olmax.launch.launcher import (
    Attempt,
    Backoff,  # noqa: F401 (the local launcher's callers build theirs with it)
    Launcher,
    exit_reason,
    latest_checkpoint_step,
)

TRAIN_COMMAND = (sys.executable, "-m", "olmax.cli", "train")
# How long the other processes of a group may take to exit on their own once one has exited cleanly
# (finished, not retried or preempted: the others are finishing the same checkpoint or error) before they are killed.
STOP_GRACE_SECONDS = 60.0
POLL_SECONDS = 0.05


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


class Supervisor(Launcher):
    """Runs `command + [config, *overrides]` (as `nprocs` processes) until the run finishes."""

    mode = "local"

    def __init__(
        self,
        config: str,
        overrides: list[str] = (),
        *,
        nprocs: int = 1,
        command: tuple[str, ...] = TRAIN_COMMAND,
        env: dict[str, str] | None = None,
        stop_grace: float = STOP_GRACE_SECONDS,
        on_start=None,
        **launcher,
    ):
        if nprocs < 1:
            raise ValueError(f"need nprocs >= 1, got {nprocs}")
        super().__init__(config, overrides, **launcher)
        # held for the whole run, so that its trainers know they run for it; a bucket run's lease is its trainer's
        self.held = self.records if storage.is_remote(self.run_location) else self.cfg.run_dir
        self.argv = [*command, config, *overrides]
        self.nprocs = nprocs
        self.env = dict(os.environ if env is None else env)
        self.stop_grace = stop_grace
        self.on_start = on_start  # called with the list of Popen handles of each attempt (tests inject faults)
        self._procs: list[subprocess.Popen] = []
        self._submitted = False

    def render(self) -> str:
        processes = f"# {self.nprocs} processes of one run, each with OLMAX_* variables\n" if self.nprocs > 1 else ""
        return f"{processes}{shlex.join(self.argv)}\n"

    @contextmanager
    def holding(self):
        with run_lock.hold(self.held) as holder:
            self.env[run_lock.ENV_RUN_LOCK] = holder
            yield

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

    def submit(self) -> tuple[float, int]:
        """Start the processes: (when, the latest checkpoint's step before)."""
        before = latest_checkpoint_step(self.run_location)
        self.echo(f"olmax launch: attempt {self._attempt + 1} from checkpoint {before} of {self.target_step}"
                  + (f" ({self.nprocs} processes)" if self.nprocs > 1 else "") + f": {shlex.join(self.argv)}")
        started = time.time()
        # libc is loaded here, not in the forked child (loading a library after fork can deadlock).
        preexec = functools.partial(_exit_with, os.getpid(), ctypes.CDLL(None)) if sys.platform == "linux" else None
        # The first attempt's process counts the launcher's own start-up in its goodput record.
        first = {LAUNCHER_STARTED: repr(self.started)} if not self._submitted else {}
        self._submitted = True
        self._procs = [subprocess.Popen(self.argv, env={**env, **first}, start_new_session=True, preexec_fn=preexec)
                       for env in self._child_envs()]
        self.act_on_signals()  # one that came while the processes were starting
        if self._stop_signal is not None:
            self._forward(self._stop_signal)
        if self.on_start:
            self.on_start(self._procs)
        return started, before

    def follow(self, job: tuple[float, int]) -> tuple[int | None, float]:
        """Wait for all the processes; the attempt is described by the first to fail, else the first to exit."""
        started, before = job
        procs, exit_order, deadline = self._procs, [], None
        while True:
            codes = [p.poll() for p in procs]
            # Found exited in one poll: a process killed by a signal goes first (the others of the group then fail
            # because their peer vanished, often before the next poll).
            exit_order += sorted((i for i, c in enumerate(codes) if c is not None and i not in exit_order),
                                 key=lambda i: codes[i] >= 0)
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
            self.wait(POLL_SECONDS)
        self._procs = []
        first = next((i for i in exit_order if codes[i] != ExitCode.FINISHED), exit_order[0])
        code = codes[first]
        reason = exit_reason(code) + (f" (process {first})" if self.nprocs > 1 and code != 0 else "")
        attempt = Attempt(started=started, exit_code=code, exit_codes=codes, reason=reason, checkpoint_before=before,
                          checkpoint_after=latest_checkpoint_step(self.run_location), processes=self.nprocs)
        return self.judge(attempt)

    # ---- signals -----------------------------------------------------------------------------

    def _forward(self, sig: int) -> None:
        for p in self._procs:
            if p.poll() is None:
                self._kill(p, sig)

    def stop(self, sig: int, again: bool) -> None:
        if again:  # a second signal: stop waiting for a clean exit
            self._forward(signal.SIGKILL)
            return
        self.echo(f"olmax launch: {signal.Signals(sig).name}: stopping the run (it checkpoints and exits); "
                  "signal again to kill it")
        self._forward(sig)


def launch(config: str, overrides: list[str] = (), **kwargs) -> int:
    return Supervisor(config, overrides, **kwargs).run()
