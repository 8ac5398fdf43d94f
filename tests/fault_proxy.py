"""A fault-injecting HTTP/1.1 proxy between olmax and a local object store (moto's S3 server, fake-gcs-server).

    proxy = FaultProxy(upstream_port)             # listens on 127.0.0.1; `proxy.url` is what clients use
    rule = proxy.add("delay", seconds=0.2)        # every request forwarded 200 ms late
    proxy.add("status", method="GET", path=r"/b-1/run/metrics\\.jsonl", status=503, times=3)
    proxy.add("stale", path=LISTING, after=0, times=1)
    rule.hits                                     # how many requests the rule acted on
    proxy.remove(rule); proxy.clear(); proxy.close()

A rule acts on the requests whose method equals `method` (None: any) and whose path, query string included,
matches the regular expression `path` (`re.search`; None: any). Of those, the first `after` go by untouched and
the next `times` (None: all) are acted on. Rules are checked in the order they were added; the first that acts on
a request is the only one that does. The actions:

    delay         forward `seconds` late
    status        answer `status` (500, 503, 403, ...) without forwarding
    reset_before  reset the connection (TCP RST) without forwarding: the store never saw the request
    reset_after   forward, then reset the connection instead of answering: the store did what was asked
    truncate      forward, answer the first half of the body with a Content-Length that matches it
    stall         forward, send the headers (whole Content-Length) and half the body, then nothing for `seconds`
                  before the connection is closed
    flip          forward, answer the body with one bit flipped (the middle byte's lowest bit)
    stale         answer the first response this proxy forwarded for the same method and path (query included)
                  of a listing (see LISTING); forward when it has none yet

Every listing response forwarded (a request matching LISTING) is remembered, the first per method and path,
whether or not a rule exists, so a `stale` rule added later replays what the store said before.

`set(share, fault, denied)` is the random mode: a `share` of all requests (seeded) answered by 503 or a reset
(`fault`: 503, "reset" or "mixed", alternating), and 403 for any path with a segment in `denied`. Rules are
checked first. `requests` and `faults` count every request and every one faulted, by rules or at random;
`most_in_flight` is the most requests handled at once so far (set it to 0 to measure from then on).
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACTIONS = ("delay", "status", "reset_before", "reset_after", "truncate", "stall", "flip", "stale")
LISTING = r"[?&](list-type=2|prefix=|delimiter=)|/storage/v1/b/[^/?]+/o(\?|$)"  # S3 ListObjectsV2, GCS objects.list
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te",
              "trailer", "upgrade"}


@dataclass
class Rule:
    action: str
    method: str | None = None
    path: str | None = None
    after: int = 0
    times: int | None = None
    seconds: float = 0.0
    status: int = 503
    seen: int = 0  # matching requests so far
    hits: int = 0  # requests acted on

    def claims(self, method: str, path: str) -> bool:
        """Whether this rule acts on the request (counting it); called under the proxy's lock."""
        if self.method not in (None, method) or (self.path is not None and not re.search(self.path, path)):
            return False
        self.seen += 1
        if self.seen <= self.after or (self.times is not None and self.hits >= self.times):
            return False
        self.hits += 1
        return True


class FaultProxy:
    def __init__(self, upstream_port: int, seed: int = 0):
        self.upstream_port = upstream_port
        self.rules: list[Rule] = []
        self.first_listings: dict[tuple[str, str], tuple[int, list, bytes]] = {}
        self.share, self.fault, self.denied = 0.0, "mixed", ()
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.requests = self.faults = 0
        self.in_flight = self.most_in_flight = 0  # requests being handled now, and the most at once so far
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes | None:
                """The request's body, or None when the client went away before sending all of it. A server
                never acts on a request cut short, nor does this proxy: forwarding the part it got, with the
                Content-Length set to match, made moto store that part under the client's checksum header."""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        line = self.rfile.readline()
                        if not line.strip():
                            return None
                        if not (size := int(line.split(b";")[0], 16)):
                            break
                        chunks.append(self.rfile.read(size))
                        if len(chunks[-1]) < size or self.rfile.readline() != b"\r\n":
                            return None
                    while (line := self.rfile.readline()) != b"\r\n":
                        if not line:
                            return None
                    return b"".join(chunks)
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size)
                return body if len(body) == size else None

            def _reset(self):
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _handle(self):
                with proxy.lock:
                    proxy.in_flight += 1
                    proxy.most_in_flight = max(proxy.most_in_flight, proxy.in_flight)
                try:
                    self._act()
                finally:
                    with proxy.lock:
                        proxy.in_flight -= 1

            def _act(self):
                if (body := self._body()) is None:
                    self.close_connection = True
                    return
                rule = proxy.decide(self.command, self.path)
                action = rule.action if rule else None
                if action == "reset_before":
                    return self._reset()
                if action == "status":
                    return self._reply(rule.status, [], b"injected fault")
                if action == "delay":
                    time.sleep(rule.seconds)
                key = (self.command, self.path)
                if action == "stale" and key in proxy.first_listings:
                    return self._reply(*proxy.first_listings[key])
                status, headers, data, length = self._forward(body)
                if re.search(LISTING, self.path):
                    with proxy.lock:
                        proxy.first_listings.setdefault(key, (status, headers, data))
                if action == "reset_after":
                    return self._reset()
                if action == "truncate":
                    data = data[:len(data) // 2]
                elif action == "flip" and data:
                    middle = len(data) // 2
                    data = data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]
                elif action == "stall":
                    self.send_response(status)
                    for k, v in headers:
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    time.sleep(rule.seconds)
                    self.close_connection = True
                    return
                self._reply(status, headers, data, length)

            def _forward(self, body: bytes):
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
                return response.status, kept, data, length

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

    def add(self, action: str, *, method: str | None = None, path: str | None = None, after: int = 0,
            times: int | None = None, seconds: float = 0.0, status: int = 503) -> Rule:
        """A rule (see the module's doc), checked after those added before it."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; one of {ACTIONS}")
        rule = Rule(action, method, path, after, times, seconds, status)
        with self.lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self.lock:
            self.rules.remove(rule)

    def clear(self) -> None:
        """No rules, no random faults (remembered listings stay)."""
        with self.lock:
            self.rules.clear()
            self.share, self.fault, self.denied = 0.0, "mixed", ()

    def decide(self, method: str, path: str) -> Rule | None:
        """The rule acting on this request, or a Rule standing for a random or denied fault, or None."""
        with self.lock:
            self.requests += 1
            rule = next((r for r in self.rules if r.claims(method, path)), None)
            if rule is None and set(self.denied) & set(path.split("?")[0].split("/")):
                rule = Rule("status", status=403)
            if rule is None and self.share and self.rng.random() < self.share:
                fault = self.fault if self.fault != "mixed" else ("reset" if self.faults % 2 == 0 else 503)
                rule = Rule("reset_before") if fault == "reset" else Rule("status", status=fault)
            if rule is not None and rule.action != "delay":
                self.faults += 1
            return rule

    def set(self, share: float = 0.0, fault: str | int = "mixed", denied: tuple[str, ...] = ()) -> None:
        with self.lock:
            self.share, self.fault, self.denied = share, fault, denied

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
