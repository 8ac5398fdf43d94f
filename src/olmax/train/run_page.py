"""A run's page (`olmax report RUN`): one self-contained HTML file (inline SVG, no script, nothing fetched; olmax.pages)
of what a run directory, local or in a bucket, holds: loss, LR, grad norm and throughput against step and against
wall time, with restarts, checkpoints and skipped steps marked; held-out loss per domain; the goodput breakdown;
for an MoE the true load of each layer (its busiest expert over the mean, as logged) as a heatmap over the steps;
the config and the commands to resume, evaluate and convert. Beside it: report.json (the figures shown) and
config.yaml (the resolved config of the newest checkpoint, which `olmax train` resumes from).

Fast on long runs: metrics.jsonl is read for the few metrics drawn (a regular expression a metric over the file,
not a JSON parse a record: 500,000 records of a dense run are about 0.6 GB), and every curve is drawn at most a
point pair a pixel: the minimum and maximum of the steps that fall in it, so a spike of one step stays visible.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import re

import numpy as np
import yaml

from olmax import storage
from olmax.errors import BadInput
from olmax.pages import document, fact, table
from olmax.run_dir import RunDir, write_files
from olmax.train.goodput import CATEGORIES, COMPILED, between_runs, read_record, totals

THROUGHPUT = "throughput/device/TPS"
CURVES = [("loss", "train/CE loss"), ("LR", "optim/LR (group 0)"), ("grad norm", "optim/total grad norm"),
          ("throughput", THROUGHPUT)]
WIDTH, HEIGHT, LEFT, BOTTOM = 560, 170, 62, 22  # a chart's size and its axes' margins, in pixels
# the keys not every run logs, found in one pass: held-out losses and an MoE's per-layer load
OPTIONAL = re.compile(rb'"(eval/lm/(?:[^"\\]|\\.)*/CE loss|train/block \d+/load imbalance)": ')
GOODPUT_COLOURS = dict(zip(CATEGORIES, ["#bab0ac", "#9c755f", "#f28e2b", "#59a14f", "#edc948", "#76b7b2", "#4e79a7",
                                        "#b07aa1", "#e15759", "#ff9da7"]))


class Metrics:
    """The columns of metrics.jsonl the page draws. A last line that is not a whole record is what a run killed
    mid-write leaves: it is left out, as a resume leaves it out. Any other line that is not a record olmax wrote,
    and any step or drawn value that is not a JSON number as olmax writes it (a step: an integer from 0), is
    BadInput naming the line and the value."""

    def __init__(self, data: bytes, source: str = RunDir.metrics.name):
        self.source = source
        data, self.torn = _without_torn_end(data)
        self.data = self._respelled(data)
        raw = RECORD.findall(self.data)  # `{"step": ` is only ever at a line's start (in a string its " is \")
        text = np.frombuffer(self.data, np.uint8)
        ends = np.flatnonzero(text == ord("\n"))
        self.starts = np.r_[0, ends[:-1] + 1].astype(np.int64) if len(ends) else np.zeros(0, np.int64)
        starting = text[np.minimum(self.starts[:, None] + np.arange(len(RECORD_START)), len(text) - 1)]
        # every line a JSON object that starts with its step (a JSON object holds no newline)
        if len(raw) != len(ends) or not (text[ends - 1] == ord("}")).all() or \
                not (starting == np.frombuffer(RECORD_START, np.uint8)).all():
            number = next(i for i, line in enumerate(self.data.split(b"\n"))
                          if not (line.startswith(RECORD_START) and line.endswith(b"}")
                                  and line.count(RECORD_START) == 1))
            self.refuse(number, "is not a record olmax wrote (one JSON object a line, starting with its step)")
        if b"" in raw:  # a step that is not a JSON integer from 0 of at most 15 digits
            bad = raw.index(b"")
            self.refuse(bad, f"has step {_value_at(self.data, self.starts[bad] + len(RECORD_START))}, not a step "
                        "number")
        self.steps = np.array(raw).astype(np.int64) if raw else np.zeros(0, np.int64)
        self.optional = sorted({json.loads(b'"' + key + b'"') for key in OPTIONAL.findall(self.data)})
        self._columns = {}

    def _respelled(self, data: bytes) -> bytes:
        """`data` with each line that holds an escape or a character beyond ASCII written again as olmax writes
        it (json.dumps): its keys are compared decoded, so that "train\\/CE loss" is checked as train/CE loss.
        Such a line that is not JSON is refused. Other lines are read as they are: an escape is rare."""
        if b"\\" not in data and data.isascii():
            return data
        text = np.frombuffer(data, np.uint8)
        ends = np.flatnonzero(text == ord("\n"))
        odd = text >= 0x80
        odd |= text == ord("\\")
        pieces, done = [], 0
        for line in np.unique(np.searchsorted(ends, np.flatnonzero(odd))):
            start, end = (ends[line - 1] + 1 if line else 0), ends[line]
            try:
                record = json.loads(data[start:end])
            except (ValueError, RecursionError) as err:
                self.refuse(line, f"is not JSON ({type(err).__name__}: {str(err)[:80]})")
            pieces += [data[done:start], json.dumps(record).encode()]
            done = end
        return b"".join([*pieces, data[done:]])

    def refuse(self, record: int, what: str):
        raise BadInput(f"{self.source} line {record + 1} {what}; correct or remove that line (a page is drawn "
                       "only from what olmax train writes)")

    def column(self, name: str) -> np.ndarray:
        """The metric's value at every step (NaN where a record lacks it), read once: each read is a pass over
        the whole file, the page's cost on a long run."""
        if name not in self._columns:
            self._columns[name] = self._read_column(name)
        return self._columns[name][0]

    def sparse(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(record indices, values) of the records that have the metric."""
        self.column(name)
        index, values = self._columns[name][1:]
        return index, values

    def _read_column(self, name: str):
        spelled = json.dumps(name)[1:-1]  # as olmax writes it, and every line is (_respelled)
        key = re.compile(b'"' + re.escape(spelled.encode()) + b'": ((?:' + NUMBER + b")(?=[,}])|)")
        values = key.findall(self.data)  # b"": a value that is not a JSON number
        in_every_record = len(values) == len(self.steps)  # then in record order
        index = np.arange(len(values)) if in_every_record or not values else \
            np.searchsorted(self.starts, [m.start() for m in key.finditer(self.data)], side="right") - 1
        if b"" in values:
            bad = values.index(b"")
            at = next(itertools.islice(key.finditer(self.data), bad, None)).end()
            self.refuse(int(index[bad]), f"has {spelled} {_value_at(self.data, at)}, not a number")
        numbers = np.array(values).astype(np.float64)
        if in_every_record:
            return numbers, index, numbers
        out = np.full(len(self.steps), np.nan)
        out[index] = numbers
        return out, index, numbers


RECORD_START = b'{"step": '
# JSON's numbers (no leading zero, no sign but a minus, no point without digits either side) and the NaN, Infinity
# and -Infinity of Python's json; a step: a JSON integer from 0 of at most 15 digits. Each read where its value
# ends: b"" where there is no such number.
NUMBER = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|NaN|-?Infinity"
RECORD = re.compile(re.escape(RECORD_START) + rb"((?:0|[1-9][0-9]{0,14})(?=[,}])|)")


def _without_torn_end(data: bytes) -> tuple[bytes, bool]:
    """`data` without a last line that is not a whole record (what a kill mid-write leaves), each line ended by a
    newline; and whether such a line was left out."""
    if not data or data.endswith(b"\n"):
        return data, False
    head, _, last = data.rpartition(b"\n")
    head = head + b"\n" if head else b""
    try:
        whole = isinstance(json.loads(last)["step"], int)
    except (ValueError, KeyError, TypeError):
        whole = False
    return (head + last + b"\n", False) if whole else (head, True)


def _value_at(data: bytes, at: int, most: int = 60) -> str:
    """The value written at byte `at` of a line, for an error's one line: a JSON value whole (a list with its
    commas), else what stands up to the line's next key or its end; at most `most` characters, escaped."""
    line = data[at:data.index(b"\n", at)].decode(errors="replace")
    try:
        length = json.JSONDecoder().raw_decode(line)[1]
    except (ValueError, RecursionError):
        length = 0
    if line[length:length + 1] not in (",", "}"):  # not a JSON value (0005: a 0, then digits)
        length = next((i for i in (line.find(', "'), len(line) - 1) if i >= 0))
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in line[:length])
    return text if len(text) <= most else text[:most - 3] + "..."


