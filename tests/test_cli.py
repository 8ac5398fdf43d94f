"""The CLI under bad input and interrupts, as a user meets it: every bad input is one line naming what to fix
and exit 2 (so `olmax launch` does not retry it), never a Python traceback; SIGINT at any moment of a train
ends it cleanly with exit 75."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from olmax.config import load_config
from olmax.data.synthetic import write_synthetic_shards
from olmax.data.tokenize import train_tokenizer
from olmax.train.trainer import train

ENV = {**os.environ, "OLMAX_HUGE_PAGES": "0"}


def olmax(*argv, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "olmax.cli", *map(str, argv)], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=timeout)


def olmax_here(capsys, *argv) -> subprocess.CompletedProcess:
    """`olmax` run by olmax.cli.main in this process (the same handling of bad input, without a process's
    start-up): its exit code and what it wrote to stderr."""
    capsys.readouterr()
    code = _exit_code(list(map(str, argv)))
    return subprocess.CompletedProcess(argv, code, "", capsys.readouterr().err)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """One tiny mix, a trained run and its checkpoints, and the bad inputs made from them."""
    root = tmp_path_factory.mktemp("inputs")
    shards = write_synthetic_shards(root / "mix", vocab_size=512, eos_id=0, n_tokens=100_000, n_shards=2, seed=0)
    train(load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={root / 'run'}", "mesh.fsdp=1",
                               "train.steps=2", "checkpoint.every=2"]), quiet=True)
    shutil.copytree(root / "run", root / "corrupt")
    (root / "corrupt" / "checkpoints" / "2" / "meta" / "metadata").write_text("{not json")
    write_synthetic_shards(root / "wide", vocab_size=512, eos_id=0, n_tokens=50_000, n_shards=1, seed=0,
                           token_dtype="uint32")
    (root / "bad.yaml").write_text("base: tiny\nmodel:\n  d_model: [64\n")
    (root / "a-file").write_text("not a directory")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} of a few words"}) + "\n"
                                             for i in range(50)))
    train_tokenizer([str(root / "docs.jsonl")], root / "tokenizer.json", vocab_size=280, progress=False)
    (root / "longrope").mkdir()
    (root / "longrope" / "config.json").write_text(json.dumps({
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "eos_token_id": 0,
        "sliding_window": 8, "rope_scaling": {"rope_type": "longrope", "factor": 8.0},
        "rope_parameters": {kind: {"rope_type": "default", "rope_theta": 1e4}
                            for kind in ("full_attention", "sliding_attention")}}))
    return root, shards


TINY = ("train", "tiny", "mesh.fsdp=1", "train.steps=2")
# (argv with {root} and {shard} filled in, words the error line must hold)
BAD_INPUTS = {
    "yaml syntax, config show": (["config", "show", "{root}/bad.yaml"], ["bad.yaml", "line 4"]),
    "yaml syntax, train": (["train", "{root}/bad.yaml"], ["bad.yaml", "not valid YAML"]),
    "yaml syntax, launch": (["launch", "{root}/bad.yaml"], ["bad.yaml", "not valid YAML"]),
    "override syntax": (["config", "show", "tiny", "model.layer_pattern=[sliding,"], ["model.layer_pattern"]),
    "directory as a shard": ([*TINY, 'data.paths=["{root}/mix"]', "output_dir={root}/out-dir-shard"],
                             ["mix is a directory, not a token shard"]),
    "directory as a shard, launch": (["launch", "tiny", "mesh.fsdp=1", 'data.paths=["{root}/mix"]',
                                      "output_dir={root}/out-launch", "--retry-backoff", "0"], ["bad input"]),
    "uint32 shards read as uint16": ([*TINY, 'data.paths=["{root}/wide/part-00000.npy"]', "output_dir={root}/o2"],
                                     ["written as uint32", "data.token_dtype=uint32"]),
    "corrupt checkpoint, eval": (["eval", "heldout", "{root}/corrupt", "--data", "{shard}"], ["checkpoints/2"]),
    "corrupt checkpoint, parity": (["parity", "--olmax", "{root}/corrupt", "--reference", "olmo-core"],
                                   ["checkpoints/2", "unreadable"]),
    "corrupt checkpoint, convert": (["convert", "olmax-to-hf", "{root}/corrupt", "--out", "{root}/hf"], ["checkpoints/2"]),
    "corrupt checkpoint, init_from": ([*TINY, 'data.paths=["{shard}"]', "output_dir={root}/o3",
                                       "checkpoint.init_from={root}/corrupt"], ["checkpoint.init_from", "unreadable"]),
    "unimplemented rope_type": (["convert", "hf-to-olmax", "{root}/longrope", "--out", "{root}/converted"],
                                ["full_attention", "longrope"]),
    "synth-data into a directory of shards": (["synth-data", "--out", "{root}/mix"], ["mix exists and is not empty"]),
    "tokenize into a directory of shards": (["tokenize", "{root}/docs.jsonl", "--tokenizer", "{root}/tokenizer.json",
                                             "--out", "{root}/mix"], ["mix exists and is not empty"]),
    "output_dir a file": ([*TINY, 'data.paths=["{shard}"]', "output_dir={root}/a-file"], ["output_dir", "a-file"]),
    "tokenizer train --out a directory": (["tokenizer", "train", "{root}/docs.jsonl", "--vocab-size", "280", "--out",
                                           "{root}"], ["is a directory", "tokenizer.json"]),
    "tokenizer train --out an existing file": (["tokenizer", "train", "{root}/docs.jsonl", "--vocab-size", "280",
                                                "--out", "{root}/tokenizer.json"], ["tokenizer.json exists"]),
    "mix file a directory": ([*TINY, "data.mix_file={root}/mix", "output_dir={root}/o4"], ["mix is a directory"]),
    "tokenizer a directory": (["tokenize", "{root}/docs.jsonl", "--tokenizer", "{root}", "--out", "{root}/o5"],
                              ["is a directory"]),
    "eval of a file": (["eval", "heldout", "{root}/a-file", "--data", "{shard}"], ["a-file is a file"]),
    "eval data a directory": (["eval", "heldout", "{root}/run", "--data", "{root}/mix"], ["mix is a directory"]),
}

# Run as a user runs it, in a process of its own (the exit status and stderr of `python -m olmax.cli`); the others
# through olmax.cli.main in the test's process (no interpreter and JAX start-up each), where an unexpected exception
# fails the test all the same.
AS_A_PROCESS = {"yaml syntax, train"}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(inputs, name, capsys):
    root, shards = inputs
    argv, words = BAD_INPUTS[name]
    argv = [a.format(root=root, shard=shards[0]) for a in argv]
    done = olmax(*argv) if name in AS_A_PROCESS else olmax_here(capsys, *argv)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]
    error = [line for line in done.stderr.splitlines() if "Error:" in line or "bad input" in line]
    assert error and all(word in error[-1] for word in words), done.stderr[-2000:]
    written = [p.name for p in root.iterdir() if p.name.startswith(".") or (p / "checkpoints").exists()]
    assert sorted(written) == ["corrupt", "run"], "bad input leaves no partial output, no checkpoints directory"
    assert not (root / "hf").exists() and not (root / "converted").exists()


def _started_train(tmp_path, shards, name):
    run = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-m", "olmax.cli", "train", "tiny", "mesh.fsdp=1",
                             f"data.paths={json.dumps(shards)}", f"output_dir={run}", "train.steps=30",
                             "train.log_every=1", "checkpoint.every=100"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    return run, proc


def _wait_for(predicate, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or hung before the moment"
        time.sleep(0.01)


def _blocks_sigint(pid: int) -> bool:
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    return bool(int(status["SigBlk"], 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["start-up", "compilation", "training"])
def test_sigint_at_any_moment_stops_cleanly(tmp_path, inputs, moment):
    """Start-up: imports and config, in the process that restarts itself with huge pages or the one it
    becomes; compilation: once the run says it compiles the first step, which says at once that it will stop;
    training: after step 1 was logged.
    Each moment is an event the test waits for, never a time: the same on a loaded machine."""
    _, shards = inputs
    run, proc = _started_train(tmp_path, shards, moment)
    if moment == "start-up":  # as soon as the CLI holds SIGINT (/proc's SigBlk), or later on a fast machine
        _wait_for(lambda: _blocks_sigint(proc.pid) or (run / "tensorboard").is_dir(), proc)
    elif moment == "compilation":
        _wait_for(lambda: proc.stdout.readline().startswith("compiling the train step"), proc)
    else:
        _wait_for(lambda: proc.stdout.readline().startswith("step 1/"), proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].endswith("run the same command again to resume")
    if moment == "compilation":  # said at once, not once the compile has ended
        [said] = [line for line in err.splitlines() if "SIGINT received while" in line]
        assert said == ("olmax: SIGINT received while compiling the train step (step 1): the run stops when that "
                        "ends, after a checkpoint of its last step"), said
    written = sorted(int(p.name) for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").exists() else []
    if written:
        assert f"checkpoint {written[-1]} written" in err
    else:
        assert "nothing needed writing" in err


def test_overrides_are_taken_anywhere_on_the_command_line(capsys):
    """After the command's options as before them (one parser rule for every command), in order; a word that is
    no override nor option is still refused."""
    from olmax.cli import main

    def report(*argv):
        assert main(list(argv)) == 0
        return json.loads(capsys.readouterr().out)

    before = report("flops", "tiny", "model.n_layers=8", "--json", "model.d_model=128")
    assert before == report("flops", "tiny", "--json", "model.n_layers=8", "model.d_model=128")
    assert before != report("flops", "tiny", "--json")
    plan = report("plan", "tiny", "--target", "tpu:v5p:2x2x2", "--mfu", "0.5", "model.n_layers=8", "--json")
    assert plan == report("plan", "tiny", "model.n_layers=8", "--target", "tpu:v5p:2x2x2", "--mfu", "0.5", "--json")
    assert main(["config", "show", "tiny", "model.n_layers=8", "model.n_layers=12"]) == 0
    assert "n_layers: 12" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["flops", "tiny", "--json", "model.n_layers=8", "stray"])
    assert exited.value.code == 2 and "unrecognized arguments: model.n_layers=8 stray" in capsys.readouterr().err


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write into: mode 555, and immutable where the tests run as root."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", directory], capture_output=True).returncode == 0
    if os.access(directory, os.W_OK):
        pytest.skip("no way to make a read-only directory here")
    yield directory
    if immutable:
        subprocess.run(["chattr", "-i", directory], check=True)
    directory.chmod(0o755)


def _exit_code(argv) -> int:
    from olmax.cli import main

    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


# (argv with {ro} filled in, words the error line must hold)
REFUSED_UP_FRONT = {
    "synth-data into a read-only directory": (["synth-data", "--out", "{ro}/data"], ["{ro} is not writable"]),
    "hf-to-olmax into a read-only directory": (["convert", "hf-to-olmax", "{ro}/missing-hf", "--out", "{ro}/ckpt"],
                                                ["{ro} is not writable"]),
    "olmax-to-hf into a read-only directory": (["convert", "olmax-to-hf", "{ro}/missing-ckpt", "--out", "{ro}/hf"],
                                                ["{ro} is not writable"]),
    "eval --out in a read-only directory": (["eval", "heldout", "{ro}/missing-ckpt", "--data", "{ro}/missing.npy",
                                             "--out", "{ro}/eval.json"], ["--out", "{ro} is not writable"]),
    "compare --out in a read-only directory": (["compare", "{ro}/a.tsv", "{ro}/b.tsv", "--out", "{ro}/compare"],
                                               ["--out", "{ro} is not writable"]),
    "compile for a 0x2 TPU slice": (["compile", "tiny", "--target", "tpu:v5e:0x2"], ["whole hosts of 2x2 chips"]),
    "compile for a 3x3 TPU slice": (["compile", "tiny", "--target", "tpu:v5e:3x3"], ["whole hosts of 2x2 chips"]),
    "compile for a 1x1 TPU slice": (["compile", "tiny", "--target", "tpu:v5e:1x1"], ["whole hosts of 2x2 chips"]),
    "plan for no GPUs": (["plan", "tiny", "--target", "gpu:h100x0", "--mfu", "0.4"], ["has no GPUs"]),
    "plan for more chips than a v5e pod": (["plan", "tiny", "--target", "tpu:v5e:32x32"],
                                           ["1024 chips, more than a whole v5e pod (256 chips)"]),
    "compile for more chips than a v5p pod": (["compile", "tiny", "--target", "tpu:v5p:32x32x16"],
                                              ["16384 chips, more than a whole v5p pod (8960 chips)"]),
    "resume-check resuming after the end": (["resume-check", "tiny", "--at", "5", "--steps", "4"],
                                            ["--at 5 must be between 0 and --steps 4"]),
    "resume-check of a missing mix file": (["resume-check", "tiny", "data.mix_file={ro}/missing.txt", "--at", "1",
                                            "--steps", "2", "--out", "{ro}/check"],
                                           ["DataError: mix file {ro}/missing.txt does not exist"]),
}


@pytest.mark.parametrize("name", REFUSED_UP_FRONT)
def test_bad_input_known_up_front_is_refused_before_any_work(read_only_dir, capsys, name):
    argv, words = REFUSED_UP_FRONT[name]
    assert _exit_code([a.format(ro=read_only_dir) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w.format(ro=read_only_dir) in err for w in words), err
    assert not list(read_only_dir.iterdir()) and not list(read_only_dir.parent.glob(".*partial*"))


def test_flops_names_the_attention_it_counts(capsys):
    """Sliding windows are only mentioned for a model that has sliding layers."""
    assert _exit_code(["flops", "tiny"]) == 0
    assert "(sliding windows exact, seq" in capsys.readouterr().out
    assert _exit_code(["flops", "tiny", "model.layer_pattern=[global]"]) == 0
    out = capsys.readouterr().out
    assert "sliding" not in out and "(every layer global, seq" in out


def _options(parser, path=()):
    """(command path, action) of every option and argument of `parser` and its subcommands."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _options(child, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_has_a_description_and_names_its_default():
    from olmax.cli import build_parser

    missing = [f"olmax {' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
               for path, action in _options(build_parser())
               if not action.help or (action.option_strings and action.default not in (None, False)
                                      and "default" not in action.help)]
    assert not missing, f"options without a description or their default: {missing}"


