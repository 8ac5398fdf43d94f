"""storage.py against real S3 and GCS servers on 127.0.0.1, through faults."""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from olmax import storage
from olmax.cli import main


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_round_trip_ranges_info_list_remove(stores, kind, tmp_path):
    base = f"{kind}://{stores.bucket}/run"
    data = bytes(range(256)) * 40
    storage.write_bytes(storage.join(base, "a", "x.bin"), data)
    assert storage.read_bytes(storage.join(base, "a", "x.bin")) == data
    assert storage.read_ranges(storage.join(base, "a", "x.bin"), [0, 1000, 10235], [10, 1100, 10240]) == \
        [data[0:10], data[1000:1100], data[10235:10240]]
    meta = storage.info(storage.join(base, "a", "x.bin"))
    assert meta["size"] == len(data) and meta["version"]
    assert storage.listdir(base) == ["a"]
    assert storage.listdir(storage.join(base, "nothing")) == []
    (tmp_path / "tree" / "d").mkdir(parents=True)
    (tmp_path / "tree" / "d" / "f.txt").write_text("hello")
    storage.upload(tmp_path / "tree", storage.join(base, "tree"))
    storage.download(storage.join(base, "tree"), tmp_path / "back")
    assert (tmp_path / "back" / "d" / "f.txt").read_text() == "hello"
    storage.remove(storage.join(base, "a"))
    assert not storage.exists(storage.join(base, "a", "x.bin"))


@pytest.mark.parametrize("kind", ["s3", pytest.param("gs", marks=pytest.mark.slow)])
def test_transient_faults_are_retried_and_counted(stores, kind):
    url = f"{kind}://{stores.bucket}/f.bin"
    data = bytes(range(256)) * 8
    storage.write_bytes(url, data)
    proxy = stores.s3 if kind == "s3" else stores.gcs
    for fault in (503, "reset"):
        stores.set_faults(share=0.5, fault=fault)
        retries, faults = storage.retries(), proxy.faults
        for _ in range(10):
            assert storage.read_ranges(url, [3], [700]) == [data[3:700]]
            assert storage.info(url)["size"] == len(data)
            storage.write_bytes(url, data)
        assert proxy.faults > faults
        if fault == 503:  # retried by olmax and counted (gcsfs's info sends two requests and needs one answer;
            # aiohttp re-sends once when a reused connection is reset, so resets are only survived)
            assert 0 < storage.retries() - retries <= proxy.faults - faults


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_retry_budget_spent_names_the_url(stores, kind, monkeypatch):
    monkeypatch.setattr(storage._Settings, "retry_seconds", 0.3)
    stores.set_faults(share=1.0, fault=503)
    with pytest.raises(storage.StorageError, match=f"{kind}://{stores.bucket}/f.bin: still failing after"):
        storage.read_bytes(f"{kind}://{stores.bucket}/f.bin")


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_permanent_faults_are_named_at_once(stores, kind, monkeypatch, unused_port):
    before = storage.retries()
    with pytest.raises(storage.StorageError, match="does not exist.*check the bucket and object names"):
        storage.read_bytes(f"{kind}://{stores.bucket}/missing.bin")
    with pytest.raises(storage.StorageError, match="does not exist"):
        storage.info(f"{kind}://no-such-bucket-{stores.bucket}/x.bin")
    stores.set_faults(denied=(stores.bucket,))
    with pytest.raises(storage.StorageError, match="access denied.*credentials"):
        storage.read_bytes(f"{kind}://{stores.bucket}/x.bin")
    assert storage.retries() == before
    variable = "AWS_ENDPOINT_URL" if kind == "s3" else "STORAGE_EMULATOR_HOST"
    monkeypatch.setenv(variable, f"http://127.0.0.1:{unused_port}")
    with pytest.raises(storage.StorageError, match="cannot reach http://127.0.0.1:.*check the endpoint"):
        storage.read_bytes(f"{kind}://{stores.bucket}/x.bin")


def test_https_is_read_only():
    with pytest.raises(storage.StorageError, match="read-only; write to gs://, s3:// or a local path"):
        storage.write_bytes("https://example.invalid/x.bin", b"x")


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_many_ranges_through_faults_refetch_only_the_failed_ones(stores, kind, monkeypatch):
    """50 ranges at 30% faults: all of them at once succeed with probability 0.7**50; the failed ones alone
    are fetched again, so the read completes."""
    monkeypatch.setattr(storage._Settings, "retry_seconds", 60.0)
    url = f"{kind}://{stores.bucket}/many.bin"
    data = bytes(range(256)) * 40
    storage.write_bytes(url, data)
    stores.set_faults(share=0.3, fault=503)
    starts = list(range(0, 10000, 200))
    assert storage.read_ranges(url, starts, [s + 100 for s in starts]) == [data[s:s + 100] for s in starts]


def test_a_server_that_ignores_range_requests_is_named_as_such_exit_2(tmp_path, capsys):
    """Python's http.server answers every GET with the whole file (200, no Range support): reading shards from
    it stops with one line saying the server ignores Range requests, not that a shard shrank."""
    (tmp_path / "www").mkdir()
    np.save(tmp_path / "www" / "part-00000.npy", np.arange(20_000, dtype=np.uint16) % 500)
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path / "www")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/part-00000.npy"
    try:
        with pytest.raises(storage.StorageError, match="ignores Range requests"):
            storage.read_ranges(url, [128], [256])
        code = main(["train", "tiny", f'data.paths=["{url}"]', f"output_dir={tmp_path}/run", "train.steps=1"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "ignores Range requests" in err[0] and "shrank" not in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_missing_local_path_is_not_named_as_a_bucket_object(tmp_path, capsys):
    with pytest.raises(storage.MissingObject) as err:
        storage.read_text(str(tmp_path / "nope" / "goodput.json"))
    assert str(err.value) == f"{tmp_path}/nope/goodput.json does not exist"
    assert main(["goodput", str(tmp_path / "nope")]) == 2
    line = capsys.readouterr().err
    assert f"{tmp_path}/nope/goodput.json does not exist" in line and "bucket" not in line, line
