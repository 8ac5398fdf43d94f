"""Writes docs/images/run-page.svg, the picture of a run's page that the README and docs/metrics.md show: the page
`olmax report RUN` writes for a real run, its charts, as they are on the page, set out in one SVG image.

The run: the tiny preset on generated tokens, with two held-out sets, stopped with SIGTERM once a checkpoint
past the middle is committed (a preemption: it checkpoints and exits 75) and run again, so that it resumes.

    python docs/run_page_svg.py                 # a few minutes on a laptop CPU; then commit the image
"""

from __future__ import annotations

import argparse
import html
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, CHECKPOINT_EVERY = 300, 50
CHART_WIDTH, CHART_HEIGHT = 560, 170  # olmax.train.run_page's WIDTH and HEIGHT
GAP, HEADING = 12, 22
STYLE = ("text { font: 11px system-ui, sans-serif; fill: #222; } .h1 { font-size: 20px; } .h2 { font-size: 16px; } "
         ".mono { font-family: ui-monospace, monospace; }")


def olmax(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "olmax.cli", *args], cwd=cwd)


def make_run(directory: Path) -> Path:
    """The run, in `directory`/runs/tiny (so the page names it runs/tiny); its path."""
    assert olmax("synth-data", "tiny", "--out", "shards", "--tokens", "400000", "--shards", "3", cwd=directory).wait() == 0
    shards = sorted(str(p.relative_to(directory)) for p in (directory / "shards").glob("*.npy"))
    sets = [{"label": "web", "paths": shards[:1]}, {"label": "code", "paths": shards[1:2]}]
    train = ["train", "tiny", f"data.paths={json.dumps(shards[2:])}", "output_dir=runs/tiny", f"train.steps={STEPS}",
             "train.log_every=1", f"checkpoint.every={CHECKPOINT_EVERY}", f"eval.every={CHECKPOINT_EVERY}",
             f"eval.sets={json.dumps(sets)}", "eval.tokens=4096"]
    run = directory / "runs" / "tiny"
    first = olmax(*train, cwd=directory)
    middle = run / "checkpoints" / str(STEPS // 2 + CHECKPOINT_EVERY)
    while not middle.exists() and first.poll() is None:
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    assert first.wait() == 75, "the first attempt should checkpoint and exit 75 on SIGTERM"
    assert olmax(*train, cwd=directory).wait() == 0
    assert olmax("report", "runs/tiny", cwd=directory).wait() == 0
    return run


def _text(fragment: str) -> str:
    """A page's HTML fragment as SVG text: its code in a monospace font, other markup dropped."""
    pieces = re.split(r"<code>(.*?)</code>", fragment)
    text = [html.escape(html.unescape(re.sub(r"<[^>]+>", "", piece)), quote=False) for piece in pieces]
    return "".join(f'<tspan class="mono">{piece}</tspan>' if i % 2 else piece for i, piece in enumerate(text))


def _placed(svg: str, x: float, y: float) -> str:
    return svg.replace("<svg ", f'<svg x="{x}" y="{y}" ', 1)


def page_svg(page: str) -> str:
    """The run page's title, summary, training charts (step and wall time side by side), held-out charts and
    goodput bar, as one SVG document."""
    title = _text(re.search(r"<h1>(.*?)</h1>", page).group(1))
    summary = _text(re.search(r"</h1><p>(.*?)</p>", page).group(1))
    width = 2 * CHART_WIDTH + GAP
    parts, y = [f'<text class="h1" x="0" y="22">{title}</text>', f'<text x="0" y="44">{summary}</text>'], 56
    training = re.search(r'<section id="curves">(.*?)</section>', page).group(1)
    parts.append(f'<text class="h2" x="0" y="{y + 16}">Training: against step, and against wall time</text>')
    y += HEADING + 8
    for heading, pair in re.findall(r"<h3>(.*?)</h3><div[^>]*>(.*?)</div>", training):
        parts.append(f'<text x="0" y="{y + 12}">{_text(heading)}</text>')
        for i, chart in enumerate(re.findall(r'<svg class="chart".*?</svg>', pair)):
            parts.append(_placed(chart, i * (CHART_WIDTH + GAP), y + 16))
        y += CHART_HEIGHT + HEADING
    heldout = re.search(r'<section id="heldout">(.*?)</section>', page)
    if heldout:
        parts.append(f'<text class="h2" x="0" y="{y + 16}">Held-out loss per domain</text>')
        y += HEADING + 8
        for i, (label, chart) in enumerate(re.findall(r'<h3>(.*?)</h3>(<svg class="chart".*?</svg>)',
                                                      heldout.group(1))):
            parts.append(f'<text x="{i * (CHART_WIDTH + GAP)}" y="{y + 12}">{_text(label)}</text>')
            parts.append(_placed(chart, i * (CHART_WIDTH + GAP), y + 16))
        y += CHART_HEIGHT + HEADING
    goodput = re.search(r'<section id="goodput"><h2>Goodput</h2><p>(.*?)</p>(<svg.*?</svg>)(.*?)</section>', page)
    if goodput:
        parts.append(f'<text class="h2" x="0" y="{y + 16}">Goodput</text>')
        parts.append(f'<text x="0" y="{y + 36}">{_text(goodput.group(1))}</text>')
        parts.append(_placed(goodput.group(2), 0, y + 44))
        y += 44 + 30
        rows = re.findall(r'background:(#\w+)"></span>(.*?)</td><td[^>]*>(.*?)</td><td[^>]*>(.*?)</td>', goodput.group(3))
        for i, (colour, category, seconds, share) in enumerate(rows):
            x, row_y = (i % 3) * 300, y + 14 + (i // 3) * 18
            parts.append(f'<rect x="{x}" y="{row_y - 10}" width="11" height="11" fill="{colour}" stroke="#888"/>'
                         f'<text x="{x + 17}" y="{row_y}">{_text(category)}: {_text(seconds)} s ({_text(share)})</text>')
        y += 14 + 18 * ((len(rows) + 2) // 3)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 8}" '
            f'viewBox="0 0 {width} {y + 8}"><style>{STYLE}</style>'
            f'<rect width="100%" height="100%" fill="#fff"/>{"".join(parts)}</svg>\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images" / "run-page.svg")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        run = make_run(Path(directory))
        svg = page_svg((run / "page" / "index.html").read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg)
    print(f"{args.out}: {len(svg):,} bytes")


if __name__ == "__main__":
    main()
