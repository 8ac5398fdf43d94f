"""Runs that survive: preemption, torn and corrupt checkpoints, elastic resume, warm start, bad resumes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from olmax.checkpoint import CheckpointError
from olmax.config import load_config
from olmax.data import DataError
from olmax.data.synthetic import write_synthetic_shards
from olmax.errors import ExitCode
from olmax.train.trainer import train


def _overrides(tmp_path, shards, name, *extra):
    return [f"data.paths={json.dumps(shards)}", f"output_dir={tmp_path}/{name}", "mesh.fsdp=1", *extra]


def _train(tmp_path, shards, name, *extra):
    return train(load_config("tiny", _overrides(tmp_path, shards, name, *extra)), quiet=True)


def _losses(history):
    return [h["train/CE loss"] for h in history]


def _logged(run_dir):
    return {m["step"]: m["train/CE loss"] for m in map(json.loads, Path(run_dir, "metrics.jsonl").read_text().splitlines())}


def _cli(tmp_path, shards, name, *extra):
    # Same environment as this process (8 fake devices, from conftest), so the numerics are the same.
    return subprocess.Popen([sys.executable, "-m", "olmax.cli", "train", "tiny",
                             *_overrides(tmp_path, shards, name, *extra)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout=240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


STEPS = 12
SIGNAL_AT = str(Path(__file__).parents[1] / "signal_at.py")


@pytest.fixture(scope="module")
def continuous(tmp_path_factory, shards):
    """The reference: STEPS uninterrupted steps."""
    return _losses(_train(tmp_path_factory.mktemp("ref"), shards, "ref", f"train.steps={STEPS}",
                          f"checkpoint.every={STEPS}"))


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_exits_resumable(tmp_path, shards, continuous):
    """`olmax train` sent SIGTERM as it logs step 3 (tests/signal_at.py: at that moment every run, with no race
    against the end of the run): it finishes the step in flight, writes its checkpoint, exits 75; the resumed
    run's losses are the continuous run's."""
    run = tmp_path / "pre"
    proc = subprocess.run([sys.executable, SIGNAL_AT, "--signal", "TERM", "olmax.train.metrics:MetricsWriter.write#3",
                           "train", "tiny", *_overrides(tmp_path, shards, "pre", f"train.steps={STEPS}",
                                                        "checkpoint.every=1000")],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == ExitCode.PREEMPTED, proc.stderr
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 3 <= saved[0] < STEPS and f"checkpoint {saved[0]} written" in proc.stderr
    _train(tmp_path, shards, "pre", f"train.steps={STEPS}", "checkpoint.every=1000")
    logged = _logged(run)
    assert [logged[s] for s in range(1, STEPS + 1)] == continuous


def test_sigterm_repeated_while_the_run_stops_does_not_cut_its_exit_short(tmp_path, shards):
    """A run stopping for a SIGTERM keeps stopping through more of them (srun ends a job's other tasks with one as
    soon as the first task exits 75; a platform may repeat its notice): exit 75 with the checkpoint, not killed."""
    run = tmp_path / "again"
    proc = _cli(tmp_path, shards, "again", "train.steps=200", "checkpoint.every=1000")
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip())
    while proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.PREEMPTED, err
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()], "its checkpoint written"


def test_torn_checkpoint_is_ignored_and_corrupt_one_falls_back(tmp_path, shards, continuous, caplog):
    _train(tmp_path, shards, "c", f"train.steps={STEPS}", "train.stop_after=8", "checkpoint.every=4")
    ckpts = tmp_path / "c" / "checkpoints"
    (ckpts / f"{STEPS}.orbax-checkpoint-tmp-1234").mkdir()  # what a write killed half-way leaves behind
    for f in (ckpts / "8" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * 7)  # corrupt the latest complete checkpoint
    resumed = _train(tmp_path, shards, "c", f"train.steps={STEPS}", "checkpoint.every=4")
    assert "unreadable" in caplog.text and resumed[0]["step"] == 5
    assert _losses(resumed) == continuous[4:]


def test_no_readable_checkpoint_is_an_error_and_nothing_is_overwritten(tmp_path, shards):
    _train(tmp_path, shards, "d", "train.steps=10", "checkpoint.every=10")
    meta = tmp_path / "d" / "checkpoints" / "10" / "meta" / "metadata"
    meta.write_text("{not json")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        _train(tmp_path, shards, "d", "train.steps=20", "checkpoint.every=10")
    assert meta.read_text() == "{not json"


def test_resume_with_another_model_or_data_is_refused(tmp_path, shards):
    _train(tmp_path, shards, "e", "train.steps=5", "checkpoint.every=5")
    with pytest.raises(CheckpointError, match="model.d_model: checkpoint 64, config 128"):
        _train(tmp_path, shards, "e", "train.steps=10", "model.d_model=128")
    other = write_synthetic_shards(tmp_path / "other", vocab_size=512, eos_id=0, n_tokens=100_000, n_shards=2,
                                   seed=1, token_dtype="uint16")
    with pytest.raises(DataError, match="allow_fingerprint_change"):
        train(load_config("tiny", _overrides(tmp_path, other, "e", "train.steps=10")), quiet=True)


@pytest.mark.slow
def test_elastic_resume_8_to_2_to_4_devices(tmp_path, shards):
    """Same global batch on 8, then 2, then 4 devices: per-device batch x accumulation is recomputed."""
    common = ["train.steps=6", "checkpoint.every=2", "train.micro_batch_per_device=2"]
    reference = _losses(_train(tmp_path, shards, "ref8", *common, "mesh.fsdp=8"))
    elastic = []
    for devices, stop in ((8, 2), (2, 4), (4, 6)):
        elastic += _train(tmp_path, shards, "elastic", *common, f"mesh.fsdp={devices}", f"train.stop_after={stop}")
    assert [h["step"] for h in elastic] == list(range(1, 7))
    # Accumulating 4 / 2 / 1 micro-batches sums the gradient in another order: equal up to float32 rounding.
    np.testing.assert_allclose(_losses(elastic), reference, rtol=1e-5)


@pytest.mark.slow
def test_warm_start_keeps_params_and_moments_resets_step_schedule_and_data(tmp_path, shards):
    first = _train(tmp_path, shards, "stage1", "train.steps=20", "checkpoint.every=20")
    stage2 = ["train.steps=5", "checkpoint.every=5", "schedule.kind=linear", "schedule.warmup_steps=0",
              "schedule.final_lr_fraction=0", "optim.lr=2e-3", f"checkpoint.init_from={tmp_path}/stage1/checkpoints"]
    warm = _train(tmp_path, shards, "stage2", *stage2)
    cold = _train(tmp_path, shards, "cold", *stage2[:-1])
    assert warm[0]["step"] == 1 and warm[0]["optim/LR (group 0)"] == pytest.approx(2e-3 * (1 - 1 / 5))  # no warmup
    assert warm[0]["optim/adam step"] == first[-1]["optim/adam step"] + 1, "Adam's count and moments carry over"
    assert warm[0]["train/CE loss"] < cold[0]["train/CE loss"] - 0.5, "params carry over"
    fresh_moments = _train(tmp_path, shards, "stage2b", *stage2, "checkpoint.init_optimizer=false")
    assert fresh_moments[0]["optim/adam step"] == 1
    assert fresh_moments[0]["train/CE loss"] == warm[0]["train/CE loss"]


def test_resume_on_shards_rewritten_with_other_tokens_of_the_same_size_is_refused(tmp_path, base_run, synth_mix,
                                                                                    capsys):
    from olmax.cli import main

    shutil.copytree(synth_mix.parent, tmp_path / "data")
    shutil.copytree(base_run, tmp_path / "run")
    for shard in sorted((tmp_path / "data").glob("part-*.npy")):
        tokens = np.fromfile(shard, dtype=np.uint16)
        np.roll(tokens, 1).tofile(shard)  # the same tokens, one position later: same size, same dtype
    code = main(["train", "tiny", "mesh.fsdp=1", "train.steps=8", f"data.mix_file={tmp_path}/data/mix.txt",
                 f"output_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "shard 0: part-00000.npy has other contents" in err and "allow_fingerprint_change" in err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["4", "6"]  # keep_last 2


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_a_second_train_on_a_run_directory_in_use_exits_2_naming_the_holder(tmp_path, synth_mix, capsys):
    import socket

    from olmax.cli import main

    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "olmax.cli", "train", "tiny", "mesh.fsdp=1", "train.steps=100000",
                              "checkpoint.every=100000", f"data.mix_file={synth_mix}", f"output_dir={run}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() or first.poll() is not None)
        assert first.poll() is None, first.stderr.read()
        code = main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", f"data.mix_file={synth_mix}",
                     f"output_dir={run}"])
        err = capsys.readouterr().err
        assert code == 2 and f"is in use by another run (host {socket.gethostname()}, PID {first.pid}" in err, err
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=240) == ExitCode.PREEMPTED
    # The lock went with the process: the next train resumes.
    assert main(["train", "tiny", "mesh.fsdp=1", "train.stop_after=1", "train.steps=100000",
                 "checkpoint.every=100000", f"data.mix_file={synth_mix}", f"output_dir={run}"]) == 0


def test_a_resume_says_where_it_resumes_and_how_the_lr_schedule_changed(tmp_path, base_run, synth_mix, capsys):
    from olmax.cli import main

    shutil.copytree(base_run, tmp_path / "run")
    common = ["train", "tiny", "mesh.fsdp=1", f"data.mix_file={synth_mix}", f"output_dir={tmp_path}/run"]
    assert main([*common, "train.steps=6"]) == 0
    out = capsys.readouterr().out
    assert f"resuming from step 6 (checkpoint {tmp_path}/run/checkpoints/6)" in out and "LR schedule" not in out
    # tiny: lr 1e-2, 10 warmup steps, cosine over train.steps; step 7 is past the new warmup, on a longer cosine.
    assert main([*common, "train.steps=8", "schedule.warmup_steps=2"]) == 0
    out = capsys.readouterr().out
    assert ("the LR schedule changed since the checkpoint (schedule.warmup_steps 10 -> 2, horizon 6 -> 8 steps): "
            "the LR of step 7 is 1.6029e-03, 7.0000e-03 under the checkpoint's schedule") in out


def test_a_torn_last_line_of_metrics_jsonl_is_dropped_with_a_warning_and_the_run_resumes(tmp_path, base_run,
                                                                                        synth_mix, caplog):
    from olmax.cli import main

    shutil.copytree(base_run, tmp_path / "run")
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 7, "train/CE loss": 6.0')  # a crash in the middle of step 7's line
    assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=8", f"data.mix_file={synth_mix}",
                 f"output_dir={tmp_path}/run"]) == 0
    assert f"{metrics}:7 is not a whole metrics record" in caplog.text
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 9))


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs: room for the tiny model's first checkpoint (1.3 MB) and the run's logs, not its second."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                                  check=False).returncode:
        pytest.skip("a small disk to fill needs root, to mount a tmpfs")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_save_that_filled_the_disk_keeps_orbax_later_logs_of_it_quiet(small_disk):
    """The checkpoint's DiskFull is the one line said; Orbax's writer threads logged the same failure again (an
    absl ERROR with its traceback) whenever they got to it, which was after that line when the process ran on."""
    script = f"""
