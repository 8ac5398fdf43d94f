"""`olmax tune --engine ray`: the search's wall time here, and the wall time expected on N workers from the compile
times it measured.

    .venv/bin/python benchmarks/tune_ray.py olmo_moe_1t --target tpu:v5p:8x8x8 --budget 8
    .venv/bin/python benchmarks/tune_ray.py olmo3_7b --target tpu:v5p:4x4x8 --budget 24 --address HEAD:6379

It runs `olmax tune CONFIG --target T --budget B --engine ray --json` (a local Ray of this machine's CPUs, or the
cluster at --address) with a compile cache of its own, empty (every candidate is compiled; --cache DIR to keep it),
and times it. Then, for each N of --workers, the same search again on a cluster of N compile slots that is a clock
(olmax.scale.tune's `Decisions` and `drive`, with an engine whose compiles take the seconds each took in the run
measured, and a compile run ahead of the search and not needed the median of them): the search's choices are a
function of the results alone, so it asks for the same compiles, and the clock says how long N workers take if a
compile takes on a node what it took here, start-up and network aside. Prints a Markdown block for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from olmax.runtime import skip_absent_tpus

skip_absent_tpus()  # before jax is imported: the clock's search estimates on this host's CPU, probing for no TPU

class Clock:
    """olmax.scale.tune's engine on a clock: `slots` compiles at once (those submitted beyond wait for a slot), each
    taking the seconds its result says; a compile with no result measured is the search's guess ahead, never needed,
    and takes `other` seconds."""

    def __init__(self, slots: int, results: dict, other: float):
        self.n, self.results, self.other = slots, results, other
        self.now, self.ends, self.queue = 0.0, {}, []

    @property
    def running(self) -> set:
        return {*self.ends, *self.queue}

    def slots(self) -> int:
        return self.n

    def plan(self) -> str:
        return f"{self.n} at a time"

    def submit(self, task) -> None:
        self.queue.append(task)
        self._start()

    def _start(self) -> None:
        while self.queue and len(self.ends) < self.n:
            task = self.queue.pop(0)
            result = self.results.get(task.candidate)
            self.ends[task] = self.now + (result.compile_seconds if result else self.other)

    def wait(self) -> list:
        from olmax.scale.tune import Result

        self.now = min(self.ends.values())
        finished = [task for task, end in self.ends.items() if end == self.now]
        for task in finished:
            del self.ends[task]
        self._start()
        return [(task, self.results.get(task.candidate) or Result(task.candidate, "compiling")) for task in finished]


def expected_wall(args, rows: list[dict], workers: int) -> float:
    """The search's wall time on `workers` compile slots, each compile as long as it took in the run of `rows`."""
    from olmax.config import load_config
    from olmax.scale import tune
    from olmax.scale.targets import parse_target
    from olmax.scale.tune_space import given, space

    target = parse_target(args.target)
    cfg = load_config(args.config, args.overrides, target.name)
    candidates = given(space(cfg, target), args.overrides)
    by_layout = {c.describe(): c for c in candidates}
    results = {}
    for row in rows:
        if row["status"] != "pruned":
            c = by_layout[row["layout"]]
            results[c] = tune.Result(c, row["status"], row["peak"], row["step_seconds"], row["mfu"],
                                     row["tokens_per_second_per_chip"], row["compile_seconds"], row["cached"],
                                     row["reason"])
    clock = Clock(workers, results, statistics.median(r.compile_seconds for r in results.values()))
    decisions = tune.Decisions(cfg, target, candidates, args.budget, args.headroom, reduced=False)
    tune.drive(decisions, clock, lambda line: None)
    evaluated = {r.candidate for r in decisions.search.results if r.status != "pruned"}
    assert evaluated == set(results), "the search on the clock asked for compiles the run did not measure"
    return clock.now


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--target", required=True)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--headroom", type=float, default=0.1)
    parser.add_argument("--address", help="a Ray cluster's head (default: a local Ray of this machine's CPUs)")
    parser.add_argument("--cache", help="the compile cache to use (default: a new, empty one)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="compile slots to give the expected wall time for")
    args = parser.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="olmax-tune-ray-cache-")
    command = [sys.executable, "-m", "olmax.cli", "tune", args.config, *args.overrides, "--target", args.target,
               "--budget", str(args.budget), "--headroom", str(args.headroom), "--engine", "ray", "--json",
               *(["--address", args.address] if args.address else [])]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "OLMAX_COMPILE_CACHE": cache}, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: nothing fits, still a search measured
        sys.exit(f"olmax tune exited {done.returncode}")
    report = json.loads(done.stdout)
    rows = [r for r in report["results"] if r["status"] != "pruned"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(f"\n`{' '.join(['olmax', *command[3:]])}` ({'the cluster at ' + args.address if args.address else 'a local Ray'}"
          f", {os.cpu_count()} CPUs here), commit {commit}, {time.strftime('%Y-%m-%d')}, load average {load:.1f} at "
          f"the start and {os.getloadavg()[0]:.1f} at the end: **{minutes(wall)}** wall for {len(rows)} compiles "
          f"({report['compiled']} new), {sum(r['status'] == 'fits' for r in rows)} fit.\n")
    print("| rank | layout | status | peak GiB | predicted step | compile s |\n| ---: | --- | --- | ---: | ---: | ---: |")
    for i, r in enumerate(rows, 1):
        peak = f"{r['peak'] / 2**30:.2f}" if r["peak"] else ""
        step = f"{r['step_seconds']:.4g} s" if r["step_seconds"] else ""
        print(f"| {i} | {r['layout']} | {r['status']} | {peak} | {step} | {r['compile_seconds']:.0f} |")
    print("\nThe same search on N compile slots, each compile the seconds it took here (Ray's and the workers' start "
          "aside):\n\n| compile slots | expected wall |\n| ---: | ---: |")
    for n in args.workers:
        print(f"| {n} | {minutes(expected_wall(args, report['results'], n))} |")


if __name__ == "__main__":
    main()
