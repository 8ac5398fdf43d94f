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


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_held_bucket_run_is_refused_and_free_once_released(stores, kind):
    run = f"{kind}://{stores.bucket}/run"
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
    storage.write_bytes(lease, json.dumps({"host": socket.gethostname(), "pid": _ended_pid(), "token": "y",
                                           "pid_namespace": run_lock._namespace(), "renewed": time.time()}).encode())
    with run_lock.hold(run):  # fresh, but its process, of this PID namespace, has ended
        assert json.loads(storage.read_text(lease))["pid"] == os.getpid()
    storage.write_bytes(lease, json.dumps({"host": "elsewhere", "pid": 1, "token": "z",
                                           "renewed": time.time()}).encode())
    with pytest.raises(RunDirError, match="host elsewhere, PID 1"):
        with run_lock.hold(run):
            pass
    assert json.loads(storage.read_text(lease))["token"] == "z"  # a refused run leaves the holder's lease alone


def _ended_pid() -> int:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    return int(ended.stdout)


@pytest.mark.parametrize("namespace", ["none", None, "another"])
def test_a_fresh_lease_naming_this_host_and_a_pid_gone_here_is_not_taken_over(stores, namespace):
    """Two containers can share a hostname, each with PIDs of its own: a PID that does not exist here says nothing
    of a holder in another PID namespace (or one that did not say which), whose lease stays its own until it is
    STALE_S old."""
    run = f"s3://{stores.bucket}/run"
    record = {"host": socket.gethostname(), "pid": _ended_pid(), "token": "theirs", "renewed": time.time()}
    if namespace != "none":
        record["pid_namespace"] = namespace if namespace is None else f"{run_lock._namespace()}0"
    storage.write_bytes(f"{run}/run.lock", json.dumps(record).encode())
    with pytest.raises(RunDirError, match=f"output_dir {run} is in use by another run .host {socket.gethostname()}, "
                                          f"PID {record['pid']}, per {run}/run.lock, renewed 0s ago"):
        with run_lock.hold(run):
            pass
    assert json.loads(storage.read_text(f"{run}/run.lock"))["token"] == "theirs"


def test_a_lease_renewed_ahead_of_this_hosts_clock_is_named_as_the_clocks_disagreeing(stores):
    run = f"s3://{stores.bucket}/run"
    storage.write_bytes(f"{run}/run.lock", json.dumps({"host": "elsewhere", "pid": 1, "token": "theirs",
                                                       "renewed": time.time() + 6.4}).encode())
    with pytest.raises(RunDirError, match=r"per \S+/run.lock, renewed 6s from now by this host's clock: the two "
                                          "hosts' clocks disagree"):
        with run_lock.hold(run):
            pass


@pytest.mark.parametrize("held", [b"", b"\xff\x00 not a lease", b"[1, 2]", b'"run.lock"', b"{" * 500])
def test_a_run_lock_that_is_no_lease_is_named_with_how_to_clear_it(stores, held):
    run = f"s3://{stores.bucket}/run"
    storage.write_bytes(f"{run}/run.lock", held)
    with pytest.raises(RunDirError) as err:
        with run_lock.hold(run):
            pass
    text = held.decode(errors="replace")[:80]
    assert str(err.value) == (f"output_dir {run}: {run}/run.lock holds no olmax lease ({text!r}); if no run is using "
                              f"{run}, delete {run}/run.lock and run again, else set another output_dir")
    assert storage.read_bytes(f"{run}/run.lock") == held  # left as it was
    storage.remove(f"{run}/run.lock")
    with run_lock.hold(run):  # cleared as it says
        pass


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


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_missing_bucket_is_named_as_missing_not_as_a_lost_race(stores, synth_mix, kind, capsys):
    from olmax.cli import main

    code = main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", f"data.mix_file={synth_mix}",
                 f"output_dir={kind}://missing-bucket-x/run"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"olmax: MissingBucket: bucket {kind}://missing-bucket-x does not exist (for "
                          f"{kind}://missing-bucket-x/run/run.lock); check the bucket name and the endpoint"), err


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_lease_taken_over_unnoticed_is_not_deleted_at_the_end(stores, kind):
    """The holder deletes its lease at the end only while it is the version it wrote (a conditional deletion)."""
    run = f"{kind}://{stores.bucket}/run"
    other = json.dumps({"host": "elsewhere", "pid": 1, "token": "other", "renewed": time.time()}).encode()
    with run_lock.hold(run):
        storage.write_bytes(f"{run}/run.lock", other)
    assert storage.read_bytes(f"{run}/run.lock") == other
