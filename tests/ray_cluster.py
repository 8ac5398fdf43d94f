"""Ray clusters for the tests and benchmarks/tokenize_ray.py: `ray start --block` processes with ports, a temporary
directory and an auth token of their own, so that other Ray clusters on the machine are neither joined nor
disturbed; stopping a node ends every process it started (its raylet, its workers), never any other."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from olmax.launch.supervisor import free_port

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 180  # a loaded 2-core machine has taken 10 s for a head node


def ray_env(**extra: str) -> dict:
    """The environment of a cluster's nodes and its drivers: the token they all share, no usage report, and no
    memory monitor (it kills Ray's workers when the machine's memory is nearly full, whoever fills it: on a
    machine shared with other jobs, seen killing a benchmark's workers 3 times over)."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0",
            "PYTHONPATH": os.pathsep.join(sys.path), **extra}


class Node:
    """One `ray start --block` (the head when `head` is None, else a node joining the head at that address); `argv`
    wraps the command (to run it in a network namespace)."""

    def __init__(self, env: dict, ip: str, cpus: int, head: str | None = None, wrap=lambda argv: argv):
        self.temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit in 107 characters
        self.port = free_port()
        where = ["--head", f"--port={self.port}", "--include-dashboard=false", f"--dashboard-port={free_port()}",
                 f"--ray-client-server-port={free_port()}"] if head is None else [f"--address={head}"]
        self.address = f"{ip}:{self.port}" if head is None else head
        self.log = Path(self.temp_dir, "start.log")
        argv = [RAY, "start", "--block", *where, f"--node-ip-address={ip}", f"--num-cpus={cpus}",
                f"--temp-dir={self.temp_dir}", f"--dashboard-agent-listen-port={free_port()}",
                "--disable-usage-stats"]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(wrap(argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while "Ray runtime started" not in self.log.read_text():
                assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def processes(self) -> dict[int, str]:
        """{pid: command line} of every process this node started."""
        parents = {}
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        mine, found = {self.process.pid}, True
        while found:
            found = {pid for pid, parent in parents.items() if parent in mine and pid not in mine}
            mine |= found
        lines = {}
        for pid in mine - {self.process.pid}:
            with contextlib.suppress(OSError):
                lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        return lines

    def stop(self) -> None:
        """SIGKILL the node's process group: `ray start` and what it started (which stay in its group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 60
        with contextlib.suppress(ProcessLookupError):  # the group is empty: none of its processes writes any more
            while time.monotonic() < deadline:
                os.killpg(self.process.pid, 0)
                time.sleep(0.05)
        subprocess.run(["rm", "-rf", self.temp_dir])


@contextlib.contextmanager
def local_cluster(nodes: int = 2, cpus: int = 1, env: dict | None = None):
    """A head and `nodes - 1` more nodes on this machine, `cpus` each, with `env` (default: a new `ray_env()`; a
    process that drives several clusters one after another keeps its first token): (the nodes, the environment
    to drive them)."""
    env = env or ray_env()
    ip = "127.0.0.1"
    started = []
    try:
        started.append(Node(env, ip, cpus))
        while len(started) < nodes:
            started.append(Node(env, ip, cpus, head=started[0].address))
        yield started, env
    finally:
        for node in reversed(started):
            node.stop()


def kill_tasks(nodes, times: int, name: str = "ray::_tokenize_task") -> list[int]:
    """Start killing, `times` times while the nodes run, a Ray worker process of `nodes` running a tokenize task
    (each a new one: the retry of a killed task runs in a new process), or another whose command line starts with
    `name` (an actor's: `ray::CLASS`); the pids killed, filled in as it goes."""
    killed = []

    def watch():
        while len(killed) < times and all(node.process.poll() is None for node in nodes):
            running = [pid for node in nodes for pid, line in node.processes().items()
                       if line.startswith(name) and pid not in killed]
            if running:
                os.kill(running[0], signal.SIGKILL)
                killed.append(running[0])
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    return killed
