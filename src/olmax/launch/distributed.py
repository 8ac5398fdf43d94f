"""Join the multi-process run this process belongs to, before JAX starts its backend.

Where the process count and this process's place come from, first match wins:

1. OLMAX_* variables (`olmax launch --nprocs N` sets them; any launcher may):

       OLMAX_COORDINATOR     host:port of process 0's coordinator (127.0.0.1:PORT locally)
       OLMAX_NUM_PROCESSES   N
       OLMAX_PROCESS_ID      0 .. N-1

2. The cluster manager, found by JAX's own detection (what `jax.distributed.initialize()`
   does with no arguments): a Slurm step (`srun`), Cloud TPU VM workers (GCE metadata
   or GKE's TPU_WORKER_* variables), Open MPI's `mpirun`, Kubernetes Jobs.
3. Neither: a single-process run.

A process that is plainly part of a multi-process job which it cannot join (a Slurm batch
script of N tasks run without `srun`, the second pod of an indexed Kubernetes Job, a TPU
worker other than 0 without its peers' addresses) stops with ClusterError (exit 2) rather
than train alone on a run directory its peers share.

For a detected cluster the coordinator's host (Slurm: the first node of the step's node list) is
resolved on each node as that node resolves it (/etc/hosts, DNS), and JAX is given the address:
an unresolvable name is a ClusterError naming it, and a coordinator that does not answer within
OLMAX_COORDINATOR_TIMEOUT seconds (300 by default) is CoordinatorUnreachable naming its address
and port (exit 1: the launcher retries, as process 0 may still be starting or its node be gone; JAX
itself would abort the process without saying either).

OLMAX_LOCAL_DEVICES=D makes this process fake D CPU devices (a CPU stand-in for the
accelerators of one host; ignored by GPU/TPU backends). On CPU the processes exchange
collectives with gloo over TCP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import jax

# JAX's own cluster detection (what jax.distributed.initialize() uses); no public API says which cluster it found.
from jax._src import clusters

from olmax.config import writable_dir
from olmax.errors import ClusterError, ConfigError, CoordinatorUnreachable
from olmax.run_dir import RunDir, open_own, own_dir

ENV_COORDINATOR = "OLMAX_COORDINATOR"
ENV_NUM_PROCESSES = "OLMAX_NUM_PROCESSES"
ENV_PROCESS_ID = "OLMAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "OLMAX_LOCAL_DEVICES"
ENV_COORDINATOR_TIMEOUT = "OLMAX_COORDINATOR_TIMEOUT"
JAX_HEARTBEAT_SECONDS = 100  # jax.distributed.initialize's default
DISTRIBUTED_ENV = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
JOIN_BY_HAND = f"or set {', '.join(DISTRIBUTED_ENV)} on every process"

host_log = logging.getLogger("olmax.host")


@dataclass(frozen=True)
class Cluster:
    kind: str  # "single process", "OLMAX_* variables" or JAX's name of the detected cluster ("slurm", "gcetpu", ...)
    process_count: int = 1
    process_id: int = 0


def _int_env(name: str, minimum: int) -> int:
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer >= {minimum}")
    return number


def _detected():
    """JAX's cluster environment that applies here, None if none does."""
    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        try:
            if env.is_env_present():
                return env
        except Exception as err:  # a TPU VM whose metadata server does not answer, say
            raise ClusterError(f"cannot read the {env.name} cluster's description ({err}); {JOIN_BY_HAND}") from None
    return None


def _env_number(name: str, default: int) -> int:
    """A cluster's count or index variable: `default` when unset, exit 2 naming it when it is not a number."""
    return _int_env(name, 0) if name in os.environ else default


def _unjoinable() -> str | None:
    """Why this process is evidently one of several that no detector could join, None if it is not."""
    env = os.environ
    if "SLURM_JOB_ID" in env and _env_number("SLURM_NTASKS", 1) > 1:
        return (f"this is Slurm job {env['SLURM_JOB_ID']} of {env['SLURM_NTASKS']} tasks, but not one of its srun "
                "tasks (no SLURM_STEP_NODELIST/SLURM_PROCID): start every process with `srun`, or submit with "
                f"`olmax launch --slurm`, {JOIN_BY_HAND}")
    if _env_number("OMPI_COMM_WORLD_SIZE", 1) > 1:
        return ("this is an Open MPI rank without OMPI_MCA_orte_hnp_uri, from which JAX finds the coordinator "
                f"(Open MPI 5 launches through PRRTE and does not set it): use Open MPI 4's mpirun, {JOIN_BY_HAND}")
    if _env_number("TPU_WORKER_ID", 0) > 0:
        return (f"this is TPU worker {env['TPU_WORKER_ID']} but JAX finds no TPU VM or no TPU_WORKER_HOSTNAMES: "
                f"check that libtpu is installed and the JobSet sets the TPU variables, {JOIN_BY_HAND}")
    if _env_number("JOB_COMPLETION_INDEX", 0) > 0:
        return (f"this is pod {env['JOB_COMPLETION_INDEX']} of an indexed Kubernetes Job, which JAX only joins "
                f"with the `kubernetes` package (pip install 'jax[k8s]'): set the variables in the pod spec as "
                f"`olmax launch --k8s` writes them, {JOIN_BY_HAND}")
    return None


