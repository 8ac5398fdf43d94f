"""A two-node Slurm cluster on this machine (or its network alone, for a Ray cluster): each node a network
namespace with its own address on a private bridge, its own host name (a UTS namespace) and its own scratch
directory standing for its local disk.

    10.123.0.1   olmaxctl     the bridge, in this namespace: slurmctld, munged, the S3 server (moto)
    10.123.0.11  olmaxnode1   network namespace olmaxnode1: slurmd -N olmaxnode1
    10.123.0.12  olmaxnode2   network namespace olmaxnode2: slurmd -N olmaxnode2

The Ray cluster's network is another such, on 10.124.0.0/24 (olmaxhost, olmaxray1, olmaxray2).

The names resolve only inside the namespaces, through the hosts file this module writes to
/etc/netns/NAME/hosts (`ip netns exec` mounts it over /etc/hosts). Every task of a job sets TMPDIR and its JAX
compilation cache to its node's scratch directory (a TaskProlog), so that nothing the nodes write is shared
but the bucket. Debian's slurm-wlm, munge and iproute2 are installed when missing (as root). Everything is
removed at the end, whatever happened: the daemons, the namespaces with every process still in them, the
bridge and the hosts files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_slurm import wait_for
from testlib import apt_install

from olmax.launch.supervisor import free_port



@dataclass(frozen=True)
class Network:
    """A private /24 of a test's own (only the bridge and the namespaces made here use it): its bridge, the
    prefix of its veth devices, the controller's (bridge's) name and address, the nodes' names and addresses."""

    subnet: str
    bridge: str
    veth: str
    controller_name: str
    node_names: tuple[str, str]

    @property
    def controller(self) -> tuple[str, str]:
        return self.controller_name, f"{self.subnet}.1"

    @property
    def nodes(self) -> dict[str, str]:
        return {name: f"{self.subnet}.{11 + i}" for i, name in enumerate(self.node_names)}


# The Slurm cluster's, and the Ray cluster's (tests/launch/test_ray_two_nodes.py): tests of both may run at once.
SLURM_NETWORK = Network("10.123.0", "olmaxbr0", "olmaxv", "olmaxctl", ("olmaxnode1", "olmaxnode2"))
RAY_NETWORK = Network("10.124.0", "olmaxbr1", "olmaxw", "olmaxhost", ("olmaxray1", "olmaxray2"))
CONTROLLER, NODES = SLURM_NETWORK.controller, SLURM_NETWORK.nodes

SLURM_CONF = """\
ClusterName=olmaxnet
SlurmctldHost={ctl}({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={scratch}/munge.socket,cred_expire=10
StateSaveLocation={scratch}/state
SlurmdSpoolDir={scratch}/%n/spool
SlurmctldPidFile={scratch}/slurmctld.pid
SlurmdPidFile={scratch}/%n/slurmd.pid
SlurmctldLogFile={scratch}/slurmctld.log
SlurmdLogFile={scratch}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={scratch}/task_prolog.sh
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SlurmdParameters=config_overrides
# A node whose slurmd is gone is DOWN after 10 s (its jobs are requeued); back when its slurmd registers again.
SlurmdTimeout=10
ReturnToService=2
KillWait=10
{nodes}
PartitionName=olmax Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""
# Every task's node-local directories: its node's scratch directory (the host name is the node's).
TASK_PROLOG = """\
#!/bin/sh
echo "export TMPDIR={scratch}/$(hostname)/tmp"
echo "export JAX_COMPILATION_CACHE_DIR={scratch}/$(hostname)/jax-cache"
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _remove_network(network: Network = SLURM_NETWORK) -> None:
    """The namespaces (and every process left in them) and the bridge, from this run or one that died."""
    for name in network.nodes:
        kill_namespace(name)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    subprocess.run(["ip", "link", "delete", network.bridge], capture_output=True)


def kill_namespace(name: str) -> list[int]:
    """SIGKILL every process of namespace `name` (a node dying: its slurmd, slurmstepd and tasks); their pids."""
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _make_network(network: Network = SLURM_NETWORK) -> None:
    bridge = network.bridge
    _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "add", f"{network.controller[1]}/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n"
                                             for name, addr in [network.controller, *network.nodes.items()])
    for i, (name, addr) in enumerate(network.nodes.items(), 1):
        _ip("netns", "add", name)
        _ip("link", "add", f"{network.veth}{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", f"{network.veth}{i}", "master", bridge, "up")
        _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        Path(f"/etc/netns/{name}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{name}/hosts").write_text(hosts)


