"""Weights & Biases logging in W&B's offline mode (no network): the records W&B writes, read back, are metrics.jsonl's
steps, each once, with their values; a W&B that fails never stops training."""

import json
import math
import signal
import socket
import threading
import time

import pytest
from scale.test_scale_report import chromium  # noqa: F401
from testlib import child_env, read_jsonl

from olmax.config import load_config
from olmax.run_dir import RunDir
from olmax.train.trainer import train

wandb = pytest.importorskip("wandb", reason="the wandb extra")

from olmax.train.wandb_log import records  # noqa: E402 - reads W&B's protobufs


@pytest.fixture(autouse=True)
def fresh_wandb():
    """W&B reads its variables (WANDB_MODE, ...) once a process, at its first run: each test starts it anew."""
    wandb.teardown()
    yield
    wandb.teardown()


def wandb_history(run_dir) -> tuple[set[str], list[dict]]:
    """(the W&B run ids, the history rows of every offline record under RUN/wandb, in the order written)."""
    ids, rows = set(), []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in records(path.read_bytes()):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return ids, rows


def run_record(run_dir):
    path = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))[0]
    return next(r.run for r in records(path.read_bytes()) if r.WhichOneof("record_type") == "run")


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def check_equal_to_metrics_jsonl(run_dir) -> list[dict]:
    """One W&B run whose steps are metrics.jsonl's, each once, with every metric's value (a vector as its indices)
    and the step's wall time."""
    ids, rows = wandb_history(run_dir)
    assert ids == {json.loads(RunDir(run_dir).wandb_record.read_text())["id"]}
    logged = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["_step"] for row in rows] == [m["step"] for m in logged]
    for row, m in zip(rows, logged):
        assert row["_timestamp"] == pytest.approx(m["wall_time"], abs=1e-6)
        for name, value in m.items():
            if isinstance(value, list):
                assert [row[f"{name}/{i}"] for i in range(len(value))] == value and row[f"{name}/_type"] == "histogram"
            elif name not in ("step", "wall_time"):
                assert same(row[name], value), (m["step"], name)
    return rows


def test_a_run_and_its_resume_are_one_wandb_run_equal_to_metrics_jsonl(tmp_path, shards, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    settings = [f"data.paths={json.dumps(shards)}", f"output_dir={run}", "mesh.fsdp=1", "checkpoint.every=3",
                "wandb.enabled=true", "wandb.project=olmo", "wandb.entity=lab", "wandb.group=ablation",
                "wandb.tags=[tiny,offline]"]
    cfg = load_config("tiny", [*settings, "train.steps=8", "train.stop_after=4"])
    train(cfg, quiet=True)
    train(load_config("tiny", [*settings, "train.steps=8"]), quiet=True)
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2  # an attempt each, one W&B run
    check_equal_to_metrics_jsonl(run)
    first = run_record(run)
    assert (first.project, first.entity, first.run_group, first.display_name, list(first.tags)) == \
        ("olmo", "lab", "ablation", "tiny", ["tiny", "offline"])  # the name: the config's
    config = {u.key: json.loads(u.value_json) for u in first.config.update if u.key != "_wandb"}
    assert config == cfg.model_dump(mode="json")  # the resolved config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("setting", ["no API key", "unreachable server"])
def test_a_wandb_that_fails_never_stops_training(tmp_path, shards, monkeypatch, capsys, setting):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    if setting == "unreachable server":  # nothing listens there: W&B's start gives up after its timeout
        monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_free_port()}")
        monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    run = tmp_path / "run"
    train(load_config("tiny", [f"data.paths={json.dumps(shards)}", f"output_dir={run}", "mesh.fsdp=1",
                               "train.steps=3", "wandb.enabled=true"]), quiet=True)
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if "W&B" in ln]
    assert line.startswith("olmax: W&B logging is off for this attempt (") and line.endswith(
        "the metrics still go to TensorBoard and metrics.jsonl"), line
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_a_run_killed_twice_under_launch_is_one_wandb_run_with_every_step_once(tmp_path, shards, chromium):
    """`olmax launch local`'s supervisor; each of the first two attempts SIGKILLed a step after a checkpoint W&B
    has been given: what W&B had not written down yet is sent again by the next attempt, nothing twice. The run's
    page marks both restarts on every chart."""
    from olmax.cli import main
    from train.test_run_page import rendered_page

    from olmax.launch.supervisor import Backoff, Supervisor

    run = tmp_path / "run"
    overrides = [f"data.paths={json.dumps(shards)}", f"output_dir={run}", "train.steps=12", "checkpoint.every=3",
                 "mesh.fsdp=1", "wandb.enabled=true"]
    kill_past = {1: 4, 2: 8}  # attempt: SIGKILLed once it has logged a step after this one
    attempts = []

    def logged_past(step) -> bool:
        try:
            return any(m["step"] > step for m in read_jsonl(run / "metrics.jsonl"))
        except (OSError, ValueError):  # not written yet, or a line being written
            return False

    def kill(proc, step):
        while proc.poll() is None and not logged_past(step):
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)

    def on_start(procs):
        attempts.append(procs)
        if len(attempts) in kill_past:
            threading.Thread(target=kill, args=(procs[0], kill_past[len(attempts)]), daemon=True).start()

    supervisor = Supervisor("tiny", overrides, backoff=Backoff(0.1, 2, 1), max_retries=3,
                            env=child_env(1, WANDB_MODE="offline"), on_start=on_start)
    assert supervisor.run() == 0
    reasons = [r["reason"] for r in read_jsonl(run / "launch.jsonl")]
    assert reasons == ["killed by SIGKILL", "killed by SIGKILL", "finished"], reasons
    assert len(list((run / "wandb").glob("offline-run-*"))) == 3
    rows = check_equal_to_metrics_jsonl(run)
    assert [row["_step"] for row in rows] == list(range(1, 13))
    assert main(["report", str(run)]) == 0
    report, page = rendered_page(chromium, run, tmp_path)
    assert report["attempts"] == 3 and len(page.charts) == 8 and all(c["restart"] == 2 for c in page.charts)
