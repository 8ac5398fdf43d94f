"""The fault proxy does what its rules say, seen by a plain HTTP client in front of moto's S3 server."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_proxy import LISTING


def _request(stores, method: str, path: str, body: bytes = b"", timeout: float = 30):
    connection = http.client.HTTPConnection("127.0.0.1", stores.s3.port, timeout=timeout)
    headers = {"x-amz-acl": "public-read"}  # moto refuses unsigned reads of private objects
    connection.request(method, path, body=body, headers=headers | ({"Content-Length": str(len(body))} if body else {}))
    response = connection.getresponse()
    return response.status, response.read()


def test_each_action(stores):
    proxy, key = stores.s3, f"/{stores.bucket}/x.bin"
    data = bytes(range(256)) * 4
    assert _request(stores, "PUT", key, data)[0] == 200
    assert _request(stores, "GET", key) == (200, data)

    proxy.add("status", method="GET", path=r"x\.bin$", after=1, times=1, status=500)
    assert _request(stores, "GET", key) == (200, data)  # `after` lets the first one by
    assert _request(stores, "GET", key)[0] == 500
    assert _request(stores, "GET", key) == (200, data)  # `times` used up

    flip = proxy.add("flip", method="GET", times=1)
    status, flipped = _request(stores, "GET", key)
    assert flip.hits == 1 and len(flipped) == len(data)
    assert sum(bin(a ^ b).count("1") for a, b in zip(flipped, data)) == 1

    proxy.add("truncate", method="GET", times=1)
    assert _request(stores, "GET", key) == (200, data[:len(data) // 2])  # Content-Length agrees: no error

    proxy.add("stall", method="GET", times=1, seconds=30)
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=0.5)
    connection.request("GET", key)
    response = connection.getresponse()
    assert response.status == 200 and int(response.getheader("Content-Length")) == len(data)
    with pytest.raises(TimeoutError):
        response.read()

    proxy.add("reset_before", method="PUT", times=1)
    with pytest.raises(ConnectionResetError):
        _request(stores, "PUT", f"/{stores.bucket}/before.bin", b"x")
    assert _request(stores, "GET", f"/{stores.bucket}/before.bin")[0] == 404  # the store never saw it
    proxy.add("reset_after", method="PUT", times=1)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        _request(stores, "PUT", f"/{stores.bucket}/after.bin", b"y")
    assert _request(stores, "GET", f"/{stores.bucket}/after.bin") == (200, b"y")  # it did

    delay = proxy.add("delay", seconds=0.3, times=1)
    began = time.monotonic()
    assert _request(stores, "GET", key) == (200, data)
    assert delay.hits == 1 and time.monotonic() - began >= 0.3


@pytest.mark.parametrize("framing", ["Content-Length: 1000", "Transfer-Encoding: chunked"])
def test_a_put_whose_client_went_away_mid_body_leaves_the_object_as_it_was(stores, framing):
    """As a store does. The proxy forwarded the part it had read, with a Content-Length to match, and moto stored it:
    after a kill -9 during an upload, an object with an empty body under the killed client's CRC32 header."""
    proxy, key = stores.s3, f"/{stores.bucket}/torn.bin"
    assert _request(stores, "PUT", key, b"as it was")[0] == 200
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
        client.sendall(f"PUT {key} HTTP/1.1\r\nHost: 127.0.0.1\r\nx-amz-acl: public-read\r\n{framing}\r\n\r\n"
                       .encode() + (b"3e8\r\n" if "chunked" in framing else b"") + b"x" * 10)
        client.shutdown(socket.SHUT_WR)  # the body ends there, as a killed client's does
        while client.recv(4096):  # until the proxy closes the connection: it has handled the request
            pass
    assert _request(stores, "GET", key) == (200, b"as it was")


def test_a_stale_rule_replays_the_first_listing(stores):
    listing = f"/{stores.bucket}?list-type=2&prefix=run%2F"
    status, first = _request(stores, "GET", listing)
    assert status == 200 and b"<Key>" not in first
    _request(stores, "PUT", f"/{stores.bucket}/run/a", b"a")
    assert b"<Key>run/a</Key>" in _request(stores, "GET", listing)[1]
    stale = stores.s3.add("stale", path=LISTING, times=1)
    assert _request(stores, "GET", listing) == (200, first)
    assert stale.hits == 1
    assert b"<Key>run/a</Key>" in _request(stores, "GET", listing)[1]


def _running(pid: int) -> bool:
    """Whether process `pid` runs (not ended, nor a zombie nobody has reaped)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_a_killed_test_process_leaves_no_server_running():
    """An interrupted test run left its fake-gcs-server (and moto) running: a test process that starts one, as the
    fixture does, killed with SIGKILL."""
    here = Path(__file__).parent
    code = (f"import sys, time; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; from conftest import "
            "free_port, gcs_server; port = free_port(); print(gcs_server(port, f'http://127.0.0.1:{port}').pid, "
            "flush=True); time.sleep(600)")
    tests = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server = int(tests.stdout.readline())
    tests.kill()
    tests.wait()
    deadline = time.monotonic() + 60
    while _running(server) and time.monotonic() < deadline:  # the event: the server ends
        time.sleep(0.05)
    try:
        assert not _running(server)
    finally:
        if _running(server):
            os.kill(server, signal.SIGKILL)
