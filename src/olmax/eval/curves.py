"""Step-aligned comparison of two metric curves: runs (TensorBoard events or metrics.jsonl) or a
published curve (TSV of step<TAB>value).

Only the steps both curves have count. They are cut into windows of `window`
steps ([k * window, (k + 1) * window)); each window gives the mean of A, the
mean of B over the same steps, and delta = B - A; the smoothed delta at a
window is the mean delta of the windows whose centres lie within `smooth` / 2
steps of its own (MaxText's OLMo 3 comparison used 2k-step windows, 18k smoothing). Summary statistics
are given for the whole span and for each requested step range. With
window = 1 the deltas are per step: a resume A/B wants max |delta| = 0.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmax import storage

from olmax.errors import EvalError
from olmax.run_dir import RunDir

EVENT_GLOB = "events.out.tfevents.*"


@dataclass
class Curve:
    name: str
    steps: np.ndarray  # int64, increasing
    values: np.ndarray  # float64


def _from_points(name: str, points: dict[int, float]) -> Curve:
    steps = np.array(sorted(points), dtype=np.int64)
    return Curve(name, steps, np.array([points[s] for s in steps.tolist()], dtype=np.float64))


def tensorboard_tag(metric: str) -> str:
    """The tag tensorboardX stores a metric under (it turns spaces and other characters into `_`)."""
    from tensorboardX.summary import _clean_tag

    return _clean_tag(metric)


def read_events(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the scalar events in a directory's event files, in file order. A later value
    of a step wins; a restart's purge marker (tensorboardX `purge_step`) drops the steps at and after it,
    as TensorBoard does."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(directory.glob(EVENT_GLOB)):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            record = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            if len(record) < length:
                break  # a record cut short by a crash: the rest of the file is unreadable
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for points in scalars.values():
                    for step in [s for s in points if s >= event.step]:
                        del points[step]
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def _read_jsonl(path: Path, metric: str) -> dict[int, float]:
    points, seen = {}, set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise EvalError(f"{path}:{number}: not JSON") from None
        seen.update(row)
        if metric in row and "step" in row:
            points[int(row["step"])] = float(row[metric])
    if not points:
        raise EvalError(f"{path} has no {metric!r}; its metrics: {sorted(seen - {'step', 'wall_time'})}")
    return points


def _read_table(path: Path, metric: str) -> dict[int, float]:
    """step<TAB>value lines (a published curve); `#` comments; an optional header line, whose column named
    `metric` is read when there are several value columns (else the second column)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    split = lambda ln: ln.split("\t") if "\t" in ln else ln.split(",") if "," in ln else ln.split()
    column = 1
    if lines and not split(lines[0])[0].strip().lstrip("-").isdigit():
        header = [h.strip() for h in split(lines.pop(0))]
        if metric in header:
            column = header.index(metric)
    points = {}
    for number, line in enumerate(lines, start=1):
        fields = split(line)
        try:
            points[int(float(fields[0]))] = float(fields[column])
        except (ValueError, IndexError):
            raise EvalError(f"{path}: line {line!r} is not `step<TAB>value`") from None
    if not points:
        raise EvalError(f"{path} holds no `step<TAB>value` lines")
    return points


def read_curve(source: str | Path, metric: str) -> Curve:
    """A run directory (its tensorboard/ events, else metrics.jsonl), a directory of event files, a
    .jsonl file, or a table of step and value (.tsv, .csv, .txt); local or in a bucket."""
    if storage.is_remote(source):
        return _read_remote_curve(str(source), metric)
    path = Path(source)
    if not path.exists():
        raise EvalError(f"{path} does not exist; give a run directory, event directory, JSONL or TSV")
    if path.is_dir():
        run = RunDir(path)
        events = run.tensorboard if list(run.tensorboard.glob(EVENT_GLOB)) else path
        if list(events.glob(EVENT_GLOB)):
            scalars = read_events(events)
            for tag in (metric, tensorboard_tag(metric)):
                if tag in scalars:
                    return _from_points(str(source), scalars[tag])
            raise EvalError(f"{events} has no scalar {metric!r}; its tags: {sorted(scalars)}")
        if run.metrics.is_file():
            return _from_points(str(source), _read_jsonl(run.metrics, metric))
        raise EvalError(f"{path} holds neither TensorBoard event files nor metrics.jsonl")
    if path.suffix == ".jsonl":
        return _from_points(str(source), _read_jsonl(path, metric))
    return _from_points(str(source), _read_table(path, metric))


