"""Goodput: where every second of a run's wall time went, kept across the run's restarts.

The trainer marks the end of each piece of work with its category (`mark`): the wall time since the
previous mark goes to that category, so the categories of an attempt add up to its wall time by
construction. The categories:

    launcher start-up  `olmax launch`'s own start, before its first attempt's process started
    start-up         process start to the first step: imports, data, restore, building the step
    compilation      the first step's call: tracing and compiling the step
    productive       the steps' work (the device computing, logging)
    data wait        the loop blocked on the loader for its next batch (prefetch hides it when it keeps up)
    checkpoint       the step's stall for a checkpoint: the copy to host and the wait for a save in flight
    shutdown         after the last step and its save: closing, and the process's exit
    evaluation       in-loop evaluations
    lost work        steps' work (productive, data wait, evaluation) after the last checkpoint an attempt
                     committed: recomputed by the next attempt
    between attempts the end of an attempt's record to the start of the next process (its exit, the
                     launcher's backoff, a requeue)

The time from an attempt that finished the run (trained to its last step) to a later attempt that extends it
(`train.steps` raised) is none of these: the run was done, not stopped. It is kept apart (`between_runs`), out of
the wall time the shares are of.

The record (`RunDir.goodput` in the run directory, rewritten atomically after every step, so a kill -9 loses at
most the step in flight) lists the attempts: their start, their last update, their seconds by category,
whether they finished the run, and a snapshot of those seconds at each checkpoint. An attempt that resumes from step N settles the attempts
before it: their work after their snapshot at the largest step <= N becomes lost work.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

from olmax.errors import DiskFull, RunDirError
from olmax.run_dir import RunDir, replace_own, set_aside
from olmax.runtime import LAUNCHER_STARTED, process_start_time  # noqa: F401 - the CLI takes it from here

log = logging.getLogger(__name__)

WORK = ("productive", "data wait", "evaluation")  # redone after a restart when it was not checkpointed
CATEGORIES = ("launcher start-up", "start-up", "compilation", *WORK, "checkpoint", "shutdown", "lost work", "between attempts")
# The metric marking a step whose time includes compiling the train step (goodput's compilation): its
# throughput is not logged, as it would be mostly the compile's.
COMPILED = "throughput/step compiled"
KEPT_SNAPSHOTS = 8  # a resume restores one of the last few checkpoints (one save in flight at most)


_AT_EXIT: list[Goodput] = []


@atexit.register  # at this module's import: `olmax train` imports it before jax, so this runs after jax's own
def _record_exit() -> None:
    for goodput in _AT_EXIT:
        goodput._at_exit()


def read_record(text: str) -> dict:
    """The record in `text`, or ValueError naming the field olmax cannot account for: not JSON, a field missing or
    of another kind, seconds or times negative or not finite, a category it does not know. Categories an older
    olmax did not have count 0."""
    record = json.loads(text)
    if not isinstance(record, dict) or not isinstance(record.get("attempts"), list):
        raise ValueError("not a goodput record (no attempts)")
    for number, attempt in enumerate(record["attempts"], start=1):
        where = f"attempt {number}"
        if not isinstance(attempt, dict):
            raise ValueError(f"{where} is {json.dumps(attempt)[:40]}, not a record")
        _seconds(attempt.get("started"), f"{where}'s started")
        if _seconds(attempt.get("ended"), f"{where}'s ended") < attempt["started"]:
            raise ValueError(f"{where} ended ({attempt['ended']}) before it started ({attempt['started']})")
        if not isinstance(attempt.get("finished", False), bool):
            raise ValueError(f"{where}'s finished is {attempt['finished']!r}, not true or false")
        for field in ("first_step", "last_step", "lost_steps"):
            if attempt.get(field) is not None and not _count(attempt[field]):
                raise ValueError(f"{where}'s {field} is {attempt[field]!r}, not a step")
        _categories(attempt.get("seconds"), f"{where}'s seconds")
        if not isinstance(attempt.get("snapshots"), list):
            raise ValueError(f"{where} has no list of snapshots")
        for snapshot in attempt["snapshots"]:
            if not isinstance(snapshot, dict) or not _count(snapshot.get("step")):
                raise ValueError(f"{where}'s snapshot {json.dumps(snapshot)[:40]} has no step")
            _categories(snapshot.get("seconds"), f"{where}'s snapshot of step {snapshot['step']}")
    return record


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} is {value!r}, not a number of seconds >= 0")
    return value


def _categories(seconds, what: str) -> None:
    if not isinstance(seconds, dict):
        raise ValueError(f"{what} is {json.dumps(seconds)[:40]}, not seconds by category")
    if unknown := sorted(set(seconds) - set(CATEGORIES)):
        raise ValueError(f"{what} has categories olmax does not know: {unknown} (known: {', '.join(CATEGORIES)})")
    for category in CATEGORIES:
        _seconds(seconds.setdefault(category, 0.0), f"{what}[{category!r}]")


def _gaps(record: dict):
    """(seconds from an attempt's end to the next one's start, whether that attempt had finished the run)."""
    attempts = record["attempts"]
    for before, after in zip(attempts, attempts[1:]):
        yield max(0.0, after["started"] - before["ended"]), before.get("finished", False)


def totals(record: dict) -> dict[str, float]:
    """Seconds by category over the run's lifetime (every attempt and the time between them, but for the time
    after the run had finished: `between_runs`)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for attempt in record["attempts"]:
        for category, seconds in attempt["seconds"].items():
            out[category] += seconds
    out["between attempts"] += sum(gap for gap, finished in _gaps(record) if not finished)
    return out


