"""A run directory in a bucket is held by a lease object: a second run is refused naming the holder; a lease
its holder stopped renewing, or whose process on this host is gone, is taken over; the holder renews it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from olmax import run_lock, storage
from olmax.run_lock import RunDirError


def test_a_held_bucket_run_is_refused_and_free_once_released(stores):
    run = f"s3://{stores.bucket}/run"
    with run_lock.hold(run) as holder:
        assert json.loads(holder) == {"host": socket.gethostname(), "pid": os.getpid()}
        with pytest.raises(RunDirError, match=f"output_dir {run} is in use by another run .host "
                                              f"{socket.gethostname()}, PID {os.getpid()}, per {run}/run.lock"):
            with run_lock.hold(run):
                pass
    assert not storage.exists(f"{run}/run.lock")
    with run_lock.hold(run):
        assert storage.exists(f"{run}/run.lock")


def test_stale_and_dead_leases_are_taken_over(stores, caplog):
    run = f"gs://{stores.bucket}/run"
    lease = f"{run}/run.lock"
    storage.write_bytes(lease, json.dumps({"host": "elsewhere", "pid": 1, "token": "x",
                                           "renewed": time.time() - run_lock.STALE_S - 1}).encode())
    with run_lock.hold(run):
        assert json.loads(storage.read_text(lease))["pid"] == os.getpid()
    assert "its holder (host elsewhere, PID 1) stopped renewing it" in caplog.text
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    dead = int(ended.stdout)
    storage.write_bytes(lease, json.dumps({"host": socket.gethostname(), "pid": dead, "token": "y",
                                           "renewed": time.time()}).encode())
    with run_lock.hold(run):  # fresh, but its process on this host has ended
        assert json.loads(storage.read_text(lease))["pid"] == os.getpid()
    storage.write_bytes(lease, json.dumps({"host": "elsewhere", "pid": 1, "token": "z",
                                           "renewed": time.time()}).encode())
    with pytest.raises(RunDirError, match="host elsewhere, PID 1"):
        with run_lock.hold(run):
            pass
    assert json.loads(storage.read_text(lease))["token"] == "z"  # a refused run leaves the holder's lease alone


def test_the_holder_renews_its_lease(stores, monkeypatch):
    monkeypatch.setattr(run_lock, "RENEW_S", 0.2)
    run = f"s3://{stores.bucket}/run"
    with run_lock.hold(run):
        first = json.loads(storage.read_text(f"{run}/run.lock"))["renewed"]
        deadline = time.monotonic() + 60
        while json.loads(storage.read_text(f"{run}/run.lock"))["renewed"] == first:
            assert time.monotonic() < deadline, "the lease was not renewed"
            time.sleep(0.1)


def test_train_on_a_held_bucket_run_exits_2_before_reading_anything(stores, synth_mix, capsys):
    from olmax.cli import main

    run = f"s3://{stores.bucket}/run"
    with run_lock.hold(run):
        assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", f"data.mix_file={synth_mix}",
                     f"output_dir={run}"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"output_dir {run} is in use by another run" in err
        assert storage.listdir(run) == ["run.lock"]


def test_a_holder_that_lost_its_lease_stops_renewing_it(stores, monkeypatch, caplog):
    """Cut off past STALE_S, the holder finds another run's lease at its next renewal: it says so and leaves
    that lease alone (nor deletes it at the end)."""
    monkeypatch.setattr(run_lock, "RENEW_S", 0.2)
    run = f"s3://{stores.bucket}/run"
    lease = f"{run}/run.lock"
    with run_lock.hold(run):
        storage.write_bytes(lease, json.dumps({"host": "elsewhere", "pid": 1, "token": "other",
                                               "renewed": time.time()}).encode())
        deadline = time.monotonic() + 60
        while "lost the lease" not in caplog.text:
            assert time.monotonic() < deadline, "the loss was not noticed"
            time.sleep(0.1)
        time.sleep(0.5)
        assert json.loads(storage.read_text(lease))["token"] == "other"
    assert json.loads(storage.read_text(lease))["token"] == "other"
    assert f"lost the lease {lease} to host elsewhere, PID 1" in caplog.text