def envelope(x: np.ndarray, y: np.ndarray, x_range: tuple[float, float], width: int):
    """(pixel column, lowest y, highest y) of each column of `width` the finite points fall in."""
    ok = np.isfinite(y) & np.isfinite(x)
    x, y = x[ok], y[ok]
    if not len(x):
        return np.zeros(0, int), np.zeros(0), np.zeros(0)
    span = max(x_range[1] - x_range[0], 1e-12)
    columns = np.clip(((x - x_range[0]) / span * (width - 1)).astype(np.int64), 0, width - 1)
    order = np.argsort(columns, kind="stable")
    columns, y = columns[order], y[order]
    starts = np.flatnonzero(np.r_[True, columns[1:] != columns[:-1]])
    return columns[starts], np.minimum.reduceat(y, starts), np.maximum.reduceat(y, starts)


TIME_UNITS = ((3600.0, "hours"), (60.0, "minutes"), (1.0, "seconds"))
GAP = 5  # a pause this many times the median interval between two logged points breaks the curve


def time_unit(span_seconds: float) -> tuple[float, str]:
    """(seconds a unit, its name) for a time axis over `span_seconds`: hours from 2 hours, minutes from 2
    minutes, else seconds."""
    return next(((scale, unit) for scale, unit in TIME_UNITS if span_seconds >= 2 * scale), TIME_UNITS[-1])