def on_node(name: str, argv: list[str]) -> list[str]:
    """`argv` run on node `name`: in its network namespace, with its hosts file over /etc/hosts (as `ip netns
    exec` mounts it, but keeping /sys and its cgroups, which slurmd needs) and its own host name."""
    return ["nsenter", f"--net=/run/netns/{name}", "unshare", "--mount", "--uts", "sh", "-c",
            f'mount --bind /etc/netns/{name}/hosts /etc/hosts && hostname {name} && exec "$@"', "sh", *argv]


def as_controller(argv: list[str]) -> list[str]:
    """`argv` run under the controller's host name (slurmctld checks that it runs on SlurmctldHost)."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {CONTROLLER[0]} && exec "$@"', "sh", *argv]


@contextlib.contextmanager
def two_node_network(network: Network):
    """The bridge and the two nodes' namespaces alone (no Slurm), removed on exit with every process in them."""
    if os.geteuid() != 0:
        pytest.skip("the two-node network needs root (network namespaces); this process is not root")
    if shutil.which("ip") is None:
        apt_install("iproute2")
    _remove_network(network)  # what a killed run of a test left
    try:
        _make_network(network)
        yield
    finally:
        _remove_network(network)


class Cluster:
    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.conf = scratch / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []
        self.slurmd: dict[str, subprocess.Popen] = {}
        self.logs = [scratch / "munged.log", scratch / "slurmctld.log", *(scratch / n / "slurmd.log" for n in NODES)]

    def start_slurmd(self, node: str) -> None:
        self.slurmd[node] = subprocess.Popen(on_node(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)]),
                                             env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def node_states(self) -> dict[str, str]:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True)
        return dict(line.split() for line in out.stdout.splitlines())

    def wait_idle(self, timeout: float = 120) -> None:
        wait_for("both Slurm nodes to be idle", lambda: set(self.node_states().values()) == {"idle"},
                  self.daemons, self.logs, timeout)

    def squeue(self) -> list[tuple[str, str]]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True, text=True)
        return [tuple(line.split()) for line in out.stdout.splitlines()]


@contextlib.contextmanager
def two_node_cluster(scratch: Path):
    """A running two-node Slurm cluster in network namespaces (see the module's doc), removed on exit."""
    if os.geteuid() != 0:
        pytest.skip("the two-node cluster needs root (network namespaces, Slurm's daemons); this process is not root")
    if shutil.which("slurmctld") is None or shutil.which("ip") is None:
        apt_install("slurm-wlm", "munge", "iproute2")
    _remove_network()  # what a killed run of this test left
    cluster = Cluster(scratch)
    for d in ("state", *NODES, *(f"{n}/{sub}" for n in NODES for sub in ("spool", "tmp", "jax-cache"))):
        (scratch / d).mkdir(parents=True, exist_ok=True)
    (scratch / "task_prolog.sh").write_text(TASK_PROLOG.format(scratch=scratch))
    (scratch / "task_prolog.sh").chmod(0o755)
    key = scratch / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cluster.conf.write_text(SLURM_CONF.format(
        ctl=CONTROLLER[0], ctl_addr=CONTROLLER[1], ctld_port=free_port(), d_port=free_port(), scratch=scratch,
        nodes="\n".join(f"NodeName={n} NodeAddr={a} CPUs=1 State=UNKNOWN" for n, a in NODES.items()),
        node_names=",".join(NODES)))
    try:
        _make_network()
        cluster.daemons.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--socket={scratch}/munge.socket", f"--key-file={key}",
             f"--pid-file={scratch}/munged.pid", f"--log-file={scratch}/munged.log", f"--seed-file={scratch}/munge.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for("munged", lambda: (scratch / "munge.socket").exists(), cluster.daemons, cluster.logs)
        cluster.daemons.append(subprocess.Popen(as_controller(["slurmctld", "-D", "-f", str(cluster.conf)]), env=cluster.env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for node in NODES:
            cluster.start_slurmd(node)
        cluster.wait_idle()
        yield cluster
    finally:
        if len(cluster.daemons) == 2:  # no job outlives the cluster
            subprocess.run(["scancel", "--full", "--partition=olmax"], env=cluster.env, capture_output=True, timeout=60)
        _remove_network()  # every slurmd, slurmstepd and task
        for daemon in [*reversed(cluster.daemons), *cluster.slurmd.values()]:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def start_moto(scratch: Path, host: str = CONTROLLER[1]) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on the bridge address `host`, where both nodes reach it: (the process, its URL)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    log = (scratch / "moto.log").open("w")
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return moto, url
        except OSError:
            assert moto.poll() is None and time.monotonic() < deadline, (scratch / "moto.log").read_text()[-2000:]
            time.sleep(0.1)
