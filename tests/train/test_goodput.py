"""Goodput: a supervised run killed twice accounts for its wall time by category, and its lost work is the
work of the steps the next attempts recomputed; `olmax goodput` shows it; `olmax plan --goodput`."""

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from testlib import child_env

from olmax.cli import main
from olmax.data.synthetic import write_synthetic_shards
from olmax.launch.supervisor import Backoff, Supervisor
from olmax.run_dir import RunDir
from olmax.train.goodput import CATEGORIES, Goodput, read_record, totals


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_synthetic_shards(tmp_path_factory.mktemp("shards"), vocab_size=512, eos_id=0, n_tokens=120_000,
                                  n_shards=2, seed=0, token_dtype="uint16")


class StepWatcher:
    """SIGKILLs attempt n once step kill_at[n] appears in metrics.jsonl, noting when each step of that attempt
    first appeared there."""

    def __init__(self, run: Path, kill_at: dict[int, int]):
        self.run, self.kill_at, self.kills, self.attempts = run, kill_at, [], 0

    def steps(self) -> list[int]:
        try:
            return [json.loads(line)["step"] for line in (self.run / "metrics.jsonl").read_text().splitlines()]
        except (OSError, ValueError):
            return []

    def on_start(self, procs) -> None:
        self.attempts += 1
        if self.attempts in self.kill_at:
            threading.Thread(target=self._kill, args=(procs[0], self.kill_at[self.attempts]), daemon=True).start()

    def _kill(self, proc, kill_at: int) -> None:
        before, seen = set(self.steps()), {}
        while proc.poll() is None and kill_at not in seen:
            now = time.time()
            for step in self.steps():
                if step not in before:
                    seen.setdefault(step, now)
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        killed = time.time()
        proc.wait()
        committed = max((int(p.name) for p in (self.run / "checkpoints").iterdir() if p.name.isdigit()), default=0)
        self.kills.append({"time": killed, "seen": seen, "last_logged": max(self.steps()), "committed": committed})


@pytest.mark.slow
def test_a_run_killed_twice_accounts_for_its_wall_time_and_its_lost_work(tmp_path, shards, capsys):
    run = tmp_path / "run"
    overrides = [f"data.paths={json.dumps(shards)}", f"output_dir={run}", "train.steps=30", "checkpoint.every=10",
                 "train.log_every=1", "mesh.fsdp=1"]
    watcher = StepWatcher(run, {1: 15, 2: 27})
    supervisor = Supervisor("tiny", overrides, backoff=Backoff(0.5, 1, 0.5), max_retries=3,
                            env=child_env(8), on_start=watcher.on_start)
    started = time.time()
    assert supervisor.run() == 0
    wall = time.time() - started

    record = read_record(RunDir(run).goodput.read_text())
    total = totals(record)
    assert len(record["attempts"]) == 3 and len(watcher.kills) == 2
    # Within 2%, less what no record can see: the kernel's end of each process and the launcher's polling for it
    # (0.07 s an attempt alone; the run here is a minute, a real one days). The process's start is known to the
    # clock tick and it ends without the interpreter's teardown (CI saw 3.1 s unaccounted for with both).
    assert abs(sum(total.values()) - wall) <= 0.02 * wall + 0.5 * len(record["attempts"]), (total, wall)
    slack = 1.0  # seconds: when the watcher saw a step is late by its polling, on a loaded machine more
    for attempt, kill in zip(record["attempts"], watcher.kills):
        redone = kill["last_logged"] - kill["committed"]
        # The step after the last one logged may have finished (and been recorded) before the kill.
        assert attempt["lost_steps"] in (redone, redone + 1)
        lost, seen = attempt["seconds"]["lost work"], kill["seen"]
        committed = kill["committed"]
        if committed + 1 in seen:  # committed in this attempt: lost is the work of the steps after it
            # From step c + 1 logged (its successor running) to the last one logged, only steps ran; from step c
            # logged to the kill, the save of c too. The last step seen: one more may be logged between the
            # watcher's last look and the kill (0.07 s a step with a warm compilation cache).
            assert seen[max(seen)] - seen[committed + 1] - slack <= lost
            assert lost <= kill["time"] - seen[committed] + slack
    assert total["lost work"] == pytest.approx(sum(a["seconds"]["lost work"] for a in record["attempts"]))
    assert total["productive"] > 0 and total["compilation"] > 0 and total["between attempts"] > 0

    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, 31))
    assert logged[-1]["goodput/lost work (s)"] == pytest.approx(total["lost work"])
    assert {f"goodput/{c} (s)" for c in CATEGORIES} | {"goodput/goodput (%)"} <= set(logged[-1])

    # The launcher's start before its first attempt is the first attempt's, and only the first's.
    assert record["attempts"][0]["seconds"]["launcher start-up"] > 0
    assert [a["seconds"]["launcher start-up"] for a in record["attempts"][1:]] == [0, 0]

    capsys.readouterr()
    assert main(["goodput", str(run)]) == 0
    table = capsys.readouterr().out
    assert "lost work" in table and "launcher start-up" in table and (run / "goodput.png").stat().st_size > 0


