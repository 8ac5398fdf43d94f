"""The fault proxy does what its rules say, seen by a plain HTTP client in front of moto's S3 server."""

from __future__ import annotations

import http.client
import time

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
