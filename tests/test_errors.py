"""The exit-code contract: every error olmax raises on purpose lives in olmax.errors with its exit code and its one
line, which the CLI prints without importing jax; the docs' table of exit codes (docs/reliability.md) is ExitCode's. Bad input is one
class: every error meaning "the input is wrong" derives from BadInput (exit 2)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import olmax
from testlib import docs

from olmax import cli, errors
from olmax.cli import main
from olmax.errors import BadInput, ExitCode, OlmaxError

SRC = Path(olmax.__file__).parent


def _error_classes() -> list[type]:
    found, todo = [], [OlmaxError]
    while todo:
        found.append(cls := todo.pop())
        todo += cls.__subclasses__()
    return sorted(found, key=lambda cls: cls.__name__)


def test_the_exit_codes():
    assert {code.name: int(code) for code in ExitCode} == {
        "FINISHED": 0, "FAILED": 1, "BAD_INPUT": 2, "DIVERGED": 3, "STORAGE_UNAVAILABLE": 69, "DISK_FULL": 74,
        "PREEMPTED": 75, "INTERRUPTED": 130, "TERMINATED": 143}
    assert errors.NOT_RETRIED == (2, 3, 74)
    assert {cls.__name__: cls.exit_code for cls in _error_classes() if not issubclass(cls, BadInput)} == {
        "OlmaxError": 1, "Preempted": 75, "Diverged": 3, "DiskFull": 74, "DoesNotFit": 1,
        "CoordinatorUnreachable": 1, "LeaseLost": 75}
    assert all(isinstance(cls.exit_code, ExitCode) for cls in _error_classes())


def test_the_docs_table_is_the_exit_codes():
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| .* \| (yes|no)\b.* \|$", docs("reliability.md"), re.M)
    assert rows == [(str(int(code)), code.name, "yes" if code.retried else "no") for code in ExitCode]


def test_errors_and_exit_codes_are_defined_only_in_errors_py():
    """No exception class and no exit status as a number elsewhere in src/olmax (an import is fine)."""
    exceptions = {"Exception", "BaseException", "ValueError", "RuntimeError", "OSError", "KeyError", "TypeError",
                  *(cls.__name__ for cls in _error_classes())}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and {ast.unparse(b).split(".")[-1] for b in node.bases} & exceptions:
                found.append(f"{path.relative_to(SRC)}: class {node.name}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.exit" and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, int):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Name) and re.fullmatch(r"EXIT_\w+|\w+_EXIT_CODE", node.id):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.id}")
    assert not found


@pytest.mark.parametrize("error", _error_classes(), ids=lambda cls: cls.__name__)
def test_the_cli_ends_on_each_error_with_its_code_and_one_line(error, monkeypatch, capsys):
    raised = error("what went wrong", {}) if error is errors.DoesNotFit else error("what went wrong")

    def command(args):
        raise raised

    monkeypatch.setattr(cli, "cmd_flops", command)
    assert main(["flops", "tiny"]) == error.exit_code
    assert capsys.readouterr().err == f"olmax: {raised.line()}\n"


def test_every_bad_input_error_derives_from_bad_input():
    assert {cls.__name__ for cls in _error_classes() if issubclass(cls, BadInput)} == {
        "BadInput", "ConfigError", "TargetError", "ClusterError", "SlurmError", "StorageError", "MissingObject", "MissingBucket",
        "AlreadyExists", "StorageUnavailable", "RunDirError", "DataError", "CheckpointError", "UnreadableCheckpoint", "EvalError", "InteropError"}
    assert issubclass(BadInput, ValueError)


def test_bad_input_exits_2_with_one_line(capsys):
    assert main(["config", "show", "tiny", "impl.moe_dispatch=blocks"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moved: set impl.moe.dispatch" in err


def test_the_cli_catches_bad_input_without_loading_jax():
    code = ("import sys; from olmax.cli import main; code = main(['config', 'show', 'no_such_preset']); "
            "sys.exit(10 + code if 'jax' in sys.modules else code)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("olmax: ConfigError:")
