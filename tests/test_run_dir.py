"""A run directory's files are named in olmax.run_dir alone; the launcher and the Checkpointer see the same
committed steps; olmax follows no symbolic link where it writes its own files."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

import olmax
from olmax import run_lock
from olmax.checkpoint import Checkpointer
from olmax.cli import main
from olmax.config import CheckpointConfig
from olmax.errors import RunDirError
from olmax.launch.cli import MODES
from olmax.launch.supervisor import latest_checkpoint_step
from olmax.run_dir import File, RunDir, open_own, own_dir, replace_own, write_own
from olmax.train.goodput import Goodput

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


# The run's own files and directories, and their .partial files (what train writes, including its lock)
OWN = ["run.lock", "goodput.json", "goodput.json.partial", "metrics.jsonl", "metrics.jsonl.partial", "checkpoints",
       "tensorboard", "logs", "wandb.json", "wandb", "goodput.png"]


@pytest.mark.parametrize("name", OWN)
def test_a_link_where_train_writes_its_own_file_is_refused_naming_it(tmp_path, capsys, name):
    """A symbolic link planted where olmax writes (its target anywhere) is exit 2 naming it, its target untouched."""
    target = tmp_path / "target"
    if name in ("checkpoints", "tensorboard", "logs", "wandb"):
        target.mkdir()
        (target / "kept").write_text("precious")
    else:
        target.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(target)
    assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", f"output_dir={run}"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: RunDirError: {run / name} is a symbolic link (to {target})"), line
    assert (target / "kept" if target.is_dir() else target).read_text() == "precious"
    assert sorted(p.name for p in target.parent.iterdir()) == ["run", "target"]


def test_a_checkpoint_step_that_is_a_link_is_refused_at_the_start(tmp_path, capsys):
    """A step directory that is a link, which Orbax would refuse to delete once the step is no longer kept (exit 1,
    which `olmax launch` retries): exit 2 naming it before anything is written, its target untouched."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "kept").write_text("precious")
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    (run.checkpoints / "1").symlink_to(target)
    assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", f"output_dir={run.location}"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: RunDirError: {run.checkpoints / '1'} is a symbolic link (to {target})"), line
    assert (target / "kept").read_text() == "precious" and sorted(p.name for p in run.location.iterdir()) == ["checkpoints"]


def test_the_writers_of_run_files_follow_no_link(tmp_path):
    """What the check before a run cannot see (a link planted while it runs): each writer opens its file without
    following a link, and says so naming it."""
    target = tmp_path / "target"
    target.write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(target)
    partial_is_link = tmp_path / "file"
    (tmp_path / "file.partial").symlink_to(target)
    writers = {"open_own": lambda: open_own(link, append=True), "replace_own": lambda: replace_own(link, "x"),
               "write_own": lambda: write_own(link, b"x"),
               "replace_own, its partial": lambda: replace_own(partial_is_link, "x"), "own_dir": lambda: own_dir(link),
               "the run lock": lambda: run_lock._locked(link)}
    for what, write in writers.items():
        with pytest.raises(RunDirError, match="is a symbolic link"):
            write()
        assert target.read_text() == "precious", what
    run = RunDir(tmp_path / "run")
    own_dir(run.location)
    Goodput(run.location).persist()
    assert json.loads(run.goodput.read_text())["attempts"]
    assert not list(run.location.glob("*.partial"))


def test_the_commands_that_write_into_a_run_directory_follow_no_link(tmp_path, capsys):
    """`olmax goodput RUN` (goodput.png) and `olmax compare RUN B` (compare.tsv, .png, .json), which write into
    the run directory by default: a link planted there is exit 2 naming it, its target untouched."""
    runs = [RunDir(tmp_path / name) for name in ("a", "b")]
    for run in runs:
        own_dir(run.location)
        run.metrics.write_text("".join(json.dumps({"step": s, "train/CE loss": 10 - s / 10}) + "\n" for s in range(1, 41)))
    Goodput(runs[0].location).persist()
    target = tmp_path / "target"
    target.write_text("precious")
    for name, command in (("goodput.png", ["goodput", runs[0].location]),
                          *((f"compare.{suffix}", ["compare", runs[0].location, runs[1].location])
                            for suffix in ("tsv", "png", "json"))):
        link = runs[0].location / name
        link.unlink(missing_ok=True)  # written by the command before
        link.symlink_to(target)
        assert main([str(a) for a in command]) == 2, name
        assert capsys.readouterr().err.splitlines()[-1].startswith(f"olmax: RunDirError: {link} is a symbolic link")
        assert target.read_text() == "precious"
        link.unlink()
        assert main([str(a) for a in command]) == 0, capsys.readouterr().err
        assert not link.is_symlink() and link.stat().st_size > 0


