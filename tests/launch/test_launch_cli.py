"""`olmax launch MODE`: each mode's options documented with their defaults, and the spellings of earlier releases
(`olmax launch CONFIG`, --nprocs, --slurm, --tpu-pod NAME [--run], --k8s) read as today's, with one line on stderr."""

import argparse

import pytest

from olmax.cli import build_parser, main
from olmax.launch.cli import MODES, with_mode


def _mode_parsers() -> dict[str, argparse.ArgumentParser]:
    launch = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "launch")[1]
    return dict(launch._subparsers._group_actions[0].choices)


def test_every_launch_option_says_what_it_does_and_its_default():
    parsers = _mode_parsers()
    assert sorted(parsers) == sorted(MODES)
    for mode, parser in parsers.items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = action.help or ""
            assert text and "\n" not in text, (mode, action.option_strings)
            assert any(word in text for word in ("(default", "(required)", "(no default")), (mode, action.option_strings)


@pytest.mark.parametrize("old, new", [
    (["launch", "tiny", "x=1"], ["launch", "local", "tiny", "x=1"]),
    (["launch", "tiny", "--nprocs", "2"], ["launch", "local", "tiny", "--nprocs", "2"]),
    (["launch", "--slurm", "--dry-run", "tiny"], ["launch", "slurm", "--dry-run", "tiny"]),
    (["launch", "tiny", "--k8s", "--target", "t"], ["launch", "k8s", "tiny", "--target", "t"]),
    (["launch", "--tpu-pod", "vm", "--zone", "z", "tiny"], ["launch", "tpu-pod", "vm", "--zone", "z", "tiny", "--dry-run"]),
    (["launch", "--tpu-pod=vm", "--run", "tiny"], ["launch", "tpu-pod", "vm", "tiny"]),
    (["launch", "slurm", "tiny"], ["launch", "slurm", "tiny"]),
    (["train", "--slurm"], ["train", "--slurm"]),
])
def test_old_spellings_read_as_todays(capsys, old, new):
    assert with_mode(old) == new
    err = capsys.readouterr().err
    flags = [a for a in old if a.partition("=")[0] in ("--slurm", "--k8s", "--tpu-pod", "--run", "--nprocs")]
    if flags and old[0] == "launch":
        assert err.splitlines() == [f"olmax: {' '.join(f.partition('=')[0] for f in flags)} is the old spelling, "
                                    "kept for one release: write `olmax launch "
                                    f"{' '.join(new[1:2 + (new[1] == 'tpu-pod')])} ...` (olmax launch --help)"]
    else:
        assert err == ""


def test_old_local_spelling_dry_run_matches_the_new(tmp_path, capsys):
    assert main(["launch", "local", "--dry-run", "tiny", f"output_dir={tmp_path}/run", "--nprocs", "2"]) == 0
    new = capsys.readouterr().out
    assert main(["launch", "--nprocs", "2", "--dry-run", "tiny", f"output_dir={tmp_path}/run"]) == 0
    assert capsys.readouterr().out == new and "olmax.cli train tiny output_dir=" in new
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, says", [
    (["launch", "--run", "tiny"], "--run went with --tpu-pod"),
    (["launch", "--k8s", "--nprocs", "2", "tiny"], "drop --nprocs"),
    (["launch", "local", "tiny", "--nprocs", "0"], "--nprocs >= 1"),
    (["launch", "slurm", "tiny", "--poll-seconds", "0"], "--poll-seconds > 0"),
    # nan was taken, and written into launch.jsonl as `"sleep": NaN`, which is no JSON
    *[(["launch", mode, "tiny", flag, value], "all finite") for mode in ("local", "slurm") for value in ("nan", "inf")
      for flag in ("--retry-backoff", "--backoff-factor", "--backoff-max")],
    (["launch", "slurm", "tiny", "--status-seconds", "nan"], "--status-seconds > 0, finite"),
])
def test_launch_refusals_are_exit_2_with_one_line(capsys, argv, says):
    assert main(argv) == 2
    assert says in capsys.readouterr().err.splitlines()[-1]
