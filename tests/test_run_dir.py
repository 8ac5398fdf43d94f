"""A run directory's files are named in olmax.run_dir alone; the launcher and the Checkpointer see the same
committed steps."""

import ast
import re
from pathlib import Path

import jax.numpy as jnp

import olmax
from olmax.checkpoint import Checkpointer
from olmax.config import CheckpointConfig
from olmax.launch.cli import MODES
from olmax.launch.supervisor import latest_checkpoint_step
from olmax.run_dir import File, RunDir

SRC = Path(olmax.__file__).parent


def _strings(path: Path):
    """The string constants of a module's code (not its docstrings), f-strings' literal parts included."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_the_run_layout_is_named_only_in_run_dir():
    names = {part for value in vars(RunDir).values() if isinstance(value, File) for part in value.name.split("/")}
    assert {"checkpoints", "metrics.jsonl", "tensorboard", "run.lock", "launch.jsonl", "logs"} <= names
    found = []
    for path in sorted([*SRC.rglob("*.py"), *(SRC.parents[1] / "benchmarks").glob("*.py")]):
        if path == SRC / "run_dir.py":
            continue
        for line, value in _strings(path):
            # a path, not prose, nor the name of a launch mode (`olmax launch slurm`)
            if not re.search(r"\s", value) and names & set(value.split("/")) and value not in MODES:
                found.append(f"{path.relative_to(SRC.parents[1])}:{line}: {value!r}")
    assert not found


def test_the_launcher_and_the_checkpointer_list_the_same_committed_steps(tmp_path):
    run = RunDir(tmp_path)
    checkpointer = Checkpointer(run.checkpoints, CheckpointConfig())
    for step in (1, 2, 3):
        checkpointer.save_params(step, {"w": jnp.ones(2)}, {"step": step, "config": {}})
    (run.checkpoints / "4.orbax-checkpoint-tmp-1").mkdir()  # a write cut short
    checkpointer.set_aside(3)  # unreadable: renamed out of the way
    assert checkpointer.all_steps() == run.committed_steps() == [1, 2]
    assert checkpointer.latest_step() == run.latest_step() == latest_checkpoint_step(tmp_path) == 2
    checkpointer.close()
    assert RunDir(tmp_path / "elsewhere").latest_step() is None and latest_checkpoint_step(tmp_path / "elsewhere") == 0


def test_a_run_directory_in_a_bucket_names_urls():
    run = RunDir("s3://bucket/runs/tiny/")
    assert run.remote and run.metrics == "s3://bucket/runs/tiny/metrics.jsonl"
    assert run.checkpoints == "s3://bucket/runs/tiny/checkpoints" and run.lock == "s3://bucket/runs/tiny/run.lock"
    assert RunDir("runs/tiny").metrics == Path("runs/tiny/metrics.jsonl")
