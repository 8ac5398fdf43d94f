"""The docs' lists are the code's: the preset list and the command table (docs/commands.md) and the README's test
command (the exit-code table is checked in test_errors.py)."""

import argparse
import re
import tomllib
from pathlib import Path

from testlib import docs

from olmax.cli import build_parser
from olmax.config import presets

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
COMMANDS = docs("commands.md")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_the_preset_list_is_the_configs():
    listed = re.search(r"`CONFIG` is a preset \(([^)]*)\)", COMMANDS).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == set(presets())  # it lacked tiny_qwen3


def test_the_command_table_lists_every_command_and_launch_mode():
    table = COMMANDS.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    cells = [row.split(" | ")[0] for row in table.splitlines()[2:]]
    named = {word for cell in cells for word in re.findall(r"`olmax ([\w-]+)", cell)}
    commands = _commands(build_parser())
    assert named == set(commands)
    launch_cells = " ".join(cell for cell in cells if "olmax launch" in cell)
    assert set(re.findall(r"(?:launch|/) ([\w-]+)", launch_cells)) >= set(_commands(commands["launch"]))


def test_the_test_command_fails_fast_and_is_cis():
    """A crashed worker fails the run at once (pytest-xdist can hang after replacing one), and a hung test fails
    with its name and stacks after 20 minutes (the slowest end-to-end test takes about 10 on a loaded machine).
    It installs the aot and aot-gpu extras, so that the compiles for TPUs and GPUs run in CI (skipped without)."""
    readme = re.search(r"^# 2\..*\n(.*)$", README, re.M).group(1)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert readme == ci
    assert "--max-worker-restart=0" in ci and "--timeout=1200" in ci
    assert "pip install -q -e '.[test,aot,aot-gpu]'" in ci
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert "pytest-timeout==2.4.0" in test_extra
