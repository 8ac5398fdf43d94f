"""Bad input is one class: every error meaning "the input is wrong" derives from olmax.errors.BadInput, which the
CLI catches (exit 2, one line) without importing jax to name it."""

import subprocess
import sys

from olmax.cli import main
from olmax.errors import BadInput


def test_every_bad_input_error_derives_from_bad_input():
    from olmax.checkpoint import CheckpointError, UnreadableCheckpoint
    from olmax.config import ConfigError
    from olmax.data.shards import DataError
    from olmax.eval.models import EvalError
    from olmax.interop import InteropError
    from olmax.run_lock import RunDirError
    from olmax.scale.targets import TargetError

    for error in (ConfigError, DataError, CheckpointError, UnreadableCheckpoint, EvalError, InteropError, TargetError,
                  RunDirError):
        assert issubclass(error, BadInput), error


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
