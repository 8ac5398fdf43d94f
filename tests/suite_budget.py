"""The suite's budget, checked at the end of every run that covers the suite: what the tests cost must not grow
past what the suite's profile (tests/suite_profile.json, benchmarks/suite_profile.py --json) recorded for them
by more than MARGIN without the profile being recorded again.

The cost is counted, not timed, so that a busy machine cannot fail the check and an idle one cannot hide
growth: the programs XLA compiled (persistent-cache hits and misses together: the same number whatever the
cache holds), the processes the tests started and the training steps they ran, in every process of the run
(benchmarks/suite_profile_hook records them; conftest loads it). These are what a test's worker-seconds are
made of: compiling was half of them, training and the processes' start-up most of the rest."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "suite_profile.json"
HOOK = ROOT / "benchmarks" / "suite_profile_hook"
MARGIN = 0.10
# A run is checked when its tests are at least this share of the profile's recorded compiles: the whole suite
# (a test's count depends a little on which tests compiled a shared program before it in the same process, which
# evens out over a whole run, not over a few files).
COVERAGE = 0.9
MEASURES = {"programs compiled": ("compiles-missed", "compiles-hit"), "processes started": ("processes",),
            "training steps": ("train-steps",)}
RECORD = "python benchmarks/suite_profile.py --json tests/suite_profile.json -q -n auto --dist loadfile"


def record_events() -> None:
    """Every process of this session records its events into SUITE_PROFILE_DIR: this one (the hook loaded here),
    the pytest-xdist workers and every process a test starts (the hook on PYTHONPATH, as sitecustomize)."""
    if not os.environ.get("SUITE_PROFILE_DIR"):
        import tempfile

        os.environ["SUITE_PROFILE_DIR"] = tempfile.mkdtemp(prefix="olmax-suite-events-")
        os.environ["OLMAX_SUITE_EVENTS_OWNER"] = str(os.getpid())  # removes the directory when the session ends
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HOOK), str(ROOT / "benchmarks"),
                                                *filter(None, [os.environ.get("PYTHONPATH")])])
    if getattr(sys.modules.get("sitecustomize"), "__file__", None) != str(HOOK / "sitecustomize.py"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("suite_profile_hook", HOOK / "sitecustomize.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def measure(rows: dict) -> dict:
    """{measure: count} of a set of rows (one per test)."""
    return {name: sum(row.get(key, 0) for row in rows.values() for key in keys) for name, keys in MEASURES.items()}


def over_budget(recorded: dict, measured: dict) -> list[str]:
    """What grew past the margin: one line per measure, naming the tests that grew most. `recorded`: the profile's
    rows by test id; `measured`: this run's. Empty when the run does not cover the suite (COVERAGE)."""
    known = {test: row for test, row in recorded.items() if test in measured}
    whole = measure(recorded)["programs compiled"]
    if not whole or measure(known)["programs compiled"] < COVERAGE * whole:
        return []
    before, now = measure(known), measure(measured)
    lines = []
    for name, keys in MEASURES.items():
        if now[name] > (1 + MARGIN) * before[name]:
            count = lambda row: sum(row.get(key, 0) for key in keys)  # noqa: E731
            grown = sorted(measured, key=lambda t: count(recorded.get(t, {})) - count(measured[t]))[:5]
            lines.append(f"{now[name]:,.0f} {name}, {now[name] / before[name] - 1:.0%} more than the profile's "
                         f"{before[name]:,.0f} for the same tests (margin {MARGIN:.0%}); grown most: " + ", ".join(
                             f"{t} {count(recorded.get(t, {})):.0f} -> {count(measured[t]):.0f}" for t in grown))
    return lines


class Budget:
    """The check at the end of the session (in the process that reports, not in pytest-xdist's workers)."""

    def __init__(self):
        self.lines = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from suite_profile import test_rows

        measured = {test: row for test, row in test_rows(Path(os.environ["SUITE_PROFILE_DIR"])).items() if "::" in test}
        profile = json.loads(PROFILE.read_text())
        self.lines = over_budget(profile["tests"], measured)
        if self.lines:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if os.environ.get("OLMAX_SUITE_EVENTS_OWNER") == str(os.getpid()):
            import shutil

            shutil.rmtree(os.environ["SUITE_PROFILE_DIR"], ignore_errors=True)

    def pytest_terminal_summary(self, terminalreporter):
        if self.lines:
            recorded = json.loads(PROFILE.read_text())["recorded"]
            terminalreporter.write_line(
                f"suite budget: the tests cost more than tests/suite_profile.json ({recorded['date']}, "
                f"{recorded['commit']}) records; make them cheaper or record the profile again ({RECORD}):", red=True)
            for line in self.lines:
                terminalreporter.write_line(f"  {line}", red=True)
