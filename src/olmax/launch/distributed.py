"""Join a multi-process run from environment variables, before JAX starts its backend.

`olmax launch --nprocs N` sets, for each process it starts:

    OLMAX_COORDINATOR     host:port of process 0's coordinator (127.0.0.1:PORT locally)
    OLMAX_NUM_PROCESSES   N
    OLMAX_PROCESS_ID      0 .. N-1

and, optionally, OLMAX_LOCAL_DEVICES: how many CPU devices this process fakes
(a CPU stand-in for the accelerators of one host; ignored by GPU/TPU backends).
On CPU the processes exchange collectives with gloo over TCP. Any launcher
(Slurm, a Kubernetes job) can set the same variables.
"""

from __future__ import annotations

import os

import jax

from olmax.config import ConfigError

ENV_COORDINATOR = "OLMAX_COORDINATOR"
ENV_NUM_PROCESSES = "OLMAX_NUM_PROCESSES"
ENV_PROCESS_ID = "OLMAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "OLMAX_LOCAL_DEVICES"
DISTRIBUTED_ENV = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


def _int_env(environ, name: str, minimum: int) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer >= {minimum}")
    return number


def initialize_from_env(environ=None) -> bool:
    """Join the run the OLMAX_* variables describe; True if this is a multi-process run.

    A no-op (False) when none of the distributed variables is set, and when
    jax.distributed is already initialized, so calling it twice is harmless.
    Must run before anything touches a JAX device.
    """
    environ = os.environ if environ is None else environ
    if ENV_LOCAL_DEVICES in environ:
        # Overrides --xla_force_host_platform_device_count in XLA_FLAGS (which a parent process may have set).
        jax.config.update("jax_num_cpu_devices", _int_env(environ, ENV_LOCAL_DEVICES, 1))
    present = [name for name in DISTRIBUTED_ENV if name in environ]
    if not present:
        return False
    if len(present) != len(DISTRIBUTED_ENV):
        missing = sorted(set(DISTRIBUTED_ENV) - set(present))
        raise ConfigError(f"a multi-process run needs all of {list(DISTRIBUTED_ENV)}; {missing} not set")
    if jax.distributed.is_initialized():
        return True
    num_processes = _int_env(environ, ENV_NUM_PROCESSES, 1)
    process_id = _int_env(environ, ENV_PROCESS_ID, 0)
    if process_id >= num_processes:
        raise ConfigError(f"{ENV_PROCESS_ID}={process_id} must be below {ENV_NUM_PROCESSES}={num_processes}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=environ[ENV_COORDINATOR],
        num_processes=num_processes,
        process_id=process_id,
        # The variables say everything: no Slurm/MPI/TPU auto-detection guessing otherwise.
        cluster_detection_method="deactivate",
    )
    return True