def test_writing_the_record_after_a_step_is_not_the_next_steps_data_wait(tmp_path):
    """The record is written after every step; that write was counted in the next mark's category, the time the
    next step waits for its batch: 1.3 ms a step of the tiny preset's 68 ms, 2% of its loop read as data wait."""
    RunDir(tmp_path).goodput.write_text(json.dumps({"attempts": [], "padding": "x" * 50_000_000}))  # a write that takes a while
    goodput = Goodput(tmp_path)
    goodput.resumed(0)
    began = time.time()
    goodput.step_done(1)
    written = time.time() - began
    goodput.mark("data wait")  # the batch was there at once
    seconds = goodput.attempt["seconds"]
    assert seconds["data wait"] < written / 4 < seconds["productive"], (seconds, written)


def test_the_launchers_start_up_is_the_first_attempts_category(tmp_path, monkeypatch):
    """`olmax launch` tells its first attempt when it started itself: the seconds before that attempt's process
    started are its `launcher start-up` (a newcomer's stopwatch read 15.3 s more than the record without it)."""
    from olmax.runtime import LAUNCHER_STARTED

    now = time.time()
    monkeypatch.setenv(LAUNCHER_STARTED, repr(now - 5.0))
    goodput = Goodput(tmp_path, started=now - 2.0)
    goodput.resumed(0)
    assert goodput.attempt["started"] == now - 5.0
    assert goodput.attempt["seconds"]["launcher start-up"] == pytest.approx(3.0)
    assert sum(totals(goodput.record).values()) == pytest.approx(time.time() - (now - 5.0), abs=0.5)
    monkeypatch.delenv(LAUNCHER_STARTED)
    assert Goodput(tmp_path, started=now).attempt["seconds"]["launcher start-up"] == 0


