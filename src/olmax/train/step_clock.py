"""Each train step's time, as the device spent it, for the throughput figures (TPS, MFU).

A step starts on the device when it has been dispatched and the step before it is done, and ends when it is
seen done; the time between two steps when nothing was in flight (a checkpoint written, an upload, an
evaluation, a batch that came late) is in neither. Nothing is subtracted, so a figure can be low when a step's
end is seen late (host work overlapped it) but never higher than what the device did.
"""

from __future__ import annotations

import time


class StepClock:
    def __init__(self):
        self.dispatched_at: dict[int, float] = {}
        self.done_at: dict[int, float] = {}
        self.previous_end = 0.0

    def dispatching(self, step: int) -> None:
        """Call just before the step is dispatched (its compilation, on the first step, is in its time)."""
        self.dispatched_at[step] = time.perf_counter()

    def done(self, step: int) -> None:
        """Call as soon as the step's results are ready (after blocking on them); later calls change nothing."""
        self.done_at.setdefault(step, time.perf_counter())

    def seconds(self, step: int) -> float:
        """The step's time on the device; steps are asked in order, each once, after `done`."""
        end = self.done_at.pop(step)
        start = max(self.dispatched_at.pop(step), self.previous_end)
        self.previous_end = end
        return end - start
