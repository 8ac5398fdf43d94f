"""Faults a store's responses can carry, injected by the fault proxy: a body that stalls after the headers, one cut
short under a matching Content-Length, a flipped bit: each is retried like a 503, and named in one line when it
persists past storage.retry_seconds, as an outage (its own exit code), not bad input."""

from __future__ import annotations

import pytest
from fsspec.exceptions import FSTimeoutError

from olmax import storage
from olmax.errors import ExitCode

DATA = bytes(range(256)) * 64


@pytest.fixture
def quick_timeout(monkeypatch):
    """A stalled body noticed after 1 s, not a minute (a new filesystem, made with the shorter timeout)."""
    monkeypatch.setattr(storage, "READ_TIMEOUT_S", 1.0)
    storage._filesystem.cache_clear()
    yield
    storage._filesystem.cache_clear()


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_stalled_body_is_retried(stores, kind, quick_timeout):
    url = f"{kind}://{stores.bucket}/f.bin"
    storage.write_bytes(url, DATA)
    proxy = stores.s3 if kind == "s3" else stores.gcs
    stall = proxy.add("stall", method="GET", path=r"f\.bin", times=1, seconds=30)
    before = storage.retries()
    assert storage.read_bytes(url) == DATA
    assert stall.hits == 1 and storage.retries() > before


@pytest.mark.parametrize("fault", ["truncate", "flip"])
def test_a_body_failing_its_checksum_is_retried(stores, fault, tmp_path):
    url = f"s3://{stores.bucket}/f.bin"
    storage.write_bytes(url, DATA)
    rule = stores.s3.add(fault, method="GET", path=r"f\.bin", times=2)
    assert storage.read_bytes(url) == DATA
    storage.download(url, tmp_path / "f.bin")
    assert (tmp_path / "f.bin").read_bytes() == DATA
    assert rule.hits == 2


def test_a_checksum_that_keeps_failing_is_named_as_an_outage(stores, monkeypatch):
    monkeypatch.setattr(storage._Settings, "retry_seconds", 0.5)
    url = f"s3://{stores.bucket}/f.bin"
    storage.write_bytes(url, DATA)
    stores.s3.add("flip", method="GET", path=r"f\.bin")
    with pytest.raises(storage.StorageUnavailable, match=f"{url}: still failing after .*FlexibleChecksumError") as err:
        storage.read_bytes(url)
    assert err.value.exit_code == ExitCode.STORAGE_UNAVAILABLE and len(str(err.value).splitlines()) == 1


def test_timeouts_are_transient_by_what_they_derive_from():
    from aiobotocore.response import AioReadTimeoutError

    assert storage._kind(FSTimeoutError()) == "transient"
    assert storage._kind(AioReadTimeoutError(endpoint_url="http://x", error="Read timeout")) == "transient"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["every 503", "stall"])
def test_an_outage_past_the_budget_exits_69_naming_the_object(stores, synth_mix, fault, quick_timeout, capsys):
    """The whole command, in-process: a store that answers nothing but 503, or stalls every body, stops the run
    with one line naming the object, and an exit code launchers retry; a 403 stays exit 2 (test_bucket_run)."""
    from olmax.cli import main

    if fault == "stall":
        stores.s3.add("stall", method="GET", seconds=30)
    else:
        stores.s3.add("status", status=503)
    code = main(["train", "tiny", "mesh.fsdp=1", "train.steps=2", "storage.retry_seconds=1",
                 f"data.mix_file={synth_mix}", f"output_dir=s3://{stores.bucket}/run"])
    err = capsys.readouterr().err
    assert code == ExitCode.STORAGE_UNAVAILABLE, err
    assert len(err.splitlines()) == 1 and f"s3://{stores.bucket}/run" in err and "still failing after" in err


def test_launchers_retry_an_outage_after_their_backoff():
    """`olmax launch` (and its Slurm jobs, judged by the same policy) restarts after exit 69; JobSets fail for good
    only on the codes it does not retry."""
    from olmax.errors import NOT_RETRIED
    from olmax.launch.launcher import Backoff, RetryPolicy

    policy = RetryPolicy(target_step=10, backoff=Backoff(300.0), max_retries=3)
    assert policy.decide(finished=False, code=ExitCode.STORAGE_UNAVAILABLE, before=4, after=4) == \
        (None, "restart in 300 s (retry 1 of at most 3 in a row)", 300.0)
    assert ExitCode.STORAGE_UNAVAILABLE not in NOT_RETRIED


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_missing_bucket_is_named(stores, kind):
    with pytest.raises(storage.MissingObject, match=f"bucket {kind}://nosuch does not exist") as err:
        storage.read_bytes(f"{kind}://nosuch/tiny/run.lock")
    assert f"{kind}://nosuch/tiny/run.lock" in str(err.value)


@pytest.mark.parametrize("status", [503, 403])
def test_a_failing_bucket_probe_is_not_a_missing_bucket(stores, status):
    """s3fs probes a bucket with HEAD and ?location and takes any failure for "no such bucket"."""
    stores.s3.add("status", method="HEAD", path=rf"^/{stores.bucket}/?$", status=status)
    stores.s3.add("status", path=r"[?&]location", status=status)
    assert storage.listdir(f"s3://{stores.bucket}/empty/checkpoints") == []
