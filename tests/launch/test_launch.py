"""The supervisor's decisions, with scripted children (no training): backoff, bad input, preemption, groups, signals."""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from olmax.config import ConfigError
from olmax.launch import cli as launch_cli
from olmax.launch.supervisor import Backoff, Supervisor, latest_checkpoint_step

# A stand-in for `olmax train`: attempt k (counted per process) follows PLAN[k] (the last entry repeats):
# write checkpoint directory `checkpoint`, then exit with `exit` (per process if a list; null: hang until
# killed; negative: kill itself with that signal). On SIGTERM it writes `on_sigterm_checkpoint` and exits 75.
FAKE_TRAIN = r"""
import json, os, pathlib, signal, sys, time
run = pathlib.Path(next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("output_dir=")))
pid = int(os.environ.get("OLMAX_PROCESS_ID", "0"))
plan = json.loads(os.environ["FAKE_PLAN"])
run.mkdir(parents=True, exist_ok=True)
counter = run / f"attempts-{pid}"
attempt = len(counter.read_text()) if counter.exists() else 0
counter.write_text("x" * (attempt + 1))
(run / f"env-{attempt}-{pid}.json").write_text(json.dumps({k: v for k, v in os.environ.items() if k.startswith("OLMAX_")}))
entry = plan[min(attempt, len(plan) - 1)]
def checkpoint(step):
    if step and pid == 0:
        (run / "checkpoints" / str(step)).mkdir(parents=True, exist_ok=True)
def preempted(sig, frame):
    checkpoint(entry.get("on_sigterm_checkpoint"))
    sys.exit(75)
signal.signal(signal.SIGTERM, preempted)
(run / f"ready-{attempt}-{pid}").write_text(str(os.getpid()))
checkpoint(entry.get("checkpoint"))
code = entry["exit"][pid] if isinstance(entry["exit"], list) else entry["exit"]
if entry.get("after_peer") == pid:  # exit once the other process is dead (a zombie until the launcher polls)
    peer = run / f"ready-{attempt}-{1 - pid}"
    while not peer.exists() or not peer.read_text():
        time.sleep(0.01)
    stat = pathlib.Path(f"/proc/{peer.read_text()}/stat")
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
if code is None:
    while True:
        time.sleep(0.05)
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""
FAKE_COMMAND = (sys.executable, "-c", FAKE_TRAIN)
BACKOFF = Backoff(0.1, 2.0, 0.3)


def _supervise(tmp_path, plan, *, steps=12, **kwargs):
    sleeps, lines = [], []
    env = {**os.environ, "FAKE_PLAN": json.dumps(plan)}
    kwargs.setdefault("backoff", BACKOFF)
    supervisor = Supervisor("tiny", [f"output_dir={tmp_path}/run", f"train.steps={steps}"], command=FAKE_COMMAND,
                            env=env, sleep=sleeps.append, echo=lines.append, **kwargs)
    code = supervisor.run()
    records = [json.loads(ln) for ln in (tmp_path / "run" / "launch.jsonl").read_text().splitlines()]
    assert len(lines) >= len(records)
    return code, sleeps, records


def test_crashes_back_off_exponentially_up_to_the_cap_then_give_up(tmp_path):
    code, sleeps, records = _supervise(tmp_path, [{"exit": 1}], max_retries=3)
    assert code == 1
    assert sleeps == [0.1, 0.2, 0.3]
    assert [r["reason"] for r in records] == ["crashed (exit 1)"] * 4
    assert records[-1]["action"] == "give up: 4 failures in a row (--max-retries 3)"
    assert [r["attempt"] for r in records] == [1, 2, 3, 4]


def test_progress_resets_the_backoff_and_a_signal_death_is_a_crash(tmp_path):
    plan = [{"exit": 1}, {"exit": -signal.SIGKILL}, {"checkpoint": 6, "exit": 1}, {"exit": 1}, {"exit": 0}]
    code, sleeps, records = _supervise(tmp_path, plan, max_retries=3)
    assert code == 0
    assert sleeps == [0.1, 0.2, 0.1, 0.2]
    assert [r["reason"] for r in records] == [
        "crashed (exit 1)", "killed by SIGKILL", "crashed (exit 1)", "crashed (exit 1)", "finished"]
    assert [(r["checkpoint_before"], r["checkpoint_after"]) for r in records][2:] == [(0, 6), (6, 6), (6, 6)]
    assert [r["failures_in_a_row"] for r in records] == [1, 2, 1, 2, 2]
    assert records[-1]["action"] == "done"


@pytest.mark.parametrize("code, reason", [(2, "bad input"), (3, "diverged"), (74, "disk full")])
def test_bad_input_divergence_and_a_full_disk_are_not_retried(tmp_path, code, reason):
    exit_code, sleeps, records = _supervise(tmp_path, [{"exit": code}])
    assert (exit_code, sleeps, len(records)) == (code, [], 1)
    assert records[0]["reason"] == reason
    assert records[0]["action"].startswith("stop")


def test_preemption_restarts_at_once_unless_it_wrote_no_checkpoint(tmp_path):
    plan = [{"checkpoint": 3, "exit": 75}, {"checkpoint": 6, "exit": 75}, {"exit": 75}, {"exit": 0}]
    code, sleeps, records = _supervise(tmp_path, plan, max_retries=3)
    assert code == 0
    assert sleeps == [0.1], "only the preemption without a new checkpoint counts as a failure"
    assert [r["reason"] for r in records] == ["preempted", "preempted", "preempted", "finished"]
    assert [r["action"] for r in records][:2] == ["restart now", "restart now"]


def test_a_crash_after_the_final_checkpoint_is_a_finished_run(tmp_path):
    code, sleeps, records = _supervise(tmp_path, [{"checkpoint": 12, "exit": 1}], steps=12)
    assert (code, sleeps, len(records)) == (0, [], 1)
    assert records[0]["action"] == "done: the final checkpoint 12 was written"


def test_a_group_restarts_whole_when_one_process_dies(tmp_path):
    plan = [{"checkpoint": 3, "exit": [None, 1]}, {"checkpoint": 12, "exit": [0, 0]}]
    code, sleeps, records = _supervise(tmp_path, plan, nprocs=2)
    assert code == 0
    assert sleeps == [0.1], "a crash backs off even when it made progress (the count restarts at 1)"
    assert records[0]["exit_codes"] == [-signal.SIGKILL, 1], "process 0 hung in a collective: killed"
    assert records[0]["reason"] == "crashed (exit 1) (process 1)"
    assert records[1]["exit_codes"] == [0, 0] and records[1]["action"] == "done"
    for attempt in (0, 1):
        envs = [json.loads((tmp_path / "run" / f"env-{attempt}-{pid}.json").read_text()) for pid in (0, 1)]
        assert [e["OLMAX_PROCESS_ID"] for e in envs] == ["0", "1"]
        assert {e["OLMAX_NUM_PROCESSES"] for e in envs} == {"2"}
        assert envs[0]["OLMAX_COORDINATOR"] == envs[1]["OLMAX_COORDINATOR"]
        assert envs[0]["OLMAX_COORDINATOR"].startswith("127.0.0.1:")


def test_a_process_killed_by_a_signal_names_the_attempt_over_a_peer_that_failed_because_of_it(tmp_path, monkeypatch):
    """Process 1 is killed; process 0 exits 1 right after (its peer vanished), before the launcher next looks."""
    monkeypatch.setattr("olmax.launch.supervisor.POLL_SECONDS", 1.0)
    plan = [{"exit": [1, -signal.SIGKILL], "after_peer": 0}, {"checkpoint": 12, "exit": [0, 0]}]
    code, sleeps, records = _supervise(tmp_path, plan, nprocs=2)
    assert code == 0
    assert records[0]["exit_codes"] == [1, -signal.SIGKILL]
    assert records[0]["reason"] == "killed by SIGKILL (process 1)"


def test_sigterm_to_the_launcher_reaches_the_run_which_checkpoints_and_stops(tmp_path):
    run = tmp_path / "run"

    def preempt_when_ready(procs):
        def send():
            while not (run / "ready-0-0").exists():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=send, daemon=True).start()

    previous = signal.getsignal(signal.SIGTERM)
    code, sleeps, records = _supervise(tmp_path, [{"exit": None, "on_sigterm_checkpoint": 9}], on_start=preempt_when_ready)
    assert code == 75
    assert signal.getsignal(signal.SIGTERM) is previous, "the launcher's handlers are removed when it returns"
    assert len(records) == 1 and sleeps == []
    assert records[0]["reason"] == "preempted" and records[0]["checkpoint_after"] == 9
    assert records[0]["action"] == "stop: the launcher got SIGTERM"
    assert latest_checkpoint_step(run) == 9


# A launcher whose attempt fails at once and which then backs off 0.01 s, SIGTERMed at the k-th line or call into C
# its backoff runs on the main thread, for every k (a line trace and a profile deliver it: deterministic); then with a
# backoff of 600 s, SIGTERMed just before the call that blocks (the first that took the whole 0.01 s). A handler that
# takes a lock the wait holds (threading.Event.set's) waits there for itself, and a wait the signal does not wake
# blocks on: faulthandler then ends the process with its stacks.
SIGTERM_AT_EACH_STEP_OF_THE_BACKOFF = """
import faulthandler, os, signal, sys, time
faulthandler.dump_traceback_later(60, exit=True)
from olmax.launch.launcher import Launcher