import logging, threading
import numpy as np
from olmax.checkpoint import Checkpointer
from olmax.config import CheckpointConfig
from olmax.errors import DiskFull
checkpointer = Checkpointer({str(small_disk / "checkpoints")!r}, CheckpointConfig())
try:
    checkpointer.save_params(1, {{"w": np.random.default_rng(0).random((2, 1024, 1024), np.float32)}}, {{"step": 1, "config": {{}}}})
except DiskFull as err:
    print(err)
late = threading.Thread(target=logging.getLogger("absl").error, args=("a writer thread's late log",))
late.start(); late.join()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("disk full writing checkpoint 1 in "), done.stdout + done.stderr[-3000:]
    assert "late log" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("room", [5_000, 20_000, 60_000])  # full at the event file, metrics.jsonl, goodput.json
def test_disk_full_writing_the_metrics_is_one_line_and_exit_74(small_disk, synth_mix, capsys, room):
    """The disk fills while the metrics (event file, metrics.jsonl, goodput.json) are written, not a checkpoint:
    the same line and exit code as a checkpoint's, naming the file, no traceback."""
    from olmax.cli import main

    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - room))
    run = small_disk / "run"
    assert main(["train", "tiny", "mesh.fsdp=1", "checkpoint.every=1000", "train.steps=40",
                 f"data.mix_file={synth_mix}", f"output_dir={run}"]) == 74
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("olmax:")]
    assert line.startswith(f"olmax: disk full writing {run}/") and line.endswith(": free space and run again"), line
    assert line.split()[4].removeprefix(f"{run}/").rstrip(":") in ("tensorboard", "metrics.jsonl", "goodput.json")


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
def test_disk_full_writing_a_checkpoint_is_one_line_and_a_code_launch_does_not_retry(small_disk, synth_mix):
    from olmax.errors import NOT_RETRIED, DiskFull

    run = small_disk / "run"
    command = [sys.executable, "-m", "olmax.cli", "train", "tiny", "mesh.fsdp=1", "checkpoint.every=2",
               f"data.mix_file={synth_mix}", f"output_dir={run}"]
    proc = subprocess.run([*command, "train.steps=8"], capture_output=True, text=True, timeout=600, check=False)
    assert proc.stderr == f"olmax: disk full writing checkpoint 4 in {run}/checkpoints: free space and run again\n"
    assert proc.returncode == DiskFull.exit_code == 74 and DiskFull.exit_code in NOT_RETRIED
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]  # the partial write is gone
    # A crash mid-write leaves Orbax's temporary directory: the next start removes it, with a warning.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    (run / "checkpoints" / "6.orbax-checkpoint-tmp-1234" / "params").mkdir(parents=True)
    proc = subprocess.run([*command, "train.steps=4"], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"removed {run}/checkpoints/6.orbax-checkpoint-tmp-1234: a checkpoint write that did not finish" in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]