def parse_ranges(text: str | None) -> list[tuple[int, int]]:
    """`lo:hi,lo:hi` (hi may be empty: no end) -> [(lo, hi)]."""
    if not text:
        return []
    ranges = []
    for part in text.split(","):
        lo, sep, hi = part.partition(":")
        if not sep or not lo.strip().isdigit() or (hi.strip() and not hi.strip().isdigit()):
            raise EvalError(f"step range {part!r}: write lo:hi (e.g. 0:100000,100000:)")
        ranges.append((int(lo), int(hi) if hi.strip() else np.iinfo(np.int64).max))
    return ranges


def _stats(windows: dict, step_delta: np.ndarray, pick: np.ndarray, step_pick: np.ndarray) -> dict:
    d, smoothed, n = windows["delta"][pick], windows["smoothed_delta"][pick], int(step_pick.sum())
    per_step = step_delta[step_pick]
    return {
        "windows": int(pick.sum()),
        "steps": n,
        "delta_mean": float(d.mean()) if d.size else None,
        "delta_mean_abs": float(np.abs(d).mean()) if d.size else None,
        "delta_max_abs": float(np.abs(d).max()) if d.size else None,
        "smoothed_delta_min": float(smoothed.min()) if d.size else None,
        "smoothed_delta_max": float(smoothed.max()) if d.size else None,
        "smoothed_delta_last": float(smoothed[-1]) if d.size else None,
        "step_delta_mean_abs": float(np.abs(per_step).mean()) if n else None,
        "step_delta_max_abs": float(np.abs(per_step).max()) if n else None,
    }


def _smoothed(index: np.ndarray, delta: np.ndarray, radius: int) -> np.ndarray:
    """Mean of the deltas of the windows within `radius` windows of each (windows with no common step
    are absent, not zero)."""
    position = index - index[0]
    dense = np.zeros(position[-1] + 1)
    present = np.zeros(position[-1] + 1)
    dense[position], present[position] = delta, 1.0
    total, count = np.concatenate([[0.0], np.cumsum(dense)]), np.concatenate([[0.0], np.cumsum(present)])
    lo, hi = np.maximum(position - radius, 0), np.minimum(position + radius + 1, len(dense))
    return (total[hi] - total[lo]) / (count[hi] - count[lo])


WINDOW, SMOOTH = 2000, 18000  # steps: the MaxText reproduction's (https://github.com/AI-Hypercomputer/maxtext/pull/3886) windowed means and smoothing of their delta
MIN_WINDOWS = 20  # windows a comparison gets at least, where WINDOW would give fewer