def test_help_lists_the_presets_and_says_where_to_read_more(capsys):
    from olmax.cli import main
    from olmax.config import presets
    from olmax.errors import ExitCode

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "tiny" in presets() and all(name in text for name in presets())
    assert all(f"{int(code)} " in text.split("exit codes:")[1] for code in ExitCode)
    with pytest.raises(SystemExit):
        main(["--help"])
    where = capsys.readouterr().out.split("describes each command.")[1]
    assert "README.md" in where and "docs/" in where
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "./runs/demo" in capsys.readouterr().out


def test_one_convention_and_the_old_spellings_for_one_release(tmp_path, capsys):
    """CONFIG first, outputs as --out, checkpoints positional, --batch-size: the old spellings still work and
    print one line saying what to write instead; one value given both ways is exit 2."""
    from olmax.arguments import given
    from olmax.cli import main, parse

    assert main(["synth-data", "tiny", "--out", str(tmp_path / "new"), "--tokens", "4096", "--shards", "1"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["synth-data", "--out", str(tmp_path / "old"), "--config", "tiny", "--tokens", "4096",
                 "--shards", "1"]) == 0
    assert capsys.readouterr().err.count("olmax: --config is the old spelling") == 1
    assert [p.read_bytes() for p in sorted((tmp_path / "new").glob("*.npy"))] == \
        [p.read_bytes() for p in sorted((tmp_path / "old").glob("*.npy"))]

    pairs = [(["parity", "ckpt", "--hf", "h"], ["parity", "--olmax", "ckpt", "--hf", "h"], "checkpoint"),
             (["convert", "olmax-to-hf", "ckpt", "--out", "o"], ["convert", "olmax-to-hf", "ckpt", "o"], "out"),
             (["convert", "hf-to-olmax", "h", "--out", "o"], ["convert", "hf-to-olmax", "h", "o"], "out"),
             (["eval", "heldout", "r", "--data", "d", "--batch-size", "8"],
              ["eval", "heldout", "r", "--data", "d", "--batch-instances", "8"], "batch_size")]
    for new, old, dest in pairs:
        assert given(parse(new), dest, dest) == given(parse(old), dest, dest) is not None
        assert capsys.readouterr().err.count("is the old spelling") == 1, old
    assert main(["parity", "ckpt", "--olmax", "other", "--hf", "h"]) == 2
    assert "given twice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["flops", "train", "compile"])
def test_a_missing_config_is_the_one_argument_named_as_required(command, capsys):
    """`olmax flops` alone said "the following arguments are required: config, overrides": overrides are optional."""
    from olmax.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command])
    last = capsys.readouterr().err.splitlines()[-1]
    assert exited.value.code == 2 and last.endswith("the following arguments are required: config"
                                                    + (", --target" if command == "compile" else "")), last


def test_an_unknown_option_of_a_command_shows_that_commands_usage(capsys):
    """`olmax train --steps 10` printed the usage of the whole CLI, every command in braces."""
    from olmax.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", "tiny", "--steps", "10"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: olmax train [-h] config [overrides ...]\n"), err
    assert err.splitlines()[-1] == ("olmax train: error: unrecognized arguments: --steps 10 (settings are "
                                    "section.key=value overrides, e.g. train.steps=10)")
    with pytest.raises(SystemExit):
        main(["config", "show", "tiny", "--steps", "10"])
    assert capsys.readouterr().err.startswith("usage: olmax config show [-h]")
