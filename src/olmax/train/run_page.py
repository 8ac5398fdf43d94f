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
import json
import re

import numpy as np
import yaml

from olmax import storage
from olmax.pages import document, fact, table
from olmax.run_dir import RunDir, own_dir, write_own
from olmax.train.goodput import CATEGORIES, read_record, totals

CURVES = [("loss", "train/CE loss"), ("LR", "optim/LR (group 0)"), ("grad norm", "optim/total grad norm"),
          ("throughput", "throughput/device/TPS")]
WIDTH, HEIGHT, LEFT, BOTTOM = 560, 170, 62, 22  # a chart's size and its axes' margins, in pixels
# the keys not every run logs, found in one pass: held-out losses and an MoE's per-layer load
OPTIONAL = re.compile(rb'"(eval/lm/(?:[^"\\]|\\.)*/CE loss|train/block \d+/load imbalance)": ')
GOODPUT_COLOURS = dict(zip(CATEGORIES, ["#bab0ac", "#9c755f", "#f28e2b", "#59a14f", "#edc948", "#76b7b2", "#4e79a7",
                                        "#b07aa1", "#e15759", "#ff9da7"]))


class Metrics:
    """The columns of metrics.jsonl the page draws."""

    def __init__(self, data: bytes):
        self.data = data
        self.steps = np.array(re.findall(rb'\{"step": (\d+)', data), np.int64)
        self.optional = sorted({json.loads(b'"' + key + b'"') for key in OPTIONAL.findall(data)})
        self._lines = None
        self._columns = {}

    def column(self, name: str) -> np.ndarray:
        """The metric's value at every step (NaN where a record lacks it), read once: each read is a pass over
        the whole file, the page's cost on a long run."""
        if name not in self._columns:
            self._columns[name] = self._read_column(name)
        return self._columns[name]

    def _read_column(self, name: str) -> np.ndarray:
        values = re.findall(b'"' + re.escape(name.encode()) + rb'": ([^,}\]]*)', self.data)
        if len(values) == len(self.steps):  # in every record: in record order
            return _floats(values)
        out = np.full(len(self.steps), np.nan)
        for index, value in self.sparse(name):
            out[index] = value
        return out

    def sparse(self, name: str) -> list[tuple[int, float]]:
        """(record index, value) of the records that have the metric."""
        if self._lines is None:
            self._lines = self.data.splitlines()
        key = b'"' + json.dumps(name)[1:-1].encode() + b'": '
        found = []
        for index, line in enumerate(self._lines):
            if key in line:
                value = json.loads(line)[name]
                found.append((index, float(value) if not isinstance(value, list) else np.nan))
        return found


def _floats(values: list[bytes]) -> np.ndarray:
    return np.array(values).astype(np.float64)  # JSON's numbers and Python's NaN, Infinity, -Infinity


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


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def chart(name: str, x: np.ndarray, y: np.ndarray, x_label: str, marks: dict[str, list[float]]) -> str:
    """An SVG line chart of y against x, drawn as each pixel column's minimum and maximum, with vertical marks
    (`restart`, `checkpoint`, `skipped`: their x values)."""
    plot = WIDTH - LEFT - 8
    finite = np.isfinite(x)
    x_range = (float(x[finite].min()), float(x[finite].max())) if finite.any() else (0.0, 1.0)
    columns, low, high = envelope(x, y, x_range, plot)
    # The curve is not drawn across a restart (on the wall-time axis, the time between two attempts).
    xs = np.sort(x[np.isfinite(x) & np.isfinite(y)])
    after = xs[np.minimum(np.searchsorted(xs, marks.get("restart", []), side="right"), len(xs) - 1)] if len(xs) else xs
    breaks = set(((after - x_range[0]) / max(x_range[1] - x_range[0], 1e-12) * (plot - 1)).astype(np.int64).tolist())
    y_low, y_high = (float(low.min()), float(high.max())) if len(columns) else (0.0, 1.0)
    y_span = (y_high - y_low) or 1.0

    def py(value):
        return 8 + (HEIGHT - BOTTOM - 8) * (1 - (value - y_low) / y_span)

    def px(value):
        return LEFT + plot * (value - x_range[0]) / max(x_range[1] - x_range[0], 1e-12)

    path = "".join(f"{'L' if i and c not in breaks else 'M'}{LEFT + c:.0f} {py(lo):.1f}L{LEFT + c:.0f} {py(hi):.1f}"
                   for i, (c, lo, hi) in enumerate(zip(columns, low, high)))
    parts = [f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - 8}" y2="{HEIGHT - BOTTOM}" stroke="#888"/>',
             f'<line x1="{LEFT}" y1="8" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="#888"/>',
             f'<text x="{LEFT - 4}" y="14" text-anchor="end">{_number(y_high)}</text>',
             f'<text x="{LEFT - 4}" y="{HEIGHT - BOTTOM}" text-anchor="end">{_number(y_low)}</text>',
             f'<text x="{LEFT}" y="{HEIGHT - 6}">{_number(x_range[0])}</text>',
             f'<text x="{WIDTH - 8}" y="{HEIGHT - 6}" text-anchor="end">{_number(x_range[1])} {html.escape(x_label)}'
             "</text>"]
    style = {"checkpoint": ('#999', "", 6), "skipped": ("#e6a100", "", 10), "restart": ("#c62828", "4 3", None)}
    for kind, xs in marks.items():
        colour, dash, length = style[kind]
        top = 8 if length is None else HEIGHT - BOTTOM - length
        for value in xs:
            parts.append(f'<line class="{kind}" x1="{px(value):.1f}" x2="{px(value):.1f}" y1="{top}" '
                         f'y2="{HEIGHT - BOTTOM}" stroke="{colour}" stroke-dasharray="{dash}"/>')
    parts.append(f'<path class="curve" d="{path}" fill="none" stroke="#4e79a7" stroke-width="1"/>')
    return (f'<svg class="chart" data-metric="{html.escape(name)}" data-x="{html.escape(x_label)}" '
            f'data-columns="{len(columns)}" width="{WIDTH}" height="{HEIGHT}" role="img" '
            f'aria-label="{html.escape(name)} against {html.escape(x_label)}">{"".join(parts)}</svg>')


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
    """What the page shows of the run at `location`, from its files."""
    run = RunDir(location)
    metrics = Metrics(_read(run.metrics) or b"")
    goodput = _read(run.goodput)
    goodput = read_record(goodput.decode()) if goodput else None
    checkpoints = run.committed_steps()
    meta = _read(run.checkpoint_meta(checkpoints[-1])) if checkpoints else None
    return {"run": str(run.location), "metrics": metrics, "goodput": goodput, "committed_steps": checkpoints,
            "config": json.loads(meta)["config"] if meta else None}