class Failing(Launcher):
    def __init__(self, k, backoff):
        super().__init__("tiny", [sys.argv[1] + str(k)], echo=lambda line: None)
        self.k, self.backoff_s, self.steps, self.took = k, backoff, [], []

    def submit(self):
        sys.settrace(None)
        sys.setprofile(None)

    def follow(self, job):
        if self.steps:
            return 1, 0.0  # one backoff is all

        def step(frame, event, arg):
            if event == "c_return":
                self.took.append(time.monotonic() - self.called)
            if event in ("line", "c_call") and frame.f_code is not Failing.submit.__code__:  # the backoff's
                self.steps.append(event)
                if len(self.steps) == self.k:
                    os.kill(os.getpid(), signal.SIGTERM)
                self.called = time.monotonic()
            return step
        sys.settrace(step)
        sys.setprofile(step)
        return None, self.backoff_s

counted = Failing(0, 0.01)
counted.run()
for k in range(1, len(counted.steps) + 1):
    assert Failing(k, 0.01).run() == 75, k
calls = [i + 1 for i, event in enumerate(counted.steps) if event == "c_call"]
blocking = next(k for k, took in zip(calls, counted.took) if took >= 0.01)
assert Failing(blocking, 600.0).run() == 75
print(f"stopped at each of {len(counted.steps)} steps")
"""


def test_a_sigterm_at_any_step_of_the_backoff_stops_the_launcher(tmp_path):
    done = subprocess.run([sys.executable, "-c", SIGTERM_AT_EACH_STEP_OF_THE_BACKOFF, f"output_dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("stopped at each of"), done.stderr[-3000:]


@pytest.mark.slow
def test_children_do_not_outlive_a_launcher_killed_outright(tmp_path):
    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from olmax.launch.supervisor import Supervisor; "
        "Supervisor('tiny', [sys.argv[1]], command=(sys.executable, '-c', os.environ['FAKE_TRAIN'])).run()"),
        f"output_dir={run}"], env={**os.environ, "FAKE_TRAIN": FAKE_TRAIN,
                                   "FAKE_PLAN": json.dumps([{"exit": None, "on_sigterm_checkpoint": 9}])})
    deadline = time.monotonic() + 60
    while not (run / "ready-0-0").exists():
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.01)
    launcher.kill()
    launcher.wait()
    try:
        while not (run / "checkpoints" / "9").exists():
            assert time.monotonic() < deadline, "the orphaned child did not get SIGTERM"
            time.sleep(0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int((run / "ready-0-0").read_text()), signal.SIGKILL)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="olmax")
    launch_cli.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_options_and_a_real_bad_input_child_exit_2_without_retry(tmp_path, capfd):
    args = _parse(["launch", "local", "tiny", f"output_dir={tmp_path}/run", f"data.paths={json.dumps([str(tmp_path / 'none.npy')])}",
                   "--retry-backoff", "0.1", "--backoff-factor", "3", "--backoff-max", "5", "--max-retries", "4"])
    assert (args.retry_backoff, args.backoff_factor, args.backoff_max, args.max_retries, args.nprocs) == (0.1, 3, 5, 4, 1)
    with pytest.raises(SystemExit) as exit_info:
        args.func(args)
    assert exit_info.value.code == 2
    records = [json.loads(ln) for ln in (tmp_path / "run" / "launch.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["exit_codes"]) for r in records] == [("bad input", [2])]
    assert "none.npy" in capfd.readouterr().err, "the child's error names the missing file"


def test_defaults_and_refusals():
    """On one host a restart is cheap: the first backoff is 10 s (300 s cost a tiny run killed once 65.6% of its wall
    time), doubling per failure in a row up to an hour; a Slurm job's resubmission still starts at 300 s."""
    args = _parse(["launch", "local", "tiny"])
    assert (args.retry_backoff, args.backoff_factor, args.backoff_max, args.max_retries, args.nprocs) == (10, 2, 3600, 50, 1)
    assert _parse(["launch", "slurm", "tiny"]).retry_backoff == 300
    with pytest.raises(ConfigError, match="--nprocs >= 1"):
        args.func(_parse(["launch", "local", "tiny", "--nprocs", "0"]))
    with pytest.raises(ConfigError, match="train.steps"):
        Supervisor("tiny", ["train.steps=many"])
    assert Backoff().delay(1) == 300 and Backoff().delay(4) == 2400 and Backoff().delay(9) == 3600


