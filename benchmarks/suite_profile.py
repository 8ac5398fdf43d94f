"""Where the test suite's time goes: runs pytest with the given arguments and prints, per test file and in
total, the tests' wall time beside what was spent on process start-up and imports (processes the tests
started), XLA compilation (persistent-cache misses and hits), tracing, training (olmax.train.trainer.train,
compiles included), sleeping, and fixtures that start servers (moto, fake-gcs-server, Slurm).

    python benchmarks/suite_profile.py [--json FILE] [pytest arguments]
    python benchmarks/suite_profile.py -n 0 tests/launch/test_slurm.py

Every Python process of the run loads suite_profile_hook/sitecustomize.py, which records its events;
this file is also the pytest plugin (`-p suite_profile`) that times fixtures and tests and prints the table.
The columns are worker-seconds: a test's children run while it waits for them, and several children can run
at once, so a row's parts can add up to more than its wall time."""

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
KINDS = ["start-up", "compile-miss", "compile-hit", "trace", "train", "sleep", "servers"]
# Session and module fixtures that start a server process: their set-up time is the "servers" column.
SERVER_FIXTURES = {"object_stores", "slurm"}


def pytest_configure(config):
    config.pluginmanager.register(Timings(), "suite_profile_timings")


class Timings:
    def __init__(self):
        self.walls = defaultdict(float)  # test file -> seconds of its tests (set-up, call and teardown)
        self.counts = defaultdict(int)

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        self.walls[path] += report.duration
        self.counts[path] += report.when == "call"

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            if fixturedef.argname in SERVER_FIXTURES:
                _append("servers", time.perf_counter() - start, request.node.nodeid)

    def pytest_terminal_summary(self, terminalreporter):
        if hasattr(terminalreporter.config, "workerinput"):
            return
        table = profile(Path(os.environ["SUITE_PROFILE_DIR"]), self.walls, self.counts)
        terminalreporter.write_line("")
        for line in format_table(table):
            terminalreporter.write_line(line)
        if out := os.environ.get("SUITE_PROFILE_JSON"):
            rounded = {path: {key: round(value, 1) for key, value in row.items()} for path, row in table.items()}
            Path(out).write_text(json.dumps(rounded, indent=1) + "\n")


def _append(kind, secs, nodeid):
    with open(Path(os.environ["SUITE_PROFILE_DIR"]) / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps({"kind": kind, "secs": secs, "test": nodeid, "child": False}) + "\n")


def profile(events_dir: Path, walls: dict, counts: dict) -> dict:
    """{test file: {"tests": n, "wall": s, kind: s, "compiles-missed": n, "compiles-hit": n}} with a "total" row."""
    rows = defaultdict(lambda: defaultdict(float))
    for path in events_dir.glob("*.jsonl"):
        startup = {}
        for line in path.read_text().splitlines():
            event = json.loads(line)
            key = event["test"].split("::")[0] or "(outside tests)"
            if event["kind"] == "start-up":  # the later of the two marks (jax imported, olmax.cli imported)
                startup[key] = max(startup.get(key, 0.0), event["secs"])
                continue
            row = rows[key]
            row[event["kind"]] += event["secs"]
            if event["kind"].startswith("compile-"):
                row["compiles-" + event["kind"].split("-")[1] + ("ed" if event["kind"].endswith("miss") else "")] += 1
        for key, secs in startup.items():
            rows[key]["start-up"] += secs
            rows[key]["processes"] += 1
    for path, wall in walls.items():
        rows[path]["wall"] = wall
        rows[path]["tests"] = counts[path]
    total = defaultdict(float)
    for row in rows.values():
        for key, value in row.items():
            total[key] += value
    ordered = dict(sorted(rows.items(), key=lambda item: -item[1].get("wall", 0.0)))
    return {**{path: dict(row) for path, row in ordered.items()}, "total": dict(total)}


COUNTS = ["tests", "processes", "compiles-missed", "compiles-hit"]


def format_table(table: dict) -> list[str]:
    """The table, widest files first: seconds to one decimal, counts (COUNTS) whole."""
    columns = ["tests", "wall", "processes", *KINDS, "compiles-missed", "compiles-hit"]
    width = max(len(path) for path in table)
    lines = [f"{'test file':<{width}} " + " ".join(f"{c:>15}" for c in columns)]
    for path, row in table.items():
        cells = (f"{row.get(c, 0):>15.0f}" if c in COUNTS else f"{row.get(c, 0.0):>15.1f}" for c in columns)
        lines.append(f"{path:<{width}} " + " ".join(cells))
    return lines


def main(argv: list[str]) -> int:
    json_out = None
    if argv[:1] == ["--json"]:
        json_out, argv = argv[1], argv[2:]
    with tempfile.TemporaryDirectory(prefix="suite-profile-") as events:
        env = {**os.environ, "SUITE_PROFILE_DIR": events,
               "PYTHONPATH": os.pathsep.join([str(HERE / "suite_profile_hook"), str(HERE),
                                              *filter(None, [os.environ.get("PYTHONPATH")])])}
        if json_out:
            env["SUITE_PROFILE_JSON"] = str(Path(json_out).resolve())
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_profile", *argv], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