def between_runs(record: dict) -> float:
    """Seconds from attempts that finished the run to the attempts that later extended it: not the run's time."""
    return sum(gap for gap, finished in _gaps(record) if finished)


class Goodput:
    """The current attempt's account; `enabled` False (all but process 0) keeps no record."""

    def __init__(self, run_dir: Path, started: float | None = None, enabled: bool = True):
        self.path, self.enabled = RunDir(run_dir).goodput, enabled
        self.record = {"attempts": []}
        if enabled and self.path.exists():
            try:
                self.record = read_record(self.path.read_text())
            except ValueError as err:  # written by something else, or torn outside olmax's atomic replace
                aside = set_aside(self.path)
                log.warning("%s cannot be accounted for (%s): kept as %s; the run's goodput record starts again "
                            "with this attempt", self.path, err, aside)
        now = time.time()
        self.last, self.started_with_process = now if started is None else started, started is not None
        self.attempt = {"started": self.last, "ended": now, "seconds": dict.fromkeys(CATEGORIES, 0.0),
                        "first_step": None, "last_step": None, "snapshots": []}
        launcher_started = os.environ.get(LAUNCHER_STARTED) if started is not None else None
        if launcher_started:  # this process is `olmax launch`'s first attempt: the attempt began with the launcher
            self.attempt["started"] = float(launcher_started)
            self.attempt["seconds"]["launcher start-up"] = max(0.0, started - float(launcher_started))
        self.record["attempts"].append(self.attempt)
        self._logged = totals(self.record)

    def mark(self, category: str) -> None:
        """The wall time since the previous mark went to `category`."""
        now = time.time()
        self.attempt["seconds"][category] += now - self.last
        self.last = self.attempt["ended"] = now

    def resumed(self, step: int) -> None:
        """The loop starts after `step` (restored, or 0): start-up ends, and earlier attempts' work after
        their last checkpoint at or before `step` is lost work."""
        self.mark("start-up")
        for attempt in self.record["attempts"][:-1]:
            if attempt.get("settled"):
                continue
            snapshots = [s for s in attempt["snapshots"] if s["step"] <= step]
            if snapshots:
                kept = snapshots[-1]
                for category in WORK:
                    lost = attempt["seconds"][category] - kept["seconds"][category]
                    attempt["seconds"][category] -= lost
                    attempt["seconds"]["lost work"] += lost
                attempt["lost_steps"] = max(0, (attempt["last_step"] or kept["step"]) - kept["step"])
            attempt["settled"] = True
        self.attempt["first_step"] = step
        self.saved(step)

    def saved(self, step: int) -> None:
        """A checkpoint of `step` was started (the step's stall for it ends now)."""
        self.mark("checkpoint")
        snapshots = self.attempt["snapshots"] + [{"step": step, "seconds": dict(self.attempt["seconds"])}]
        # the first (where the attempt started) and the latest few
        self.attempt["snapshots"] = snapshots[:1] + snapshots[1:][-(KEPT_SNAPSHOTS - 1):]

    def finished(self) -> None:
        """The attempt trained the run to its last step: a later attempt extends a finished run."""
        self.attempt["finished"] = True

    def step_done(self, step: int) -> None:
        self.mark("productive")
        self.attempt["last_step"] = step
        self.persist()
        self.mark("productive")  # the write itself: the step's bookkeeping, not the next step's wait for its batch

    def metrics(self) -> dict[str, float]:
        """`goodput/{category} (s)` over the run's lifetime, `goodput/step/{category} (s)` since the previous
        call, and `goodput/goodput (%)`: productive seconds over wall seconds."""
        now = totals(self.record)
        wall = sum(now.values())
        out = {f"goodput/{c} (s)": now[c] for c in CATEGORIES}
        out |= {f"goodput/step/{c} (s)": now[c] - self._logged[c] for c in CATEGORIES}
        out["goodput/goodput (%)"] = 100.0 * now["productive"] / wall if wall else 0.0
        self._logged = now
        return out

    def close(self) -> None:
        """The attempt's end: its record now, and again as the process exits when the process was started for
        this run (`started` given), so that the run's last seconds are counted too."""
        self.mark("shutdown")
        self.persist()
        if self.enabled and self.started_with_process:
            _AT_EXIT.append(self)

    def _at_exit(self) -> None:
        self.mark("shutdown")
        with contextlib.suppress(OSError, DiskFull, RunDirError):  # said when the run stopped
            self.persist()

    def persist(self) -> None:
        if not self.enabled:
            return
        replace_own(self.path, json.dumps(self.record))  # a crash leaves the old record or the new one