def test_two_bucket_runs_of_one_name_keep_their_own_records_here(tmp_path, monkeypatch):
    """Launched side by side, runs of one config in two buckets (or two prefixes) each hold their own records
    directory here."""
    from olmax.launch.launcher import records_mirror

    monkeypatch.chdir(tmp_path)
    first, second = (Supervisor("tiny", [f"output_dir={url}"]) for url in ("s3://a/tiny", "s3://b/tiny/"))
    with first.holding(), second.holding():
        assert (first.records, second.records) == (Path("runs/s3/a/tiny"), Path("runs/s3/b/tiny"))
    assert records_mirror("gs://b/some/run/") == Path("runs/gs/b/some/run")


def test_a_bucket_runs_launch_records_go_to_a_directory_here(tmp_path, capsys, monkeypatch):
    """A bucket has no appending: a run there keeps launch.jsonl, job scripts, manifests and Slurm's output in
    its URL mirrored under runs/ here, or launch.records_dir; a records_dir in a bucket is refused with exit 2,
    nothing written."""
    from olmax.cli import main

    monkeypatch.chdir(tmp_path)
    data = 'data.paths=["gs://tokens/part-0.npy"]'
    assert main(["launch", "slurm", "tiny", data, "output_dir=gs://runs/tiny", "--dry-run"]) == 0
    assert f"#SBATCH --output={tmp_path}/runs/gs/runs/tiny/slurm/%j.out" in capsys.readouterr().out
    assert main(["launch", "k8s", "tiny", data, "output_dir=gs://runs/tiny", f"launch.records_dir={tmp_path}/rec/{{name}}",
                 "--target", "tpu:v5p:2x2x2", "--image", "olmax:1"]) == 0
    assert (tmp_path / "rec" / "tiny" / "jobset.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"]
    assert main(["launch", "tiny", "output_dir=gs://runs/tiny", "launch.records_dir=gs://runs/records"]) == 2
    err = capsys.readouterr().err
    assert "launch.records_dir: must be a filesystem path" in err and err.count("gs://runs/records") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"]



def test_a_long_backoff_says_how_long_it_has_waited_and_how_long_is_left(tmp_path, monkeypatch):
    """launch local waited out its backoff in silence (300 s after one kill -9 of a tiny run): a wait longer than
    5/6 of progress.SILENCE says so each time that much has passed, from the main thread (a signal handler may
    not print: it takes no lock)."""
    from olmax.launch import launcher

    monkeypatch.setattr(launcher, "SILENCE", 0.6)  # a line every 0.5 s
    lines = []
    supervisor = Supervisor("tiny", [f"output_dir={tmp_path}/run"], command=FAKE_COMMAND, echo=lines.append)
    supervisor.wait(1.2)
    assert len(lines) == 2, lines
    assert re.match(r"olmax launch: \[\d+ s\] waiting \d+ s more before attempt 1 ", lines[0]), lines
    assert "backoff after 0 failure(s) in a row" in lines[0]
