"""Where the test suite's time goes: runs pytest with the given arguments and prints, per test file and for the
costliest tests, the tests' wall time beside what was spent on process start-up and imports (processes the tests
started), XLA compilation (persistent-cache misses and hits), tracing, training (olmax.train.trainer.train,
compiles included), sleeping, and fixtures that start servers (moto, fake-gcs-server, Slurm).

    python benchmarks/suite_profile.py [--json FILE] [pytest arguments]
    python benchmarks/suite_profile.py -n 0 tests/launch/test_slurm.py

Every Python process of the run loads suite_profile_hook/sitecustomize.py, which records its events;
this file is also the pytest plugin (`-p suite_profile`) that times fixtures and tests and prints the tables.
The columns are worker-seconds: a test's children run while it waits for them, and several children can run
at once, so a row's parts can add up to more than its wall time. `--json` writes the profile (the suite's is
tests/suite_profile.json): when and on what it was recorded, the total, one row per file and one per test."""

import datetime
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
# Counts, not seconds: the same in every run of the same tests whatever the machine's load (compiles-hit +
# compiles-missed is the number of programs compiled, whatever the compilation cache holds).
COUNTS = ["tests", "processes", "compiles-missed", "compiles-hit", "train-steps"]
# Session and module fixtures that start a server process: their set-up time is the "servers" column.
SERVER_FIXTURES = {"object_stores", "slurm"}
TOP_TESTS = 30


def pytest_configure(config):
    config.pluginmanager.register(Timings(), "suite_profile_timings")


class Timings:
    def __init__(self):
        self.walls = defaultdict(float)  # test id -> seconds of its set-up, call and teardown
        self.ran = set()  # the tests that ran (not skipped)
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report):
        self.walls[report.nodeid] += report.duration
        if report.when == "call":
            self.ran.add(report.nodeid)

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
        table = profile(Path(os.environ["SUITE_PROFILE_DIR"]), self.walls, self.ran)
        terminalreporter.write_line("")
        for line in [*format_files(table["files"]), "", *format_tests(table["tests"])]:
            terminalreporter.write_line(line)
        if out := os.environ.get("SUITE_PROFILE_JSON"):
            table["recorded"] = {"date": datetime.date.today().isoformat(), "commit": _commit(),
                                 "minutes": round((time.monotonic() - self.started) / 60, 1),
                                 "arguments": " ".join(terminalreporter.config.invocation_params.args)}
            rounded = {"recorded": table["recorded"], "total": _rounded(table["total"]),
                       **{key: {name: _rounded(row) for name, row in table[key].items()} for key in ("files", "tests")}}
            Path(out).write_text(json.dumps(rounded, indent=1) + "\n")


def _rounded(row: dict) -> dict:
    return {key: round(value, 1) for key, value in row.items()}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _append(kind, secs, nodeid):
    with open(Path(os.environ["SUITE_PROFILE_DIR"]) / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps({"kind": kind, "secs": secs, "test": nodeid, "child": False}) + "\n")


def test_rows(events_dir: Path) -> dict:
    """{test id: {kind: seconds, "processes": n, "compiles-missed": n, "compiles-hit": n, "train-steps": n}} from
    the events every process of the run recorded ("(outside tests)": what no test was running for)."""
    rows = defaultdict(lambda: defaultdict(float))
    for path in events_dir.glob("*.jsonl"):
        startup = {}
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # the last line of a process killed while it wrote it
                continue
            key = event["test"] or "(outside tests)"
            if event["kind"] == "start-up":  # the later of the two marks (jax imported, olmax.cli imported)
                startup[key] = max(startup.get(key, 0.0), event["secs"])
                continue
            row = rows[key]
            row[event["kind"]] += event["secs"]
            if event["kind"].startswith("compile-"):
                row["compiles-" + event["kind"].split("-")[1] + ("ed" if event["kind"].endswith("miss") else "")] += 1
            row["train-steps"] += event.get("steps", 0)
        for key, secs in startup.items():
            rows[key]["start-up"] += secs
            rows[key]["processes"] += 1
    return rows


def profile(events_dir: Path, walls: dict, ran: set) -> dict:
    """{"tests": {test id: row}, "files": {test file: row}, "total": row}, rows as test_rows' with "tests" (how
    many ran) and "wall" (seconds of set-up, call and teardown), costliest first."""
    rows = test_rows(events_dir)
    for nodeid, wall in walls.items():
        rows[nodeid]["wall"] = wall
        rows[nodeid]["tests"] = int(nodeid in ran)
    files = defaultdict(lambda: defaultdict(float))
    for key, row in rows.items():
        for name, value in row.items():
            files[key.split("::")[0]][name] += value
    total = defaultdict(float)
    for row in files.values():
        for name, value in row.items():
            total[name] += value
    return {"tests": _costliest_first(rows), "files": _costliest_first(files), "total": dict(total)}


def _costliest_first(rows: dict) -> dict:
    return {key: dict(row) for key, row in sorted(rows.items(), key=lambda item: -item[1].get("wall", 0.0))}


def format_files(files: dict) -> list[str]:
    """The files, widest first: seconds to one decimal, counts (COUNTS) whole."""
    columns = ["tests", "wall", "processes", *KINDS, "compiles-missed", "compiles-hit", "train-steps"]
    width = max(map(len, files), default=9)
    lines = [f"{'test file':<{width}} " + " ".join(f"{c:>15}" for c in columns)]
    for path, row in files.items():
        cells = (f"{row.get(c, 0):>15.0f}" if c in COUNTS else f"{row.get(c, 0.0):>15.1f}" for c in columns)
        lines.append(f"{path:<{width}} " + " ".join(cells))
    return lines


def format_tests(tests: dict, top: int = TOP_TESTS) -> list[str]:
    """The `top` costliest tests as a Markdown table (docs/testing.md keeps the suite's)."""
    lines = ["| test | worker-s | processes | compile miss (programs) | compile hit | train (steps) | sleep |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for nodeid, row in list(((k, r) for k, r in tests.items() if "::" in k))[:top]:
        lines.append(f"| `{nodeid}` | {row.get('wall', 0):,.0f} | {row.get('processes', 0):.0f} | "
                     f"{row.get('compile-miss', 0):,.0f} ({row.get('compiles-missed', 0):,.0f}) | "
                     f"{row.get('compile-hit', 0):,.0f} | {row.get('train', 0):,.0f} ({row.get('train-steps', 0):,.0f}) "
                     f"| {row.get('sleep', 0):,.0f} |")
    return lines


def main(argv: list[str]) -> int:
    json_out = None
    if argv[:1] == ["--json"]:
        json_out, argv = argv[1], argv[2:]
    with tempfile.TemporaryDirectory(prefix="suite-profile-") as events_dir:
        env = {**os.environ, "SUITE_PROFILE_DIR": events_dir,
               "PYTHONPATH": os.pathsep.join([str(HERE / "suite_profile_hook"), str(HERE),
                                              *filter(None, [os.environ.get("PYTHONPATH")])])}
        if json_out:
            env["SUITE_PROFILE_JSON"] = str(Path(json_out).resolve())
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_profile", *argv], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
