"""Several reports (of olmax compile or plan) side by side: a comparison page, the reports as columns of one table
of facts with each one's memory bar, and a Markdown table in the form of BENCHMARKS.md's."""

from __future__ import annotations

import html
import re

from olmax.figures import percent, size
from olmax.pages import document, table
from olmax.scale.layout_page import SEGMENT_COLOURS, fits, memory_bar, plan_of, write_files

def _label(r: dict) -> str:
    return " ".join([r["config"], *r.get("overrides", []), "on", r["target"]])


def _schedule_of(r: dict) -> dict | None:
    return next((s for s in plan_of(r).get("schedules", []) if s.get("configured")), None)


def _per_device(r: dict) -> str:
    if "peak" in r:
        return f"peak {size(r['peak'])} ({percent(r['peak'] / r['memory_per_device'])})"
    if "required" in r:
        return f"needs {size(r['required'])} (compiler) + arguments {size(r['parameters'] + r['optimizer_state'] + r['batch'])}"
    return "-"


def comparison_rows(reports: list[dict]) -> list[tuple[str, list[str]]]:
    """The facts compared, one row each, one column a report."""
    def each(f):
        return [f(r) for r in reports]

    def stack(name):
        return each(lambda r: next((size(s['bytes']) for s in r.get("memory_stack", [])
                                    if s["segment"] == name), "-"))

    def bubble(r):
        s = _schedule_of(r)
        return f"{s['name'].split(',')[0]}: {_bubble(s)}" if s else "-"

    plan = [plan_of(r)["exact_window"] for r in reports]
    axes = sorted({c["axes"] for r in reports for c in r.get("collectives", {}).get("by_axis", [])})
    return [
        ("mesh", each(lambda r: " x ".join(f"{a} {n}" for a, n in r.get("mesh", {}).items() if n > 1) or "-")),
        ("fits", each(lambda r: {True: "yes", False: "no", None: "-"}[fits(r)])),
        ("per device", each(_per_device)),
        ("device", each(lambda r: size(r['memory_per_device']) if "memory_per_device" in r else "-")),
        *[(f"  {name}", stack(name)) for name in SEGMENT_COLOURS],
        ("pipeline bubble", each(bubble)),
        *[(f"collectives over {a} (MiB a step)", each(lambda r, a=a: f"{sum(c['bytes_per_step'] for c in r.get('collectives', {}).get('by_axis', []) if c['axes'] == a) / 2**20:,.1f}"))
          for a in axes],
        ("MFU", [percent(p['mfu']) if "mfu" in p else "-" for p in plan]),
        ("chip-seconds / step", [f"{p['chip_seconds_per_step']:,.4g}" if "mfu" in p else "-" for p in plan]),
        ("step time (s)", [f"{p['step_seconds']:,.4g}" if "mfu" in p else "-" for p in plan]),
        ("chip-hours", [f"{p['chip_hours']:,.4g}" if "mfu" in p else "-" for p in plan]),
        ("compile s", each(lambda r: f"{r['compile_seconds']:,.0f}" if "compile_seconds" in r else "-")),
    ]


def comparison_page(reports: list[dict]) -> str:
    """Reports as columns A, B, ... (named in a list above the table); rows no report has a figure for left out."""
    letters = [chr(ord("A") + i) if i < 26 else str(i + 1) for i in range(len(reports))]
    key = "".join(f"<li><b>{k}</b>: <code>{html.escape(_label(r))}</code></li>" for k, r in zip(letters, reports))
    rows = [[html.escape(name), *(html.escape(v) for v in values)] for name, values in comparison_rows(reports)
            if any(v != "-" for v in values)]
    bars = "".join(f"<h3>{k}: {html.escape(_label(r))}</h3>{memory_bar(r)}"
                   for k, r in zip(letters, reports) if "memory_stack" in r)
    legend = " ".join(f'<span class="swatch" style="background:{c}"></span>{n}' for n, c in SEGMENT_COLOURS.items())
    memory = f'<section id="memory"><h2>Memory per device</h2><p>{legend}</p>{bars}</section>' if bars else ""
    body = (f"<h1>olmax: {len(reports)} reports side by side</h1><ul>{key}</ul>"
            f'<section id="comparison"><h2>Facts</h2><div class="scroll">'
            f'{table(["", *letters], rows, set(range(1, len(reports) + 1)))}</div></section>{memory}')
    return document("olmax: comparison", body)


def _bubble(s: dict) -> str:
    iterations = s["microbatches"] * s["chunks_per_stage"] + s["stages"] - 1
    return f"{s['bubble_fraction']:.1%} ({s['stages'] - 1} of {iterations})"


def _markdown_text(text: str) -> str:
    """`text` as the text of a Markdown table's cell: on one line, its markup characters shown as themselves (HTML's
    as entities, which every renderer reads; a pipe escaped, so that it does not end the cell)."""
    return re.sub(r"([\\`*\[\]|])", r"\\\1", html.escape(" ".join(str(text).split()), quote=False))


def _markdown_code(text: str) -> str:
    """`text` as code in a Markdown table's cell; as escaped text where a backtick, pipe or line break in it would
    end the code span or the cell (neither is escaped inside a code span)."""
    return _markdown_text(text) if re.search(r"[`|\r\n]", text) else f"`{text}`"


MARKDOWN_COLUMNS = [  # (header, right-aligned, the cell of a report and its configured schedule; "-": none)
    ("config", False, lambda r, s: _markdown_text(r["config"])),
    ("overrides", False, lambda r, s: " ".join(_markdown_code(o) for o in r.get("overrides", [])) or "(the preset)"),
    ("target", False, lambda r, s: _markdown_text(r["target"])),
    ("schedule", False, lambda r, s: _markdown_text(s["name"]) if s else "-"),
    ("bubble", True, lambda r, s: _bubble(s) if s else "-"),
    ("mb x tokens, micro-steps", False, lambda r, s: f"{r['instances_per_device_micro_step']} x "
     f"{r['sequence_length']}, {r['micro_steps']}" if "micro_steps" in r else "-"),
    ("per device", False, lambda r, s: _per_device(r)),
    ("device", True, lambda r, s: size(r['memory_per_device']) if "memory_per_device" in r else "-"),
    ("fits", False, lambda r, s: {True: "yes", False: "**no**", None: "-"}[fits(r)]),
    ("step s", True, lambda r, s: f"{plan_of(r)['exact_window']['step_seconds']:,.4g}"
     if "step_seconds" in plan_of(r)["exact_window"] else "-"),
    ("compile s", True, lambda r, s: f"{r['compile_seconds']:,.0f}" if "compile_seconds" in r else "-"),
]


def markdown_table(reports: list[dict]) -> str:
    """The comparison as BENCHMARKS.md's tables are written; a column no report has a figure for is left out."""
    rows = [[cell(r, _schedule_of(r)) for _, _, cell in MARKDOWN_COLUMNS] for r in reports]
    kept = [i for i in range(len(MARKDOWN_COLUMNS)) if any(row[i] != "-" for row in rows)]
    lines = ["| " + " | ".join(MARKDOWN_COLUMNS[i][0] for i in kept) + " |",
             "| " + " | ".join("---:" if MARKDOWN_COLUMNS[i][1] else "---" for i in kept) + " |"]
    lines += ["| " + " | ".join(row[i] for i in kept) + " |" for row in rows]
    return "\n".join(lines)


def write_comparison(reports: list[dict], directory: str) -> str:
    return write_files(directory, {"reports": reports}, comparison_page(reports))