def join_cluster(heartbeat_seconds: int = JAX_HEARTBEAT_SECONDS) -> Cluster:
    """Join the run this process belongs to (see the module's docstring) and describe it. JAX's coordination
    service aborts every process once one has not sent a heartbeat for `heartbeat_seconds`.

    Calling it again once joined is harmless. Must run before anything touches a JAX device.
    """
    if ENV_LOCAL_DEVICES in os.environ:
        # Overrides --xla_force_host_platform_device_count in XLA_FLAGS (which a parent process may have set).
        jax.config.update("jax_num_cpu_devices", _int_env(ENV_LOCAL_DEVICES, 1))
    present = [name for name in DISTRIBUTED_ENV if name in os.environ]
    if present:
        if len(present) != len(DISTRIBUTED_ENV):
            missing = sorted(set(DISTRIBUTED_ENV) - set(present))
            raise ClusterError(f"a multi-process run needs all of {list(DISTRIBUTED_ENV)}; {missing} not set")
        num_processes = _int_env(ENV_NUM_PROCESSES, 1)
        process_id = _int_env(ENV_PROCESS_ID, 0)
        if process_id >= num_processes:
            raise ClusterError(f"{ENV_PROCESS_ID}={process_id} must be below {ENV_NUM_PROCESSES}={num_processes}")
        cluster = Cluster("OLMAX_* variables", num_processes, process_id)
        # The variables say everything: no Slurm/MPI/TPU detection guessing otherwise.
        _initialize(cluster, os.environ[ENV_COORDINATOR], heartbeat_seconds, num_processes=num_processes,
                    process_id=process_id, cluster_detection_method="deactivate")
        return cluster
    env = _detected()
    if env is None:
        if why := _unjoinable():
            raise ClusterError(why)
        return Cluster("single process")
    try:
        cluster = Cluster(env.name, env.get_process_count(), env.get_process_id())
    except Exception as err:
        raise ClusterError(f"cannot read the {env.name} cluster's process count and id ({err}); {JOIN_BY_HAND}") from None
    if cluster.process_count > 1:
        _initialize(cluster, coordinator_address(env), heartbeat_seconds, cluster_detection_method=env.name)
    return cluster


def coordinator_address(env) -> str:
    """ip:port of process 0's coordinator: the host JAX's detection names (JAX_COORDINATOR_ADDRESS when set),
    resolved here, so that every node reaches it at the address it resolves the name to itself."""
    timeout = _coordinator_timeout()
    address = os.environ.get("JAX_COORDINATOR_ADDRESS") or env.get_coordinator_address(
        timeout_secs=timeout, override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
    host, port = address.rsplit(":", 1)
    try:
        ip = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, ValueError) as err:
        raise ClusterError(f"the {env.name} coordinator's address {address!r} does not resolve on "
                           f"{socket.gethostname()} ({err}): make its host name resolvable on every node, "
                           f"{JOIN_BY_HAND}") from None
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _coordinator_timeout() -> int:
    return _int_env(ENV_COORDINATOR_TIMEOUT, 1) if ENV_COORDINATOR_TIMEOUT in os.environ else 300


def _initialize(cluster: Cluster, coordinator_address: str, heartbeat_seconds: int, **kwargs) -> None:
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = _coordinator_timeout()
    if cluster.process_id != 0:  # JAX aborts the process (no exception) when the coordinator never answers
        _wait_for_coordinator(cluster, coordinator_address, timeout)
    jax.distributed.initialize(coordinator_address=coordinator_address, initialization_timeout=timeout,
                               heartbeat_timeout_seconds=heartbeat_seconds, **kwargs)


def _wait_for_coordinator(cluster: Cluster, address: str, timeout: int) -> None:
    """Until process 0's coordinator accepts a connection; CoordinatorUnreachable, naming it, after `timeout` s."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=max(1.0, deadline - time.monotonic())).close()
            return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise CoordinatorUnreachable(
                    f"process {cluster.process_id} of {cluster.process_count} ({cluster.kind}) on "
                    f"{socket.gethostname()} could not reach the coordinator at address {host} port {port} within "
                    f"{timeout} s ({err.strerror or err}): check that process 0 is running and that port {port} is "
                    "open between the nodes") from None
            time.sleep(0.2)


class HostLogHandler(logging.StreamHandler):
    """The host log's handler: a line it cannot write (a full disk) is lost without a traceback on stderr (logging's
    own handling); the run's own error says what stopped it."""

    def handleError(self, record) -> None:
        pass

    def close(self) -> None:
        logging.getLogger().removeHandler(self)
        host_log.removeHandler(self)
        with contextlib.suppress(OSError):  # what it could not write (a full disk): closed all the same
            self.stream.close()
        super().close()


def close_host_log() -> None:
    """The end of this process's log (`announce`): a command run again in the same process starts its own."""
    for handler in host_log.handlers[:]:
        handler.close()


def announce(run_dir: Path | None, cluster: Cluster) -> str:
    """Start this process's log, RUN_DIR/logs/host-NN.log (appended to by every attempt; none without a
    local RUN_DIR), with the start-up line naming the cluster, the process count and the devices per
    process; returns that line.

    The log takes this process's warnings too (all loggers'), and the run's outcome (`olmax train`)."""
    host_log.setLevel(logging.INFO)
    host_log.propagate = False  # its lines go to this file only, not to whatever else handles the root logger
    if run_dir is not None:
        path = RunDir(writable_dir(Path(run_dir), "output_dir")).host_log(jax.process_index())
        own_dir(path.parent)
        handler = HostLogHandler(open_own(path, append=True))
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)  # warnings and errors of every logger
        host_log.addHandler(handler)
    devices = jax.local_devices()
    line = (f"olmax: process {jax.process_index()} of {jax.process_count()} ({cluster.kind}) on "
            f"{socket.gethostname()}: {len(devices)} {devices[0].platform} device{'s' * (len(devices) > 1)} "
            f"per process, {jax.device_count()} in all")
    host_log.info(line)
    return line