def report(record: dict) -> str:
    """The table `olmax goodput` prints: the lifetime's seconds by category, then one line per attempt."""
    total = totals(record)
    wall = sum(total.values())
    lines = [f"{'category':18}{'seconds':>12}{'share':>9}"]
    lines += [f"{c:18}{total[c]:12,.1f}{100 * total[c] / wall if wall else 0:8.1f}%" for c in CATEGORIES]
    lines.append(f"{'wall time':18}{wall:12,.1f}")
    if apart := between_runs(record):
        lines.append(f"{'between runs':18}{apart:12,.1f}  (after the run had finished, before it was extended; "
                     "not in the wall time)")
    lines += ["", f"{'attempt':>7}{'steps':>14}{'seconds':>12}{'productive':>12}"
              f"{'lost':>10}{'steps redone':>14}"]
    for number, attempt in enumerate(record["attempts"], start=1):
        steps = f"{attempt['first_step']}-{attempt['last_step']}" if attempt["last_step"] is not None else "-"
        lines.append(f"{number:7}{steps:>14}{sum(attempt['seconds'].values()):12,.1f}"
                     f"{attempt['seconds']['productive']:12,.1f}{attempt['seconds']['lost work']:10,.1f}"
                     f"{attempt.get('lost_steps', 0):14}")
    return "\n".join(lines)


def plot(record: dict, path, title: str) -> None:
    """A PNG of the run's lifetime: each attempt (and the gap before it) as a bar split by category; the gap after
    a finished run, before its extension, pale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attempts = record["attempts"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(attempts)))
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors)) | {"between runs": "#e4e4e4"}
    origin = attempts[0]["started"] if attempts else 0.0
    drawn = set()
    for row, attempt in enumerate(attempts):
        left = attempt["started"] - origin
        if row:
            gap = max(0.0, attempt["started"] - attempts[row - 1]["ended"])
            apart = attempts[row - 1].get("finished", False)
            segments = [("between runs" if apart else "between attempts", gap)] + list(attempt["seconds"].items())
            left -= gap
        else:
            segments = list(attempt["seconds"].items())
        for category, seconds in segments:
            if seconds > 0:
                ax.barh(row, seconds, left=left, color=colors[category],
                        label=None if category in drawn else category)
                drawn.add(category)
                left += seconds
    ax.set_yticks(range(len(attempts)), [f"attempt {i}" for i in range(1, len(attempts) + 1)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    total = totals(record)
    wall = sum(total.values())
    ax.set_title(f"{title}: goodput {100 * total['productive'] / wall if wall else 0:.1f}% of {wall:,.0f} s")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