def ticks(low: float, high: float, most: int = 5) -> tuple[float, list[float]]:
    """(step, ticks): the multiples of a round step (1, 2, 2.5 or 5 times a power of ten) from the last one at or
    below `low` to the first one at or above `high`, 3 to `most` of them."""
    low, high = max(low, -1e300), min(high, 1e300)  # their difference a float too
    if not high > low:  # a flat curve: a range around its value
        pad = abs(low) * 0.05 or 1.0
        low, high = low - pad, high + pad
    magnitude = 10.0 ** math.floor(math.log10((high - low) / (most - 1)))
    for multiple in (1, 2, 2.5, 5, 10, 20):
        step = multiple * magnitude
        first, last = math.floor(low / step), math.ceil(high / step)
        if last - first < most:
            break
    return step, [k * step for k in range(first, last + 1)]


def tick_label(value: float, step: float) -> str:
    """`value` with the decimals the ticks' `step` needs to tell them apart."""
    decimals = max(0, math.ceil(-math.log10(step) - 1e-9))
    decimals += round(step * 10 ** decimals, 6) % 1 != 0  # a step of 2.5 x 10^k needs one more
    return f"{value:,.{decimals}f}"


def gap_starts(x: np.ndarray, y: np.ndarray, restarts: list[float]) -> np.ndarray:
    """The x values of the points that follow a gap: a restart, or a pause between two logged points over GAP
    times their median interval (a checkpoint's write, an evaluation, a stalled step)."""
    xs = np.sort(x[np.isfinite(x) & np.isfinite(y)])
    if len(xs) < 2:
        return xs[:0]
    intervals = np.diff(xs)
    paused = xs[1:][intervals > GAP * np.median(intervals)] if np.median(intervals) > 0 else xs[:0]
    after = xs[np.minimum(np.searchsorted(xs, restarts, side="right"), len(xs) - 1)]
    return np.union1d(paused, after)


