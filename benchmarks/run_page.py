"""How long `olmax report RUN` takes on a long run, and how long Chromium takes to draw the page it writes.

Writes a run directory whose metrics.jsonl has --steps records of the keys a dense run logs (the tiny preset's
record, about 1.3 KB), with a loss spike at one step, several restarts in goodput.json, and, with --layers N, an
MoE's per-layer load; then times the page's generation (`olmax report RUN`, in a process of its own) and its
rendering in headless Chromium (`--dump-dom`), each --repeat times (medians quoted); then a screenshot, written as
RUN/page/screenshot.png.

    python benchmarks/run_page.py --steps 500000 --out /tmp/long-run      # alone on the machine for the figures
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from olmax.run_dir import RunDir

CATEGORIES = ["launcher start-up", "start-up", "compilation", "productive", "data wait", "evaluation", "checkpoint",
              "shutdown", "lost work", "between attempts"]


def write_run(directory: Path, steps: int, layers: int = 0, spike: int | None = None, restarts: int = 3) -> None:
    """A run directory as a run of `steps` logged steps leaves it: metrics.jsonl, goodput.json (with `restarts`
    restarts, evenly spread) and one committed checkpoint's meta."""
    run = RunDir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    start = 1.8e9
    with open(run.metrics, "w") as f:
        for step in range(1, steps + 1):
            loss = 6.0 / (1 + step) ** 0.1 + (5.0 if step == spike else 0.0)
            record = {"step": step, "wall_time": start + 0.5 * step, "optim/LR (group 0)": 3e-4 * min(1, step / 2000),
                      "optim/adam step": float(step), "optim/step skipped": 1.0 if step == spike else 0.0,
                      "optim/total grad norm": 0.3 + 0.1 * (step % 7) / 7, "train/CE loss": loss,
                      "train/Z loss": 1e-4, "train/masked instances (%)": 0.0, "throughput/total tokens": step * 4096,
                      "throughput/device/TPS": 9800.0 + step % 100, "throughput/device/MFU": 47.5, "io/retries": 0}
            record |= {f"goodput/{c} (s)": 0.25 * step for c in CATEGORIES}
            record |= {f"goodput/step/{c} (s)": 0.25 for c in CATEGORIES} | {"goodput/goodput (%)": 91.0}
            for layer in range(layers):
                record[f"train/block {layer:02d}/load imbalance"] = 1.2 + 0.3 * ((step + layer) % 11) / 11
            f.write(json.dumps(record) + "\n")
    every = max(1, steps // (restarts + 1))
    attempts = [{"started": start + 0.5 * first, "ended": start + 0.5 * min(steps, first + every),
                 "seconds": {c: 0.5 * every / len(CATEGORIES) for c in CATEGORIES}, "first_step": first,
                 "last_step": min(steps, first + every), "snapshots": []}
                for first in range(0, steps, every)][:restarts + 1]
    run.goodput.write_text(json.dumps({"attempts": attempts}))
    meta = run.checkpoint_meta(steps)
    meta.parent.mkdir(parents=True, exist_ok=True)
    config = {"name": "long", "output_dir": str(directory), "checkpoint": {"every": max(1, steps // 10)},
              "eval": {"sets": []}}
    meta.write_text(json.dumps({"step": steps, "config": config}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500_000)
    parser.add_argument("--layers", type=int, default=0, help="MoE layers whose load is logged (0: a dense run)")
    parser.add_argument("--out", required=True, help="the run directory to write (replaced)")
    parser.add_argument("--repeat", type=int, default=3, help="times each figure is measured (the median is quoted)")
    args = parser.parse_args()
    run = RunDir(args.out)
    shutil.rmtree(run.location, ignore_errors=True)
    write_run(run.location, args.steps, args.layers, spike=args.steps // 3)
    size = run.metrics.stat().st_size
    page = run.page / "index.html"
    chromium = shutil.which("chromium")
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={run.location}-profile"]
    generated, rendered = [], []
    for _ in range(args.repeat):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "olmax.cli", "report", str(run.location)], check=True)
        generated.append(round(time.perf_counter() - began, 2))
        if chromium:
            began = time.perf_counter()
            subprocess.run([*flags, "--dump-dom", page.as_uri()], check=True, capture_output=True)
            rendered.append(round(time.perf_counter() - began, 2))
    if chromium:
        subprocess.run([*flags, "--window-size=1280,2400", f"--screenshot={run.page / 'screenshot.png'}",
                        page.as_uri()], check=True, capture_output=True)
    print(json.dumps({"steps": args.steps, "layers": args.layers, "metrics_jsonl_bytes": size,
                      "page_bytes": page.stat().st_size, "generate_s": generated,
                      "generate_median_s": statistics.median(generated), "chromium_dump_dom_s": rendered,
                      "chromium_median_s": statistics.median(rendered) if rendered else None}))


if __name__ == "__main__":
    main()
