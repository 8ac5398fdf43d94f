"""A bucket lease under faults: two runs whose lease writes cross (one delayed by the fault proxy) do not both go
on, a run whose lease another run has taken over stops at once (exit 75) without writing anything more, and a
holder's writes and deletions in its run directory are fenced by its lease."""

from __future__ import annotations

import json
import threading
import time

import pytest

from olmax import run_lock, storage
from olmax.run_lock import RunDirError


# gcsfs names the object in the upload's body, not its path: the only uploads here are the leases
@pytest.mark.parametrize("kind, method, path", [("s3", "PUT", r"/run/run\.lock"), ("gs", "POST", r"/upload/")])
def test_of_two_runs_whose_lease_writes_cross_one_goes_on(stores, kind, method, path):
    run = f"{kind}://{stores.bucket}/run"
    proxy = stores.s3 if kind == "s3" else stores.gcs
    delay = proxy.add("delay", method=method, path=path, times=1, seconds=3)
    outcome = {}

    def first() -> None:
        try:
            with run_lock.hold(run):
                outcome["first"] = "held"
        except RunDirError as err:
            outcome["first"] = str(err)

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.monotonic() + 60
    while not delay.hits:  # its write is on its way, late
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.01)
    with run_lock.hold(run):
        thread.join()
        assert "was taken by another run starting at the same time" in outcome["first"], outcome


@pytest.mark.parametrize("kind, method, path", [("s3", "PUT", r"/run/run\.lock"), ("gs", "POST", r"/upload/")])
def test_a_renewal_that_arrives_after_a_takeover_does_not_overwrite_the_new_lease(stores, kind, method, path,
                                                                                 monkeypatch, caplog):
    """The holder's renewal passes its check, then reaches the store only after another run has taken the lease
    over (its holder froze in between): the store refuses it, the new lease stays and the holder has lost."""
    monkeypatch.setattr(run_lock, "RENEW_S", 0.3)
    run = f"{kind}://{stores.bucket}/run"
    proxy = stores.s3 if kind == "s3" else stores.gcs
    other = json.dumps({"host": "elsewhere", "pid": 1, "token": "other", "renewed": time.time()}).encode()
    with run_lock.hold(run):
        late = proxy.add("delay", method=method, path=path, times=1, seconds=2)
        deadline = time.monotonic() + 60
        while not late.hits:  # a renewal is on its way, late
            assert time.monotonic() < deadline
            time.sleep(0.01)
        storage.write_bytes(f"{run}/run.lock", other)  # the other run's takeover lands first
        time.sleep(3)
        assert storage.read_bytes(f"{run}/run.lock") == other
        with pytest.raises(run_lock.LeaseLost, match="lost the lease .* to host elsewhere, PID 1"):
            run_lock.check_lease(run)
    assert storage.read_bytes(f"{run}/run.lock") == other  # left alone on the way out


@pytest.mark.slow
def test_a_run_whose_lease_is_taken_over_stops_writing_and_exits_75(stores, synth_mix, monkeypatch, capsys):
    from olmax.cli import main

    monkeypatch.setattr(run_lock, "RENEW_S", 0.2)
    run = f"s3://{stores.bucket}/run"
    other = json.dumps({"host": "elsewhere", "pid": 1, "token": "other", "renewed": time.time() + 3600}).encode()

    stopped = threading.Event()

    def take_over() -> None:  # as a run started while this one was cut off for longer than the lease lasts,
        while not storage.exists(f"{run}/checkpoints/2/{storage.COMMIT_MARKER}"):
            time.sleep(0.01)
        while not stopped.wait(0.1):  # which renews its lease
            storage.write_bytes(f"{run}/run.lock", other)

    thread = threading.Thread(target=take_over, daemon=True)
    thread.start()
    try:
        assert main(["train", "tiny", "mesh.fsdp=1", "train.steps=30", "checkpoint.every=2",
                     f"data.mix_file={synth_mix}", f"output_dir={run}"]) == 75
    finally:
        stopped.set()
        thread.join()
    err = capsys.readouterr().err
    assert f"lost the lease {run}/run.lock to host elsewhere, PID 1" in err and len(err.splitlines()) == 1, err
    assert max(int(s) for s in storage.listdir(f"{run}/checkpoints")) <= 4
    assert storage.read_bytes(f"{run}/run.lock") == other  # the other run's lease, left alone


@pytest.mark.parametrize("renewed", ["soon", None, True, time.time() + 10 * run_lock.STALE_S],
                         ids=["text", "null", "bool", "future"])
def test_a_lease_with_no_time_or_one_in_the_future_is_taken_over(stores, renewed, caplog):
    run = f"s3://{stores.bucket}/run"
    storage.write_bytes(f"{run}/run.lock", json.dumps({"host": "elsewhere", "pid": 1, "token": "x",
                                                       "renewed": renewed}).encode())
    with run_lock.hold(run):
        assert json.loads(storage.read_text(f"{run}/run.lock"))["token"] != "x"
    assert "its holder (host elsewhere, PID 1) stopped renewing it" in caplog.text


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_holder_that_lost_its_lease_can_commit_write_or_delete_nothing(stores, kind):
    """A commit, a record or a deletion renews the lease first: one taken over a moment ago is found lost."""
    run = f"{kind}://{stores.bucket}/run"
    storage.write_bytes(f"{run}/checkpoints/2/params", b"theirs")
    with run_lock.hold(run):
        storage.write_bytes(f"{run}/committed.json", b"{}")  # held: it goes through
        other = json.dumps({"host": "elsewhere", "pid": 1, "token": "other", "renewed": time.time()}).encode()
        storage.write_bytes(f"{run}/run.lock", other)
        for write in (lambda: storage.write_bytes(f"{run}/committed.json", b"mine"),
                      lambda: storage.commit(f"{run}/checkpoints/2"),
                      lambda: storage.remove(f"{run}/checkpoints/2")):
            with pytest.raises(run_lock.LeaseLost, match=f"lost the lease {run}/run.lock to host elsewhere, PID 1"):
                write()
        assert storage.read_bytes(f"{run}/committed.json") == b"{}"
        assert storage.listdir(f"{run}/checkpoints/2") == ["params"]
    assert storage.read_bytes(f"{run}/run.lock") == other  # the other run's lease, left alone


def test_a_holder_whose_lease_ran_out_uploads_nothing_before_renewing_it(stores, tmp_path, monkeypatch):
    """The files of an upload pass a check of the lease's age, not a request each: once STALE_S / 2 have passed
    without a renewal (the holder was stopped, say), the next file renews the lease first, and finds it lost."""
    monkeypatch.setattr(run_lock, "STALE_S", 1.0)
    monkeypatch.setattr(run_lock, "RENEW_S", 3600.0)  # no renewal but the fence's
    run = f"s3://{stores.bucket}/run"
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "params").write_bytes(b"mine")
    with run_lock.hold(run):
        storage.upload(tmp_path / "step", f"{run}/checkpoints/2")  # fresh: no request but the upload's
        storage.write_bytes(f"{run}/run.lock", json.dumps({"host": "elsewhere", "pid": 1, "token": "other",
                                                           "renewed": time.time()}).encode())
        lease = run_lock._HELD[run]
        while time.monotonic() - lease.confirmed < run_lock.STALE_S / 2:
            time.sleep(0.05)
        with pytest.raises(run_lock.LeaseLost, match="lost the lease"):
            storage.upload(tmp_path / "step", f"{run}/checkpoints/4")
    assert storage.listdir(f"{run}/checkpoints") == ["2"]
