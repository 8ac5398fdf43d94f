"""Each train step's time, as the device spent it, for the throughput figures (TPS, MFU).

A step is timed from its own start to its own end: the training loop dispatches a step once the step before it
is done (its next batch already loaded), so the step starts on the device when it is dispatched, and a thread of
its own waits for the step's results and notes when they are ready. Seen late, an end makes a step longer, never
shorter: a figure can be low, never higher than what the device did. (Timing a step from the end of the step
before it, as the loop happened to see that end, timed a step after a paused upload at 3508% MFU.)
"""

from __future__ import annotations

import queue
import threading
import time

import jax


class StepClock:
    def __init__(self):
        self.dispatched_at: dict[int, float] = {}
        self.done_at: dict[int, float] = {}
        self.ready = threading.Condition()
        self.steps: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._watch, name="olmax step clock", daemon=True).start()

    def _watch(self) -> None:
        while (item := self.steps.get()) is not None:
            step, outputs = item
            try:
                jax.block_until_ready(outputs)
            except Exception:  # a failed step: the loop sees its error itself
                pass
            with self.ready:
                self.done_at[step] = time.perf_counter()
                self.ready.notify_all()

    def dispatching(self, step: int) -> None:
        """Call just before the step is dispatched, with the step before it done (its compilation, on the first
        step, is in its time)."""
        self.dispatched_at[step] = time.perf_counter()

    def dispatched(self, step: int, outputs) -> None:
        """Call with the step's outputs as soon as it is dispatched: their readiness is its end."""
        self.steps.put((step, outputs))

    def seconds(self, step: int) -> float:
        """The step's time on the device (waiting for its end); each step is asked once."""
        with self.ready:
            self.ready.wait_for(lambda: step in self.done_at)
            return self.done_at.pop(step) - self.dispatched_at.pop(step)

    def close(self) -> None:
        self.steps.put(None)  # not joined: a step that never ends (a frozen peer) must not hold the exit
