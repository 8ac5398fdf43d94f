"""The suite's budget: a test of more than a minute in the recorded profile (tests/suite_profile.json) says why in
its docstring, and the check at the end of every run (tests/suite_budget.py) counts what this run's processes
compile, start and train, failing on growth past its margin and on nothing else."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from suite_budget import MARGIN, PROFILE, ROOT, over_budget

LONG_TEST_S = 60


def _docstring(nodeid: str) -> str | None:
    """The docstring of the test function `nodeid` names, None if it is gone."""
    path, *names = nodeid.split("[")[0].split("::")
    node = ast.parse((ROOT / path).read_text())
    for name in names:
        node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            return None
    return ast.get_docstring(node) or ""


def test_a_test_of_more_than_a_minute_says_why_in_its_docstring():
    """`Cost:` in its docstring, saying what the worker-seconds the profile measured buy."""
    tests = json.loads(PROFILE.read_text())["tests"]
    long = {test: row["wall"] for test, row in tests.items() if "::" in test and row.get("wall", 0) > LONG_TEST_S}
    silent = [f"{test} ({seconds:.0f} s)" for test, seconds in long.items()
              if (doc := _docstring(test)) is not None and "Cost:" not in doc]
    assert not silent, f"over {LONG_TEST_S} worker-seconds in the profile, no `Cost:` in the docstring: {silent}"


def _row(programs=0, processes=0, steps=0):
    return {"compiles-missed": programs, "compiles-hit": 0, "processes": processes, "train-steps": steps}


def test_the_check_fails_on_growth_past_the_margin_only_over_a_run_of_the_whole_suite():
    recorded = {f"t{i}": _row(100, 1, 10) for i in range(10)}
    assert over_budget(recorded, dict(recorded)) == []
    within = {**recorded, "t0": _row(100 + 1000 * MARGIN * 0.9, 1, 10)}
    assert over_budget(recorded, within) == []
    grown = {**recorded, "t0": _row(100 + 1000 * MARGIN * 1.1, 1, 10)}
    [line] = over_budget(recorded, grown)
    assert line.startswith("1,110 programs compiled, 11% more than the profile's 1,000") and "t0 100 -> 210" in line
    # a test the profile does not know is growth; so are processes and steps
    new = {**recorded, "new": _row(0, 2, 200)}
    assert [line.split(",")[0] for line in over_budget(recorded, new)] == ["12 processes started", "300 training steps"]
    # a few files run alone: not checked (what a file compiles depends on what ran before it in its process)
    assert over_budget(recorded, {"t0": _row(500, 9, 90)}) == []


def test_this_runs_processes_record_their_compiles_and_the_processes_tests_start(request):
    """What the check counts is recorded in every run, not only under benchmarks/suite_profile.py."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from suite_profile import test_rows

    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
    subprocess.run([sys.executable, "-c", "import jax"], check=True)
    row = test_rows(Path(os.environ["SUITE_PROFILE_DIR"]))[request.node.nodeid]
    assert row["compiles-missed"] + row["compiles-hit"] >= 1 and row["processes"] == 1
