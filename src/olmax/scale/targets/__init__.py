"""Accelerators olmax plans for and compiles for, and the compile-only devices of a target.

A target names a slice: `tpu:KIND:TOPOLOGY` with libtpu's names (`tpu:v5p:4x4x8` is 128 v5p chips,
`tpu:tpu7x:4x4x4` 64 Ironwood chips) or `gpu:KINDxCOUNT` (`gpu:h100x8`, one host of 8; `gpu:h200x16`,
two hosts). Memory is per device, as the compiler sees it: for TPUs the figure in XLA's own
out-of-memory message (a test holds the table to it), for GPUs the total the driver reports.
Peak FLOP/s are dense bf16 per chip, from the vendors' pages:
https://docs.cloud.google.com/tpu/docs/tpu7x (v5p 459, v6e 918, TPU7x 2307 TFLOP/s; TPU7x has two
TensorCores per chip, each a JAX device), https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s),
NVIDIA's H100 and H200 datasheets (989 TFLOP/s without sparsity), NVIDIA's HGX page
(https://www.nvidia.com/en-us/data-center/hgx/: FP16/BF16 36 PFLOP/s for 8 B200s and for 8 B300s, with
sparsity: 2250 TFLOP/s a GPU dense; FP8 and MXFP8 twice that, 4500). B200 and B300 memory is what nvidia-smi
reports on HGX hosts (183,359 and 275,040 MiB); their target configs cite the rest. A TPU slice is at most a pod:
256 chips of v5e or v6e (16x16; https://cloud.google.com/tpu/docs/v5e, https://cloud.google.com/tpu/docs/v6e),
8,960 of v5p (https://cloud.google.com/tpu/docs/v5p), 9,216 of TPU7x (https://cloud.google.com/tpu/docs/tpu7x).
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import math
import os
import re
from dataclasses import dataclass
from importlib.resources import files

from olmax.errors import TargetError

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    platform: str  # "tpu" or "gpu"
    memory_per_device: int  # bytes
    peak_flops_per_chip: float  # dense bf16
    devices_per_chip: int = 1
    target_config: str | None = None  # GPUs: a GpuTargetConfigProto text file in this package
    pod_chips: int | None = None  # TPUs: the chips of a whole pod, the largest slice


ACCELERATORS = {
    "v5e": Accelerator("tpu", round(15.75 * GiB), 197e12, pod_chips=256),
    "v5p": Accelerator("tpu", round(95.74 * GiB), 459e12, pod_chips=8960),
    "v6e": Accelerator("tpu", round(31.25 * GiB), 918e12, pod_chips=256),
    "tpu7x": Accelerator("tpu", round(94.75 * GiB), 2307e12, devices_per_chip=2, pod_chips=9216),
    "h100": Accelerator("gpu", 81_559 * 2**20, 989e12, target_config="h100_sxm.txtpb"),
    "h200": Accelerator("gpu", 143_771 * 2**20, 989e12, target_config="h200_sxm.txtpb"),
    "b200": Accelerator("gpu", 183_359 * 2**20, 2250e12, target_config="b200_sxm.txtpb"),
    "b300": Accelerator("gpu", 275_040 * 2**20, 2250e12, target_config="b300_sxm.txtpb"),
}
GPUS_PER_HOST = 8
KIND_ALIASES = {"ironwood": "tpu7x"}  # the name Google's announcements use for TPU7x
# Compile options per chip kind, given to the compiler with every compile for that kind (it refuses a name it does not
# know, so a stale flag fails loudly). TPU7x: SparseCore offload of all-gather, reduce-scatter and all-reduce, the
# collectives running on the chip's SparseCores beside the TensorCores' compute, async collective fusion off (the two
# are exclusive): MaxText's ENABLE_SPARSECORE_OFFLOADING_FOR_RS_AG_AR with its base flags
# (https://github.com/AI-Hypercomputer/maxtext/blob/main/benchmarks/xla_flags_library.py), which MaxText's
# performance guide recommends for v7x, less `xla_sc_disjoint_spmem` and `2a886c8_chip_config_name`: libtpu takes
# those at start-up (LIBTPU_INIT_ARGS), not as compile options. A run on the chips passes the same flags as
# LIBTPU_INIT_ARGS (`olmax compile` prints them in that form).
XLA_FLAGS = {
    "tpu7x": {
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather": False,
        "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": False,
        "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter": False,
        "xla_tpu_enable_sparse_core_collective_offload_all_gather": True,
        "xla_tpu_enable_sparse_core_collective_offload_reduce_scatter": True,
        "xla_tpu_enable_sparse_core_collective_offload_all_reduce": True,
        "xla_tpu_enable_all_gather_offload_tracing": True,
        "xla_tpu_enable_reduce_scatter_offload_tracing": True,
        "xla_tpu_enable_all_reduce_offload_tracing": True,
        "xla_tpu_use_tc_device_shape_on_sc": True,
        "xla_sc_enable_instruction_fusion": False,
        "xla_sc_disable_megacore_partitioning": True,
    },
}
FLAT_TPUS = ("v5e", "v6e")  # slices of two dimensions
HOST_CHIPS = (2, 2)  # libtpu's compile-only topologies are made of hosts of 2x2 chips (its default host bounds)


@dataclass(frozen=True)
class Target:
    name: str  # as written: "tpu:v5p:4x4x8"
    kind: str  # a key of ACCELERATORS
    topology: str  # TPU: chips per dimension; GPU: slices x hosts x GPUs per host
    chips: int

    @property
    def accelerator(self) -> Accelerator:
        return ACCELERATORS[self.kind]

    @property
    def platform(self) -> str:
        return self.accelerator.platform

    @property
    def devices(self) -> int:
        return self.chips * self.accelerator.devices_per_chip

    @property
    def xla_flags(self) -> dict:
        return XLA_FLAGS.get(self.kind, {})


def parse_target(name: str) -> Target:
    tpus = sorted(k for k, a in ACCELERATORS.items() if a.platform == "tpu")
    gpus = sorted(k for k, a in ACCELERATORS.items() if a.platform == "gpu")
    usage = (f"a target is tpu:KIND:AxB[xC] (KIND one of {tpus}, or {', '.join(KIND_ALIASES)}) or gpu:KINDxN "
             f"(KIND one of {gpus})")
    if match := re.fullmatch(r"tpu:(\w+):(\d+(?:x\d+){1,2})", name):
        kind, topology = match.groups()
        kind = KIND_ALIASES.get(kind, kind)
        if kind not in tpus:
            raise TargetError(f"unknown TPU {kind!r} in target {name!r}; {usage}")
        dims = [int(d) for d in topology.split("x")]
        topology = "x".join(map(str, dims))  # as layout patterns and libtpu write it: 2x2, not 02x2
        if kind in FLAT_TPUS and len(dims) != 2:
            raise TargetError(f"target {name!r}: {kind} slices have two dimensions, as in tpu:{kind}:2x4")
        if 0 in dims or dims[0] % HOST_CHIPS[0] or dims[1] % HOST_CHIPS[1]:
            raise TargetError(f"target {name!r}: a TPU slice without the hardware is whole hosts of "
                              f"{HOST_CHIPS[0]}x{HOST_CHIPS[1]} chips (its first two sizes even and not 0), as in "
                              f"tpu:{kind}:2x2, 2x4, 4x4x8")
        if math.prod(dims) > ACCELERATORS[kind].pod_chips:
            raise TargetError(f"target {name!r} is {math.prod(dims)} chips, more than a whole {kind} pod "
                              f"({ACCELERATORS[kind].pod_chips} chips): give a slice of at most that many")
        return Target(f"tpu:{kind}:{topology}", kind, topology, math.prod(dims))
    if match := re.fullmatch(r"gpu:(\w+?)x(\d+)", name):
        kind, count = match.group(1), int(match.group(2))
        if kind not in gpus:
            raise TargetError(f"unknown GPU {kind!r} in target {name!r}; {usage}")
        if count == 0:
            raise TargetError(f"target {name!r} has no GPUs; {usage}")
        if count > GPUS_PER_HOST and count % GPUS_PER_HOST:
            raise TargetError(f"target {name!r}: more than {GPUS_PER_HOST} GPUs come in whole hosts of {GPUS_PER_HOST}")
        hosts, per_host = (1, count) if count <= GPUS_PER_HOST else (count // GPUS_PER_HOST, GPUS_PER_HOST)
        return Target(f"gpu:{kind}x{count}", kind, f"1x{hosts}x{per_host}", count)  # gpu:h100x8, not h100x008
    raise TargetError(f"bad target {name!r}; {usage}")


# JAX's device_kind -> the kind as targets name it (v5p chips call themselves "TPU v5")
TPU_KINDS = {"TPU v5": "v5p", "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e",
             "TPU v6e": "v6e", "TPU7x": "tpu7x"}


def running_target(devices) -> str | None:
    """The target `devices` (all of a run's, every process's) make, as `--target` names it (gpu:b300x8,
    tpu:v5p:4x4x8), so that a config's `layouts:` apply to a run as to a compile for its target; None for CPUs
    and for chips the device table does not have."""
    first = devices[0]
    if first.platform == "gpu" and (found := re.search(r"\b([a-z]\d{3})\b", first.device_kind.lower())):
        return f"gpu:{found.group(1)}x{len(devices)}" if found.group(1) in ACCELERATORS else None
    kind = TPU_KINDS.get(first.device_kind) if first.platform == "tpu" else None
    if kind is None:
        return None
    dims = [max(d.coords[i] for d in devices) + 1 for i in range(len(first.coords))]
    return f"tpu:{kind}:{'x'.join(map(str, dims[:2] if kind in FLAT_TPUS else dims))}"


def aot_missing(platform: str) -> str | None:
    """Why this environment cannot compile for `platform`, or None when it can."""
    # cuDNN's library: JAX asks it for its version when it traces cuDNN attention, even for a compile-only GPU
    modules, extra = {"tpu": (["libtpu"], "aot"), "gpu": (["jax_cuda12_plugin", "nvidia.cudnn"], "aot-gpu")}[platform]
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return (f"compiling for {platform.upper()} needs the {extra} extra ({module} is not installed): "
                    f"pip install -e '.[{extra}]'")
    return None


def compile_only_devices(target: Target) -> list:
    """The target's devices as JAX sees them without the hardware: enough to lower and compile, not to run.

    Unless told otherwise, JAX runs on the host's CPU here: the CUDA plugin refuses to register where it
    finds no CUDA unless the platforms were named, and then still compiles for the GPU of a target config.
    """
    import jax
    from jax.experimental import topologies

    if reason := aot_missing(target.platform):
        raise TargetError(reason)
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    # libtpu takes a lockfile so that one process owns the TPU chips; compiling owns none (and never waits for,
    # or breaks, a training process's lock)
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    if target.platform == "tpu":
        # libtpu, loaded where no TPU is, asks the cloud's metadata server what slice it is on and prints what it
        # failed to learn (three lines that look like a crash); told the slice and its one host, it says nothing
        told = {name: value for name, value in (("TPU_ACCELERATOR_TYPE", f"{target.kind}-{target.devices}"),
                                                ("TPU_WORKER_HOSTNAMES", "localhost"))
                if name not in os.environ}
        os.environ.update(told)
        try:
            topology = topologies.get_topology_desc(topology_name=f"{target.kind}:{target.topology}", platform="tpu")
        except jax.errors.JaxRuntimeError as err:
            raise TargetError(f"target {target.name}: libtpu refuses the topology ({err})") from None
        finally:
            for name in told:  # the processes this one starts are not on that slice
                del os.environ[name]
            _unset_libtpu_guesses()
    else:
        config = (files(__package__) / target.accelerator.target_config).read_text()
        topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology=target.topology)
    if len(topology.devices) != target.devices:
        raise TargetError(f"target {target.name}: the compiler gives {len(topology.devices)} devices, "
                          f"the device table expects {target.devices}")
    return topology.devices


def _unset_libtpu_guesses() -> None:
    """Unset the TPU variables libtpu, loaded without TPU hardware, wrote into this process's environment behind
    os.environ's back: CLOUD_TPU_ACCELERATOR_TYPE (and, when it was not told the slice, TPU_WORKER_ID and
    CLOUD_TPU_TASK_ID set to "WARNING: could not determine ..."). Every process started afterwards inherited them
    (an `olmax train` took itself for a TPU worker and stopped). Variables the process had before are left."""
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    guessed = []
    for i in itertools.count():
        if not environ[i]:
            break
        name = environ[i].decode(errors="replace").partition("=")[0]
        if "TPU" in name and name not in os.environ:
            guessed.append(name)
    for name in guessed:
        os.unsetenv(name)