def default_window(a: Curve, b: Curve) -> int:
    """WINDOW, shrunk on runs sharing fewer than MIN_WINDOWS x WINDOW steps, so that a short run gives a curve,
    not one point (the smoothing follows: SMOOTH / WINDOW windows)."""
    shared = np.intersect1d(a.steps, b.steps)
    span = int(shared[-1] - shared[0]) + 1 if shared.size else 1
    return max(1, min(WINDOW, span // MIN_WINDOWS))


def compare(a: Curve, b: Curve, *, window: int, smooth: int = 0, ranges: list[tuple[int, int]] = ()) -> dict:
    """{"windows": columns of the window table, "summary": {"all": stats, "lo:hi": stats, ...}}."""
    if window < 1 or smooth < 0:
        raise EvalError(f"window must be >= 1 and smooth >= 0 (got {window}, {smooth})")
    steps, ia, ib = np.intersect1d(a.steps, b.steps, assume_unique=True, return_indices=True)
    if not steps.size:
        raise EvalError(f"{a.name} (steps {a.steps[0]}..{a.steps[-1]}) and {b.name} (steps {b.steps[0]}.."
                        f"{b.steps[-1]}) share no step; a comparison is step-aligned")
    va, vb = a.values[ia], b.values[ib]
    index, start = np.unique(steps // window, return_inverse=True)
    count = np.bincount(start).astype(np.float64)
    mean_a = np.bincount(start, va) / count
    mean_b = np.bincount(start, vb) / count
    delta = mean_b - mean_a
    windows = {
        "window_start": index * window, "window_end": (index + 1) * window - 1, "steps": count.astype(np.int64),
        "mean_step": np.bincount(start, steps) / count,
        "mean_a": mean_a, "mean_b": mean_b, "delta": delta, "smoothed_delta": _smoothed(index, delta, smooth // 2 // window),
    }
    step_delta = vb - va
    summary = {"all": _stats(windows, step_delta, np.ones(len(index), bool), np.ones(len(steps), bool))}
    for lo, hi in ranges:
        name = f"{lo}:{'' if hi == np.iinfo(np.int64).max else hi}"
        summary[name] = _stats(windows, step_delta, (windows["window_start"] >= lo) & (windows["window_start"] < hi),
                               (steps >= lo) & (steps < hi))
    return {"a": a.name, "b": b.name, "window": window, "smooth": smooth, "windows": windows, "summary": summary}


def window_table(result: dict) -> str:
    w = result["windows"]
    lines = ["window_start\twindow_end\tsteps\tmean_a\tmean_b\tdelta\tsmoothed_delta"]
    for i in range(len(w["delta"])):
        values = (float(w[k][i]) for k in ("mean_a", "mean_b", "delta", "smoothed_delta"))
        lines.append("\t".join([str(int(w["window_start"][i])), str(int(w["window_end"][i])), str(int(w["steps"][i])),
                                 *map(repr, values)]))
    return "\n".join(lines) + "\n"


def plot(a: Curve, b: Curve, result: dict, metric: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = result["windows"]
    centres = w["mean_step"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for curve, means, colour in ((a, w["mean_a"], "tab:blue"), (b, w["mean_b"], "tab:orange")):
        top.plot(curve.steps, curve.values, color=colour, alpha=0.25, linewidth=0.6)
        top.plot(centres, means, color=colour, linewidth=1.6, label=f"{curve.name} ({result['window']}-step means)")
    top.set_ylabel(metric)
    top.legend(fontsize=8)
    bottom.axhline(0.0, color="black", linewidth=0.6)
    bottom.plot(centres, w["delta"], ".", color="tab:gray", markersize=3, label="windowed delta (B - A)")
    bottom.plot(centres, w["smoothed_delta"], color="tab:red", linewidth=1.6,
                label=f"smoothed over {result['smooth']} steps")
    bottom.set_xlabel("step")
    bottom.set_ylabel("delta")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _read_remote_curve(url: str, metric: str) -> Curve:
    """A bucket's run directory or file, read from a local copy of its metrics only (never its checkpoints)."""
    with tempfile.TemporaryDirectory(prefix="olmax-curve-") as local:
        copy = Path(local) / storage.basename(url)
        if storage.is_dir(url):
            for name in RunDir.METRIC_FILES:
                if storage.exists(RunDir(url).path(name)):
                    storage.download(RunDir(url).path(name), RunDir(copy).path(name))
            copy.mkdir(exist_ok=True)
        else:
            storage.download(url, copy)
        return dataclasses.replace(read_curve(copy, metric), name=url)
