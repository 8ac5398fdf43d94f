"""A report.json read back (`olmax report FILE`): a file from anywhere, so checked before anything is drawn from
it: that it is a report of olmax compile or plan, and that each figure is within what a page draws (a huge count
of devices or stages would fill the machine's memory drawing it); ConfigError naming the field otherwise."""

from __future__ import annotations

import json
import re

from olmax.errors import ConfigError
from olmax.scale.comparison import comparison_page, markdown_table
from olmax.scale.layout_page import page

MOST_BYTES = 2**26  # 64 MiB: a compile's report.json of a whole v5p pod (8,960 devices) is a few MB
MOST_CHIPS = 2**16  # more devices than any slice or cluster olmax compiles for (a v5p pod: 8,960 chips)
LARGEST = 1e30  # beyond every count of bytes, FLOPs, tokens or seconds a report holds
DEEPEST = 32  # olmax nests a report's values at most 7 deep
# A cell of a schedule's tick table is a shape and a label on the page (about 450 bytes of memory drawing it: 4M
# cells took 1.8 GiB and 40 s, and wrote a page of 491 MiB); a 1F1B schedule of 64 stages, 512 micro-batches and
# 4 chunks a stage has 150,000
MOST_TICK_CELLS = 2**18
TICK_ROW = re.compile(r"(plan\.)?schedules\.\d+\.ticks\.\d+")
# What a page draws a shape or a panel for each unit of, by the pattern of its path in report.json: lists, with the
# most entries drawn (a picture of the devices for each mesh axis), and numbers, with the range drawn
LONGEST = [(re.compile(r"chips"), MOST_CHIPS), (re.compile(r"mesh_axes"), 16)]
RANGES = [(re.compile(r"chips\.\d+\.at\.[^.]+"), 0, MOST_CHIPS - 1),  # a place in the slice: z, a panel
          (re.compile(r"(plan\.)?schedules\.\d+\.stages"), 1, MOST_CHIPS)]
OTHER_REPORTS = [  # the report.json files of olmax's other pages: the fields that tell each, and what it is
    ({"budget", "headroom", "results"}, "the report of olmax tune --report (its page: the index.html beside it)"),
    ({"reports"}, "the report of a comparison page (olmax report A.json B.json), not one of the reports it compares"),
    ({"run", "steps_logged"}, "the report of a run's page (olmax report RUN)"),
]


def load(path: str) -> dict:
    """The report.json at `path` (of olmax compile or plan --report), checked to be drawn: ConfigError saying what
    the file is where it is not such a report, or where a figure is beyond what a page draws."""
    try:
        with open(path, "rb") as f:
            text = f.read(MOST_BYTES + 1)
        if len(text) > MOST_BYTES:
            raise ValueError(f"larger than {MOST_BYTES // 2**20} MiB")
        report = json.loads(text)
    except (OSError, ValueError) as err:
        why = str(err)
    except RecursionError:
        why = "JSON nested deeper than Python reads"
    else:
        if isinstance(report, dict) and (other := next((what for fields, what in OTHER_REPORTS
                                                         if fields <= set(report)), None)):
            raise ConfigError(f"{path}: {other}; olmax report takes report.json files of olmax compile or olmax plan "
                              "--report, or a run directory")
        if not (why := unusable(report)):
            return report
    raise ConfigError(f"{path}: not a report.json olmax wrote ({why}); give the report.json of olmax compile or "
                      "olmax plan --report, or a run directory")


def out_of_bounds(report: dict) -> str | None:
    """The first figure of a report read back that is beyond what a page draws, by its path, and why; None when
    every one is within. A page loops over the places in the slice, the stages and the devices: one huge count
    would fill the machine's memory before anything is written."""
    stack = [("", report, 0)]
    cells = 0
    while stack:
        path, value, depth = stack.pop()
        shown = _shown(path)
        if depth > DEEPEST:
            return f"{shown} is nested deeper than {DEEPEST} levels"
        if isinstance(value, (dict, list)):
            most = next((most for pattern, most in LONGEST if pattern.fullmatch(path)), None)
            if isinstance(value, list) and most is not None and len(value) > most:
                return f"{shown} has {len(value):,} entries, more than the {most:,} a page draws"
            if isinstance(value, list) and TICK_ROW.fullmatch(path):
                cells += len(value)
                if cells > MOST_TICK_CELLS:
                    return (f"{shown} is past the {MOST_TICK_CELLS:,} cells of the tick tables a page draws (the "
                            "schedules' ticks x stages)")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack += reversed([(f"{path}.{key}" if path else str(key), item, depth + 1) for key, item in items])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not abs(value) <= LARGEST:  # NaN, infinite, or beyond every figure olmax writes
                return f"{shown} is {_number(value)}, not a finite number up to {LARGEST:.0e}"
            low, high = next(((low, high) for pattern, low, high in RANGES if pattern.fullmatch(path)), (None, None))
            if low is not None and not low <= value <= high:
                return f"{shown} is {_number(value)}, beyond the {low:,} to {high:,} a page draws"
    return None


def _shown(path: str) -> str:
    """A path of report.json in an error's one line: its keys' control characters escaped, at most 80 characters."""
    text = json.dumps(path)[1:-1]
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: int | float) -> str:
    if len(str(value)) <= 24:
        return str(value)
    return f"{value:.3g}" if abs(value) < 1e300 else f"a number of {len(str(value))} digits"


def unusable(report) -> str | None:
    """Why a report.json read back cannot be shown (a field missing, of another kind than olmax writes, or beyond
    what a page draws), or None: its figures are checked against their bounds, then its page, alone and beside
    others, and its Markdown row are drawn to find out."""
    if not isinstance(report, dict) or not {"config", "target"} <= set(report):
        return "no config or target"
    if why := out_of_bounds(report):
        return why
    try:
        page(report), comparison_page([report]), markdown_table([report])
    except KeyError as err:
        return f"no field {err.args[0]!r} where the page reads one"
    except (TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as err:
        return f"a field of another kind than olmax writes: {type(err).__name__}: {err}"
    return None