def chart(name: str, x: np.ndarray, y: np.ndarray, x_label: str, marks: dict[str, list[float]]) -> str:
    """An SVG line chart of y against x, drawn as each pixel column's minimum and maximum and broken at gaps
    (`gap_starts`), on 3 to 5 labelled y ticks with gridlines, with marks: restarts (dashed lines), checkpoints
    (triangles along the top) and skipped steps (ticks up from the axis), each a list of x values."""
    plot = WIDTH - LEFT - 8
    finite = np.isfinite(x)
    x_range = (float(x[finite].min()), float(x[finite].max())) if finite.any() else (0.0, 1.0)
    x_span = max(x_range[1] - x_range[0], 1e-12)
    columns, low, high = envelope(x, y, x_range, plot)
    breaks = set(((gap_starts(x, y, marks.get("restart", [])) - x_range[0]) / x_span * (plot - 1))
                 .astype(np.int64).tolist())
    y_step, y_ticks = ticks(float(low.min()), float(high.max())) if len(columns) else ticks(0.0, 1.0)
    y_low, y_span = y_ticks[0], y_ticks[-1] - y_ticks[0]
    bottom = HEIGHT - BOTTOM

    def py(value):
        return 8 + (bottom - 8) * (1 - (value - y_low) / y_span)

    def px(value):
        return LEFT + plot * (value - x_range[0]) / x_span

    path = "".join(f"{'L' if i and c not in breaks else 'M'}{LEFT + c:.0f} {py(lo):.1f}L{LEFT + c:.0f} {py(hi):.1f}"
                   for i, (c, lo, hi) in enumerate(zip(columns, low, high)))
    parts = []
    for value in y_ticks:
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - 8}" y1="{py(value):.1f}" y2="{py(value):.1f}" '
                     f'stroke="#e6e6e6"/><text x="{LEFT - 4}" y="{py(value) + 4:.1f}" text-anchor="end">'
                     f"{tick_label(value, y_step)}</text>")
    x_step, x_ticks = ticks(*x_range, most=7)
    for value in x_ticks:
        if x_range[0] <= value <= x_range[1] and px(value) < WIDTH - 36 - 6 * len(x_label):  # clear of the unit
            parts.append(f'<line class="axis-tick" x1="{px(value):.1f}" x2="{px(value):.1f}" y1="{bottom}" '
                         f'y2="{bottom + 4}" stroke="#888"/><text x="{px(value):.1f}" y="{HEIGHT - 6}" '
                         f'text-anchor="middle">{tick_label(value, x_step)}</text>')
    parts += [f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - 8}" y2="{bottom}" stroke="#888"/>',
              f'<line x1="{LEFT}" y1="8" x2="{LEFT}" y2="{bottom}" stroke="#888"/>',
              f'<text x="{WIDTH - 8}" y="{HEIGHT - 6}" text-anchor="end">{html.escape(x_label)}</text>']
    for kind, values in marks.items():
        for value in values:
            at = px(value)
            if kind == "checkpoint":
                parts.append(f'<path class="checkpoint" d="M{at - 4:.1f} 8h8l-4 7z" fill="#59a14f"/>')
            elif kind == "skipped":
                parts.append(f'<line class="skipped" x1="{at:.1f}" x2="{at:.1f}" y1="{bottom - 10}" y2="{bottom}" '
                             'stroke="#e6a100" stroke-width="2"/>')
            else:
                parts.append(f'<line class="restart" x1="{at:.1f}" x2="{at:.1f}" y1="8" y2="{bottom}" '
                             'stroke="#c62828" stroke-dasharray="4 3"/>')
    parts.append(f'<path class="curve" d="{path}" fill="none" stroke="#4e79a7" stroke-width="1"/>')
    return (f'<svg class="chart" data-metric="{html.escape(name)}" data-x="{html.escape(x_label)}" '
            f'data-columns="{len(columns)}" data-breaks="{len(breaks & set(columns[1:].tolist()))}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" aria-label="{html.escape(name)} against {html.escape(x_label)}">'
            f'{"".join(parts)}</svg>')


def heatmap(layers: list[int], values: np.ndarray, steps: np.ndarray) -> str:
    """Layers (rows) by steps (columns: at most a pixel column each, the highest value of the steps in it)."""
    plot, row = WIDTH * 2 - LEFT - 8, 14
    cells, top = [], float(np.nanmax(values)) if np.isfinite(values).any() else 1.0
    for i, layer in enumerate(layers):
        columns, _, high = envelope(steps.astype(np.float64), values[i], (float(steps[0]), float(steps[-1])),
                                    min(plot, len(steps)))
        width = plot / min(plot, len(steps))
        for c, value in zip(columns, high):
            share = 0.0 if top <= 1 else (value - 1) / (top - 1)  # 1: every expert as busy as the mean
            cells.append(f'<rect class="cell" x="{LEFT + c * width:.2f}" y="{8 + i * row}" width="{width + 0.3:.2f}" '
                         f'height="{row - 1}" fill="hsl({round(220 - 220 * share)},70%,{round(88 - 40 * share)}%)">'
                         f"<title>layer {layer}: {value:.3f}</title></rect>")
        cells.append(f'<text x="{LEFT - 4}" y="{8 + i * row + 11}" text-anchor="end">layer {layer}</text>')
    height = 8 + len(layers) * row + 20
    columns = min(plot, len(steps))
    cells.append(f'<text x="{LEFT}" y="{height - 4}">step {steps[0]}</text><text x="{LEFT + plot}" y="{height - 4}" '
                 f'text-anchor="end">step {steps[-1]}</text>')
    return (f'<svg class="heatmap" data-layers="{len(layers)}" data-columns="{columns}" data-steps="{len(steps)}" '
            f'width="{WIDTH * 2}" height="{height}">{"".join(cells)}</svg>'
            f'<p class="note">Colour: the layer\'s busiest expert over the mean (1, pale: even) up to '
            f"{top:.2f} (dark), the highest of the steps in each column.</p>")