def test_compare_checks_all_its_outputs_before_writing_one(tmp_path, capsys):
    """`compare` wrote compare.tsv, then refused a link at compare.png: one refused file now writes none."""
    runs = [RunDir(tmp_path / name) for name in ("a", "b")]
    for run in runs:
        own_dir(run.location)
        run.metrics.write_text("".join(json.dumps({"step": s, "train/CE loss": 10 - s / 10}) + "\n" for s in range(1, 41)))
    target = tmp_path / "target"
    target.write_text("precious")
    (runs[0].location / "compare.png").symlink_to(target)
    assert main(["compare", str(runs[0].location), str(runs[1].location)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: RunDirError: {runs[0].location / 'compare.png'} is a symbolic link"), line
    assert target.read_text() == "precious"
    assert sorted(p.name for p in runs[0].location.iterdir()) == ["compare.png", "metrics.jsonl"]


def test_a_directory_where_a_command_writes_a_file_is_exit_2_naming_it_and_leaves_nothing(tmp_path, capsys):
    """`mkdir RUN/goodput.png; olmax goodput RUN` (and a directory at `goodput --out`, compare.png, or a file of the
    run's page) ended in an IsADirectoryError traceback with a .partial left beside it: one line naming the path
    and the fix, exit 2, nothing written."""
    runs = [RunDir(tmp_path / name) for name in ("a", "b")]
    for run in runs:
        own_dir(run.location)
        run.metrics.write_text("".join(json.dumps({"step": s, "train/CE loss": 10 - s / 10}) + "\n" for s in range(1, 41)))
    Goodput(runs[0].location).persist()
    a, b, page = runs[0].location, runs[1].location, runs[0].page
    assert main(["report", str(a)]) == 0  # the page, written again below with a directory in place of each file
    capsys.readouterr()
    cases = [(a / "goodput.png", ["goodput", a]), (tmp_path / "plots", ["goodput", a, "--out", tmp_path / "plots"]),
             (a / "compare.png", ["compare", a, b]),
             *((page / name, ["report", a]) for name in ("index.html", "report.json", "config.yaml"))]
    for directory, command in cases:
        kept = directory.with_name(directory.name + ".kept")
        if directory.exists():
            directory.rename(kept)
        directory.mkdir()
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        assert main([str(arg) for arg in command]) == 2, directory
        [line] = capsys.readouterr().err.splitlines()
        assert str(directory.parent) in line and f"{directory.name} is a directory" in line, line
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before, directory
        assert not list(tmp_path.rglob("*.partial")), directory
        directory.rmdir()
        if kept.exists():
            kept.rename(directory)


def test_a_directory_at_a_file_olmax_writes_is_refused_by_the_writer(tmp_path):
    """Where the check before a command cannot see it (made while the command runs): the writer names it, and
    leaves no .partial."""
    for path in (tmp_path / "made", tmp_path / "partial"):
        path.mkdir()
    (tmp_path / "file.partial").mkdir()
    for path in (tmp_path / "made", tmp_path / "file"):
        with pytest.raises(RunDirError, match="is a directory where olmax writes a file"):
            write_own(path, b"x")
    with pytest.raises(RunDirError, match="is a directory where olmax writes a file"):
        open_own(tmp_path / "made", append=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.partial", "made", "partial"]


# A process that renames DIR away, puts a link to VICTIM in its place, then a directory again, ROUNDS times, as fast
# as it can.
SWAPPER = """
import contextlib, os, sys
directory, victim, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("swapping", flush=True)
for i in range(rounds):
    with contextlib.suppress(FileNotFoundError):  # renamed away already, the writer has not made it again yet
        os.rename(directory, f"{directory}.away-{i}")
    with contextlib.suppress(FileExistsError):  # made again by the writer first
        os.symlink(victim, directory)
        os.unlink(directory)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory)
"""


@pytest.mark.parametrize("writer", ["a page", "a run's file", "a file at a path"])
def test_a_directory_swapped_for_a_link_while_olmax_writes_in_it_gets_no_byte_outside(tmp_path, writer):
    """A second process renames the directory a writer writes in away and puts a link to another directory in its
    place, 400 times while the writer writes: the checks by name saw only the last component, and the victim's
    index.html was replaced (3 of 60 `olmax report --out DIR`), or refuse_link's islink-then-readlink raised
    FileNotFoundError. Now each write opens the directory once, through no link, and works relative to it: no byte
    lands in the victim, and a write either lands in a directory olmax opened or is refused naming the link."""
    from olmax.scale.layout_page import write_files

    victim, directory = tmp_path / "victim", tmp_path / "page"
    victim.mkdir()
    for name in ("index.html", "report.json", "goodput.json", "goodput.png"):
        (victim / name).write_text("precious")
    directory.mkdir()
    write = {"a page": lambda: write_files(str(directory), {"config": "tiny"}, "<p>page</p>"),
             "a run's file": lambda: replace_own(directory / "goodput.json", "{}"),
             "a file at a path": lambda: write_own(directory / "goodput.png", b"png")}[writer]
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(directory), str(victim), "400"],
                               stdout=subprocess.PIPE, text=True)
    assert swapper.stdout.readline() == "swapping\n"
    written, refused = 0, 0
    while swapper.poll() is None:
        try:
            write()
            written += 1
        except RunDirError as err:
            assert "is a symbolic link" in str(err) or "was renamed or replaced" in str(err), err
            refused += 1
        except FileNotFoundError:  # replace_own writes in a directory that exists: renamed away just then
            assert writer == "a run's file"
    assert swapper.wait() == 0 and written + refused > 0
    assert sorted(p.name for p in victim.iterdir()) == ["goodput.json", "goodput.png", "index.html", "report.json"]
    assert all(p.read_text() == "precious" for p in victim.iterdir())
