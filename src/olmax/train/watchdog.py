"""End a multi-process run that stopped making progress, instead of hanging in a collective for ever.

When one process of a run stops (its host froze, it was SIGSTOPped, its accelerator hung), the others wait
for it inside a collective, and no error ever comes. Every process therefore runs a watchdog: the train loop
calls `beat(step)` after each step, and when no step has finished for `timeout` seconds the watchdog prints
one line naming the process that stopped and ends this process with the resumable exit code (75), so that
the job is run again from the latest checkpoint.

The timeout is max(train.hang_timeout, STEP_FACTOR x the longest interval between two beats so far): a run
whose steps (checkpoint writes included) take long gets a longer one by itself, and the floor covers what
comes before that is known. It is armed by the first beat: restoring and compiling the first step (minutes
for a large model, and not alike on every process) are no part of it.

JAX's coordination service has a heartbeat of its own, which aborts every process (no line naming the one
that stopped, and no exit code a requeue reads) once one process has been silent for its timeout;
`olmax train` sets that far beyond the watchdog's (coordination_heartbeat), so that the watchdog speaks first.

Which process stopped: each process publishes, every PUBLISH_S seconds from a thread of its own, a counter,
its last finished step and its host name in the key-value store of JAX's coordination service. A frozen
process's counter stays still; a process that does not answer at all leaves only the coordinator's (process
0's) store unanswered, which is said instead.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time

import jax

STEP_FACTOR = 5.0
PUBLISH_S = 1.0
KEY = "olmax/watchdog/"


def hang_timeout(floor: float, step_intervals: list[float]) -> float:
    """Seconds without a finished step after which a run is taken for stopped (see the module's doc)."""
    return max(floor, STEP_FACTOR * max(step_intervals, default=0.0))


def coordination_heartbeat(floor: float) -> int:
    """JAX's heartbeat timeout for a run whose watchdog has this floor: well beyond the watchdog's timeout."""
    return int(10 * floor)


def _kv_client():
    from jax._src import distributed  # JAX's coordination service: no public API reaches its key-value store

    return distributed.global_state.client


class Watchdog:
    def __init__(self, floor: float, exit_code: int, *, exit=os._exit):
        self.floor, self.exit_code, self.exit = floor, int(exit_code), exit
        self.intervals: list[float] = []
        self.last_beat: float | None = None  # armed by the first beat
        self.step = 0
        self.count = 0
        self._stopped = threading.Event()

    def beat(self, step: int) -> None:
        now = time.monotonic()
        if self.last_beat is not None:
            self.intervals.append(now - self.last_beat)
        self.last_beat, self.step = now, step

    def timeout(self) -> float:
        return hang_timeout(self.floor, self.intervals)

    def start(self) -> None:
        for target in (self._publish, self._watch):
            threading.Thread(target=target, name=f"olmax-watchdog{target.__name__}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _publish(self) -> None:
        key, host = f"{KEY}{jax.process_index()}", socket.gethostname()
        while not self._stopped.is_set():
            self.count += 1
            with contextlib.suppress(Exception):  # the coordinator is gone: what the watch thread reports
                _kv_client().key_value_set(key, f"{self.count} {self.step} {host}", allow_overwrite=True)
            self._stopped.wait(PUBLISH_S)

    def _watch(self) -> None:
        while not self._stopped.wait(PUBLISH_S / 2):
            if self.last_beat is None:
                continue
            waited, timeout = time.monotonic() - self.last_beat, self.timeout()
            if waited > timeout and not self._stopped.is_set():
                self._end(waited, timeout)
                return

    def _end(self, waited: float, timeout: float) -> None:
        slowest = max(self.intervals, default=0.0)
        line = (f"olmax: watchdog: process {jax.process_index()} of {jax.process_count()} finished no step for "
                f"{waited:.1f} s after step {self.step} (timeout {timeout:.0f} s: the larger of train.hang_timeout="
                f"{self.floor:g} and {STEP_FACTOR:g} x the slowest step, {slowest:.2f} s); {who_stopped()}; exiting "
                f"{self.exit_code} so that the run resumes from its latest checkpoint")
        print(line, file=sys.stderr, flush=True)
        self.exit(self.exit_code)


def _published() -> dict[int, tuple[int, int, str]]:
    """{process: (counter, step, host)} as the processes last published them."""
    out = {}
    for key, value in _kv_client().key_value_dir_get(KEY):
        count, step, host = value.split(" ", 2)
        out[int(key.rsplit("/", 1)[1])] = (int(count), int(step), host)
    return out


def who_stopped(window: float = 3 * PUBLISH_S) -> str:
    """The processes whose heartbeat stood still over `window` seconds, in words; the coordinator when its
    key-value store does not answer within the window."""
    reads: list[dict] = []

    def read_twice():
        reads.append(_published())
        time.sleep(window)
        reads.append(_published())

    reader = threading.Thread(target=read_twice, daemon=True)
    reader.start()
    reader.join(3 * window)
    if len(reads) < 2:
        return (f"process 0 (the coordinator) did not answer within {3 * window:.0f} s: process 0 or its host "
                "stopped making progress")
    before, after = reads
    stopped = [p for p in range(jax.process_count()) if p != jax.process_index()
               and (p not in after or before.get(p, (None,))[0] == after[p][0])]
    if not stopped:
        return "every process is alive but none finishes a step (a collective deadlocked?)"
    return "; ".join(f"process {p} on {after[p][2]} stopped making progress (its heartbeat stood still for "
                     f"{window:.0f} s)" if p in after
                     else f"process {p} never published a heartbeat" for p in stopped)


@contextlib.contextmanager
def watching(floor: float, exit_code: int):
    """A Watchdog, started in a multi-process run (one process has no peer to wait for)."""
    watchdog = Watchdog(floor, exit_code)
    if jax.process_count() > 1:
        watchdog.start()
    try:
        yield watchdog
    finally:
        watchdog.stop()