def test_the_plot_goes_into_the_run_directory_or_out_never_the_current_one(tmp_path, capsys, monkeypatch):
    run, elsewhere = tmp_path / "run", tmp_path / "cwd"
    elsewhere.mkdir()
    run.mkdir()
    goodput = Goodput(run)
    goodput.resumed(0)
    goodput.step_done(1)
    monkeypatch.chdir(elsewhere)
    assert main(["goodput", str(run)]) == 0
    assert (run / "goodput.png").stat().st_size > 0 and not list(elsewhere.iterdir())
    assert capsys.readouterr().out.endswith(f"wrote {run / 'goodput.png'}\n")
    assert main(["goodput", str(run), "--out", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert main(["goodput", str(run), "--png", str(tmp_path / "old.png")]) == 0
    assert "--png is the old spelling, kept for one release: write --out FILE" in capsys.readouterr().err
    assert (tmp_path / "old.png").exists() and not list(elsewhere.iterdir())


def test_goodput_of_a_directory_without_a_record_is_one_line_exit_2(tmp_path, capsys):
    assert main(["goodput", str(tmp_path)]) == 2
    assert f"{RunDir(tmp_path).goodput} cannot be read" in capsys.readouterr().err


def test_plan_turns_chip_hours_into_what_the_run_costs_at_a_goodput(capsys):
    """At an MFU given (no compile: the chip-hours a compiled step's prediction gives go through the same lines of
    olmax.scale.plan, which tests/scale/test_scale_plan.py compiles for)."""
    plan = ["plan", "olmo3_7b", "--target", "tpu:v5p:4x4x8", "--mfu", "0.4"]
    assert main([*plan, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*plan, "--goodput", "0.8", "--json"]) == 0
    at_goodput = json.loads(capsys.readouterr().out)["exact_window"]
    assert at_goodput["chip_hours_at_goodput"] == pytest.approx(plain["exact_window"]["chip_hours"] / 0.8)
    assert plain["exact_window"]["chip_hours_at_goodput"] is None
    assert main([*plan, "--goodput", "1.5"]) == 2


def _edited(record: dict, edit) -> str:
    record = json.loads(json.dumps(record))
    edit(record)
    return json.dumps(record)


def _set(record, path, value):
    *parents, leaf = path
    for key in parents:
        record = record[key]
    record[leaf] = value


# A record olmax cannot account for: the words its error names it by
DAMAGED = {
    "negative seconds": (lambda r: _set(r, ("attempts", 0, "seconds", "productive"), -500.0),
                         "attempt 1's seconds['productive'] is -500.0"),
    "NaN seconds": (lambda r: _set(r, ("attempts", 0, "seconds", "checkpoint"), float("nan")),
                    "attempt 1's seconds['checkpoint'] is nan"),
    "an infinite end": (lambda r: _set(r, ("attempts", 1, "ended"), float("inf")), "attempt 2's ended is inf"),
    "an end before the start": (lambda r: _set(r, ("attempts", 1, "ended"), r["attempts"][1]["started"] - 100),
                                "attempt 2 ended"),
    "an unknown category": (lambda r: _set(r, ("attempts", 0, "seconds", "coffee"), 3.0), "['coffee']"),
    "an attempt that is no record": (lambda r: r["attempts"].append("not an attempt"),
                                     'attempt 3 is "not an attempt", not a record'),
    "a snapshot without its step": (lambda r: _set(r, ("attempts", 0, "snapshots", 0, "step"), "one"),
                                    "attempt 1's snapshot"),
    "a finish that is not true or false": (lambda r: _set(r, ("attempts", 0, "finished"), "yes"),
                                           "attempt 1's finished is 'yes', not true or false"),
}


@pytest.fixture
def record(tmp_path) -> dict:
    """A run's record of two attempts, as the trainer writes it (no training: the marks only)."""
    (tmp_path / "kept").mkdir()
    for _ in range(2):
        goodput = Goodput(tmp_path / "kept")
        goodput.resumed(0)
        goodput.step_done(1)
        goodput.close()
    return json.loads(RunDir(tmp_path / "kept").goodput.read_text())


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_record_olmax_cannot_account_for_is_exit_2_naming_the_field(tmp_path, record, capsys, damage):
    edit, words = DAMAGED[damage]
    RunDir(tmp_path).goodput.write_text(_edited(record, edit))
    assert main(["goodput", str(tmp_path), "--out", str(tmp_path / "goodput.png")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"olmax: BadInput: {RunDir(tmp_path).goodput} cannot be read (") and words in line, line
    assert not (tmp_path / "goodput.png").exists()


@pytest.mark.parametrize("damage", [*DAMAGED, "torn"])
def test_a_resume_keeps_a_damaged_record_aside_and_says_so(tmp_path, record, caplog, damage):
    """The next attempt starts a new record and the damaged one is kept, whole, beside it (it was dropped without a
    word, or crashed every resume: a KeyError or TypeError, exit 1, which `olmax launch` retried for ever)."""
    damaged = json.dumps(record)[:200] if damage == "torn" else _edited(record, DAMAGED[damage][0])
    path = RunDir(tmp_path).goodput
    path.write_text(damaged)
    goodput = Goodput(tmp_path)
    goodput.resumed(0)
    goodput.step_done(1)
    [aside] = tmp_path.glob("goodput.json.damaged-*")
    assert aside.read_text() == damaged and f"{path} cannot be accounted for" in caplog.text
    assert f"kept as {aside}" in caplog.text
    assert len(read_record(path.read_text())["attempts"]) == 1


def test_the_time_between_a_finished_run_and_its_extension_is_kept_apart(tmp_path, capsys):
    """A run extended 13 minutes after it finished showed `between attempts 791.9 s, 53.5%`: the run was done, not
    stopped. That time is shown apart, out of the wall time; the time after an attempt that stopped before the
    end is still between attempts."""
    for finished in (True, False, True):  # the run finishes, is extended and stopped, then resumed to its end
        goodput = Goodput(tmp_path)
        goodput.resumed(0)
        goodput.step_done(1)
        if finished:
            goodput.finished()
        goodput.close()
    path = RunDir(tmp_path).goodput
    record = json.loads(path.read_text())
    for attempt, later in zip(record["attempts"][1:], (800.0, 830.0)):  # extended 800 s later; resumed 30 s after
        attempt["started"] += later
        attempt["ended"] += later
    path.write_text(json.dumps(record))
    assert main(["goodput", str(tmp_path), "--out", str(tmp_path / "goodput.png")]) == 0
    rows = {line[:18].strip(): line[18:].split() for line in capsys.readouterr().out.splitlines()}
    assert 30.0 <= float(rows["between attempts"][0]) < 31.0 and rows["between runs"][0] == "800.0"
    assert float(rows["wall time"][0]) < 40.0
    assert main(["report", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "page" / "report.json").read_text())
    assert 800.0 <= report["goodput"]["between_runs"] < 801.0 and report["goodput"]["seconds"]["between attempts"] < 31.0