@pytest.mark.slow
def test_resume_check_heads_each_of_its_three_runs(tmp_path, capfd):
    """Its three training runs printed one stream of lines with nothing to tell them apart."""
    from olmax.cli import main

    shards = write_synthetic_shards(tmp_path / "shards", vocab_size=512, eos_id=0, n_tokens=40_000, n_shards=1,
                                    seed=0, token_dtype="uint16")
    assert main(["resume-check", "tiny", "mesh.fsdp=1", f"data.paths={json.dumps(shards)}", "--at", "1",
                 "--steps", "2", "--out", str(tmp_path / "check")]) == 0
    headings = [line for line in capfd.readouterr().out.splitlines() if line.startswith("== resume-check ")]
    assert [h.split(":")[0] for h in headings] == [f"== resume-check {n}/3" for n in (1, 2, 3)]
    assert "stopped after step 1" in headings[1] and "resumed from its checkpoint 1" in headings[2]


def test_resume_check_writes_its_table_and_plot_through_no_link(tmp_path, capsys):
    """`resume-check --out DIR` wrote resume_check.tsv and its plot through a link planted there (its target
    overwritten): refused now, exit 2 naming it before any run, and by the writer of the results, which writes
    neither file when either would be refused."""
    from olmax.cli import main
    from olmax.errors import RunDirError

    shards = write_synthetic_shards(tmp_path / "shards", vocab_size=512, eos_id=0, n_tokens=40_000, n_shards=1,
                                    seed=0, token_dtype="uint16")
    out, target = tmp_path / "check", tmp_path / "target"
    out.mkdir()
    target.write_text("precious")
    (out / "resume_check.tsv").symlink_to(target)
    assert main(["resume-check", "tiny", "mesh.fsdp=1", f"data.paths={json.dumps(shards)}", "--at", "1",
                 "--steps", "2", "--out", str(out)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: RunDirError: {out / 'resume_check.tsv'} is a symbolic link (to {target})"), line
    assert target.read_text() == "precious" and [p.name for p in out.iterdir()] == ["resume_check.tsv"]

    from olmax.train.resume_check import write_results

    (out / "resume_check.tsv").unlink()
    (out / "resume_check.png").symlink_to(target)  # as if planted while the three runs trained
    rows = [(2, 3.5, 3.5, 0.0), (3, 3.25, 3.25, 0.0)]
    with pytest.raises(RunDirError, match="resume_check.png is a symbolic link"):
        write_results(rows, out, 1)
    assert target.read_text() == "precious" and [p.name for p in out.iterdir()] == ["resume_check.png"]
    (out / "resume_check.png").unlink()
    assert write_results(rows, out, 1).splitlines()[1] == "2\t3.5\t3.5\t0.000"
    assert (out / "resume_check.tsv").read_text().splitlines()[2] == "3\t3.25\t3.25\t0.000"
    assert (out / "resume_check.png").read_bytes().startswith(b"\x89PNG")


def test_resume_check_ends_with_its_train_process_line_and_code_and_says_what_it_deletes(tmp_path, synth_mix, capfd):
    """A train process of the check that refused its config printed its line, then the check a CalledProcessError
    traceback (exit 1); and the check's earlier runs were deleted without a word."""
    from olmax.cli import main

    out = tmp_path / "check"
    (out / "continuous" / "checkpoints").mkdir(parents=True)  # an earlier check's run
    with pytest.raises(SystemExit) as exited:
        main(["resume-check", "tiny_moe", f"data.mix_file={synth_mix}", "impl.moe.dispatch=grouped", "--at", "1",
              "--steps", "2", "--out", str(out)])
    assert exited.value.code == 2
    captured = capfd.readouterr()
    assert (f"resume-check: deleting the runs of an earlier check in {out} (continuous), to run them again\n"
            in captured.out)
    assert captured.err.startswith("olmax: ConfigError: impl.moe.dispatch=grouped: its kernels are for NVIDIA GPUs")
    assert captured.err.count("\n") == 1, captured.err
    assert not (out / "continuous").exists()  # refused before its run directory was made