def _read(path) -> bytes | None:
    try:
        return storage.read_bytes(str(path))
    except (OSError, ValueError):  # a StorageError is a ValueError
        return None


def gather(location: str) -> dict:
    """What the page shows of the run at `location`, from its files; BadInput naming a file that is not what
    olmax writes there."""
    run = RunDir(location)
    metrics = Metrics(_read(run.metrics) or b"", str(run.metrics))
    goodput = _read(run.goodput)
    try:
        goodput = read_record(goodput.decode(errors="replace")) if goodput else None
    except ValueError as err:
        raise BadInput(f"{run.goodput} is not a goodput record olmax wrote ({err}); move it away to draw the page "
                       "without it") from None
    checkpoints = run.committed_steps()
    meta = _read(run.checkpoint_meta(checkpoints[-1])) if checkpoints else None
    try:
        config = json.loads(meta)["config"] if meta else None
        if config is not None and not isinstance(config, dict):
            raise TypeError("its config is not a mapping")
    except (ValueError, KeyError, TypeError) as err:
        raise BadInput(f"{run.checkpoint_meta(checkpoints[-1])} is not checkpoint metadata olmax wrote "
                       f"({type(err).__name__}: {str(err)[:80]}); the checkpoint is damaged: remove it") from None
    return {"run": str(run.location), "metrics": metrics, "goodput": goodput, "committed_steps": checkpoints,
            "config": config}