def report(facts: dict) -> dict:
    """The page's report.json: the figures shown."""
    metrics, steps, goodput = facts["metrics"], facts["metrics"].steps, facts["goodput"]
    attempts = goodput["attempts"] if goodput else []
    out = {"run": facts["run"], "steps_logged": int(len(steps)),
           "first_step": int(steps[0]) if len(steps) else None, "last_step": int(steps[-1]) if len(steps) else None,
           "committed_steps": facts["committed_steps"], "attempts": len(attempts),
           "restarts": [{"step": a["first_step"], "time": a["started"]} for a in attempts[1:]]}
    if len(steps):
        skipped = metrics.column("optim/step skipped")
        out["skipped_steps"] = [int(s) for s in steps[skipped == 1]]
        out["last"] = {label: float(metrics.column(name)[-1]) for label, name in CURVES}
    if goodput:
        total = totals(goodput)
        out["goodput"] = {"seconds": total, "productive_share": total["productive"] / (sum(total.values()) or 1)}
    return out


def _marks(facts: dict, r: dict, steps: np.ndarray, time: np.ndarray | None) -> tuple[dict, dict]:
    """The marks of the step charts and of the wall-time charts (hours since the first record)."""
    every = (facts["config"] or {}).get("checkpoint", {}).get("every")
    last = r["last_step"] or 0
    saved = sorted(set(facts["committed_steps"]) | (set(range(every, last + 1, every)) if every else set()))
    by_step = {"checkpoint": saved, "skipped": r.get("skipped_steps", []),
               "restart": [x["step"] for x in r["restarts"] if x["step"] is not None]}
    if time is None:
        return by_step, {}
    hours = (time - time[0]) / 3600

    def at(step_list):
        index = np.searchsorted(steps, step_list)
        return [float(hours[i]) for i in index if i < len(steps)]

    by_time = {"checkpoint": at(saved), "skipped": at(by_step["skipped"]),
               "restart": [(x["time"] - time[0]) / 3600 for x in r["restarts"]]}
    return by_step, by_time


def page(facts: dict, r: dict, directory: str) -> str:
    metrics, steps = facts["metrics"], facts["metrics"].steps
    sections = [f"<h1>Run {html.escape(r['run'])}</h1>"]
    if not len(steps):
        sections.append("<p>No step logged yet (metrics.jsonl is empty or missing).</p>")
        return document(f"olmax run {r['run']}", "".join(sections))
    time = metrics.column("wall_time") if b'"wall_time": ' in metrics.data[:4096] else None
    by_step, by_time = _marks(facts, r, steps, time)
    sections.append(
        f"<p>Steps {fact('first_step', r['first_step'])} to {fact('last_step', r['last_step'])} "
        f"({fact('steps_logged', r['steps_logged'])} logged), {fact('attempts', r['attempts'])} attempt(s), "
        f"{len(r['restarts'])} restart(s), {len(r.get('skipped_steps', []))} skipped step(s); committed checkpoints "
        f"{html.escape(', '.join(map(str, r['committed_steps'])) or 'none')}.</p>"
        '<p class="note">Marks: <span style="color:#c62828">restarts</span> (dashed: where an attempt resumed), '
        '<span style="color:#999">checkpoints</span> and <span style="color:#e6a100">skipped steps</span> (ticks). '
        "Each curve is drawn as the lowest and highest value of the steps in each pixel column.</p>")
    rows = []
    for label, name in CURVES:
        y = metrics.column(name)
        step_chart = chart(f"{label}", steps.astype(np.float64), y, "step", by_step)
        time_chart = chart(f"{label}", (time - time[0]) / 3600, y, "hours", by_time) if time is not None else \
            "<p>No wall times in this metrics.jsonl (written by an older olmax).</p>"
        rows.append(f"<h3>{html.escape(label)} <code>{html.escape(name)}</code></h3>"
                    f'<div style="display:flex;gap:12px">{step_chart}{time_chart}</div>')
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
        points = metrics.sparse(f"eval/lm/{label}/CE loss")
        x = np.array([metrics.steps[i] for i, _ in points], np.float64)
        y = np.array([v for _, v in points])
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
    share = r["goodput"]["productive_share"]
    return ('<section id="goodput"><h2>Goodput</h2><p>Productive steps are '
            f"{fact('goodput.productive_share', share, format(share, '.1%'))} of the run's {wall:,.0f} s of wall "
            "time over its attempts (goodput.json; `olmax goodput RUN`).</p>"
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
    if not storage.is_remote(directory):
        own_dir(directory)
    for name, text in files.items():
        write_own(storage.join(directory, name), text)
    return storage.join(directory, "index.html")