def _last(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if len(finite) else None


def report(facts: dict) -> dict:
    """The page's report.json: the figures shown."""
    metrics, steps, goodput = facts["metrics"], facts["metrics"].steps, facts["goodput"]
    attempts = goodput["attempts"] if goodput else []
    out = {"run": facts["run"], "steps_logged": int(len(steps)),
           "first_step": int(steps[0]) if len(steps) else None, "last_step": int(steps[-1]) if len(steps) else None,
           "committed_steps": facts["committed_steps"], "attempts": len(attempts),
           "restarts": [{"step": a["first_step"], "time": a["started"]} for a in attempts[1:]],
           "torn_last_line": metrics.torn}
    if len(steps):
        skipped = metrics.column("optim/step skipped")
        out["skipped_steps"] = [int(s) for s in steps[skipped == 1]]
        out["compiled_steps"] = [int(s) for s in steps[metrics.column(COMPILED) == 1]]
        out["last"] = {label: _last(metrics.column(name)) for label, name in CURVES}
    if goodput:
        total = totals(goodput)
        out["goodput"] = {"seconds": total, "productive_share": total["productive"] / (sum(total.values()) or 1),
                          "between_runs": between_runs(goodput)}
    return out


def _marks(facts: dict, r: dict, steps: np.ndarray, time: np.ndarray | None) -> tuple[dict, dict]:
    """The marks of the step charts and of the wall-time charts (`time`: seconds since the first record)."""
    every = ((facts["config"] or {}).get("checkpoint") or {}).get("every")
    every = every if isinstance(every, int) and every > 0 else None
    last = r["last_step"] or 0
    saved = sorted(set(facts["committed_steps"]) | (set(range(every, last + 1, every)) if every else set()))
    by_step = {"checkpoint": saved, "skipped": r.get("skipped_steps", []),
               "restart": [x["step"] for x in r["restarts"] if x["step"] is not None]}
    if time is None:
        return by_step, {}

    def at(step_list):
        index = np.searchsorted(steps, step_list)
        return [float(time[i]) for i in index if i < len(steps)]

    by_time = {"checkpoint": at(saved), "skipped": at(by_step["skipped"]),
               "restart": [x["time"] - facts["time_origin"] for x in r["restarts"]]}
    return by_step, by_time


def page(facts: dict, r: dict, directory: str) -> str:
    metrics, steps = facts["metrics"], facts["metrics"].steps
    sections = [f"<h1>Run {html.escape(r['run'])}</h1>"]
    if not len(steps):
        sections.append("<p>No step logged yet (metrics.jsonl is empty or missing).</p>")
        return document(f"olmax run {r['run']}", "".join(sections))
    time = metrics.column("wall_time") if b'"wall_time": ' in metrics.data[:4096] else None
    if time is not None and np.isfinite(time).any():
        facts["time_origin"] = float(np.nanmin(time))
        time = time - facts["time_origin"]
        scale, unit = time_unit(float(np.nanmax(time)))
    else:
        time = None
    by_step, by_time = _marks(facts, r, steps, time)
    compiled = r["compiled_steps"]
    torn = (" The last line of metrics.jsonl is not a whole record (a run stopped while writing it): left out, as "
            "a resume leaves it out." if r["torn_last_line"] else "")
    sections.append(
        f"<p>Steps {fact('first_step', r['first_step'])} to {fact('last_step', r['last_step'])} "
        f"({fact('steps_logged', r['steps_logged'])} logged), {fact('attempts', r['attempts'])} attempt(s), "
        f"{len(r['restarts'])} restart(s), {len(r.get('skipped_steps', []))} skipped step(s); committed checkpoints "
        f"{html.escape(', '.join(map(str, r['committed_steps'])) or 'none')}.{torn}</p>"
        '<p class="note">Marks: <span style="color:#c62828">restarts</span> (dashed lines: where an attempt resumed), '
        '<span style="color:#59a14f">checkpoints</span> (triangles along the top) and '
        '<span style="color:#e6a100">skipped steps</span> (thick ticks up from the axis). Each curve is drawn as the '
        "lowest and highest value of the steps in each pixel column, and broken where the run paused: a restart, "
        f"or {GAP} times the usual time between two logged steps (a checkpoint's write, an evaluation).</p>")
    rows = []
    for label, name in CURVES:
        y = metrics.column(name)
        step_chart = chart(f"{label}", steps.astype(np.float64), y, "step", by_step)
        time_chart = chart(f"{label}", time / scale, y, unit,
                           {kind: [v / scale for v in values] for kind, values in by_time.items()}) \
            if time is not None else "<p>No wall times in this metrics.jsonl (written by an older olmax).</p>"
        note = (f'<p class="note">Left out: the step(s) that compiled the train step ({fact("compiled_steps", compiled, ", ".join(map(str, compiled)))}), whose time is '
                "mostly the compile.</p>" if name == THROUGHPUT and compiled else "")
        rows.append(f"<h3>{html.escape(label)} <code>{html.escape(name)}</code></h3>"
                    f'<div style="display:flex;gap:12px">{step_chart}{time_chart}</div>{note}')
    sections.append(f'<section id="curves"><h2>Training</h2>{"".join(rows)}</section>')
    sections.append(_evals(metrics))
    sections.append(_goodput(r))
    sections.append(_expert_load(metrics))
    sections.append(_config_and_commands(facts, r, directory))
    return document(f"olmax run {r['run']}", "".join(s for s in sections if s))


def _evals(metrics: Metrics) -> str:
    labels = [name[len("eval/lm/"):-len("/CE loss")] for name in metrics.optional if name.startswith("eval/lm/")]
    if not labels:
        return ""
    charts = []
    for label in labels:
        index, y = metrics.sparse(f"eval/lm/{label}/CE loss")
        x = metrics.steps[index].astype(np.float64)
        charts.append(f"<h3>{html.escape(label)}</h3>" + chart(f"eval {label}", x, y, "step", {}) +
                      f"<p>last: {y[-1]:.4f} at step {int(x[-1])}</p>")
    return ('<section id="heldout"><h2>Held-out loss per domain</h2><p class="note">The in-loop evaluations\' CE '
            f'loss of each held-out set (eval/lm/LABEL/CE loss).</p>{"".join(charts)}</section>')


def _goodput(r: dict) -> str:
    if "goodput" not in r:
        return ""
    seconds = r["goodput"]["seconds"]
    wall = sum(seconds.values()) or 1.0
    x, bar = 0.0, []
    for category in CATEGORIES:
        w = seconds[category] / wall * 900
        bar.append(f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="24" fill="{GOODPUT_COLOURS[category]}">'
                   f"<title>{html.escape(category)}: {seconds[category]:,.1f} s</title></rect>")
        x += w
    rows = [[f'<span class="swatch" style="background:{GOODPUT_COLOURS[c]}"></span>{html.escape(c)}',
             fact(f"goodput.seconds.{c}", seconds[c], f"{seconds[c]:,.1f}"), f"{seconds[c] / wall:.1%}"]
            for c in CATEGORIES if seconds[c]]
    share, between = r["goodput"]["productive_share"], r["goodput"]["between_runs"]
    apart = (f" Not in it: {fact('goodput.between_runs', between, f'{between:,.1f}')} s between runs, from the end "
             "of an attempt that finished the run to a later one that extended it." if between else "")
    return ('<section id="goodput"><h2>Goodput</h2><p>Productive steps are '
            f"{fact('goodput.productive_share', share, format(share, '.1%'))} of the run's {wall:,.0f} s of wall "
            f"time over its attempts (goodput.json; `olmax goodput RUN`).{apart}</p>"
            f'<svg width="910" height="30">{"".join(bar)}</svg>' + table(["category", "seconds", "of the wall time"],
                                                                        rows, {1, 2}) + "</section>")


def _expert_load(metrics: Metrics) -> str:
    names = sorted((int(name.split()[1].split("/")[0]), name) for name in metrics.optional
                   if name.startswith("train/block "))
    if not names:
        return ""
    layers = [layer for layer, _ in names]
    values = np.stack([metrics.column(name) for _, name in names])
    return ('<section id="expert-load"><h2>Expert load per layer</h2><p class="note">The true load of each global '
            "batch: each MoE layer's busiest expert over the mean expert (train/block NN/load imbalance, from the "
            "tokens per expert counted over the whole batch), step by step.</p>"
            + heatmap(layers, values, metrics.steps) + "</section>")


def _config_and_commands(facts: dict, r: dict, directory: str) -> str:
    run, config = r["run"], facts["config"]
    steps = r["committed_steps"]
    checkpoint = storage.join(str(RunDir(run).checkpoints), str(steps[-1])) if steps else None
    resume = storage.join(directory, "config.yaml")
    sets = (config or {}).get("eval", {}).get("sets", [])
    data = " ".join(f"--data {s['label']}={s['mix_file'] or ','.join(s['paths'])}" for s in sets) or \
        "--data LABEL=HELDOUT_MIX.txt"
    commands = [f"olmax launch local {resume}   # resume from the newest checkpoint (add train.steps=N to go further)"]
    if checkpoint:
        commands += [f"olmax eval heldout {checkpoint} {data}",
                     f"olmax convert olmax-to-hf {checkpoint} --out {run}-hf",
                     f"olmax compare {run} OTHER_RUN"]
    text = yaml.safe_dump(config, sort_keys=False) if config else "(no committed checkpoint yet: no config to show)"
    return ('<section id="commands"><h2>Commands</h2><pre class="mono">'
            + html.escape("\n".join(commands)) + "</pre></section>"
            '<section id="config"><h2>Config</h2><p class="note">The resolved config of the newest checkpoint '
            f'(config.yaml beside this page).</p><pre class="mono">{html.escape(text)}</pre></section>')


def write(location: str, directory: str) -> str:
    """DIR/index.html, DIR/report.json and DIR/config.yaml of the run at `location` (DIR a local directory, made if
    missing, or a bucket URL); the page's path. Locally each file is replaced whole, through no symbolic link."""
    facts = gather(location)
    r = report(facts)
    files = {"report.json": json.dumps(r, indent=1) + "\n", "index.html": page(facts, r, directory)}
    if facts["config"]:
        files["config.yaml"] = yaml.safe_dump(facts["config"], sort_keys=False)
    write_files(directory, files)  # none written when one would be refused
    return storage.join(directory, "index.html")
