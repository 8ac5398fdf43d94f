"""One device of a target as the step-time model sees it (`Hardware`): the matrix unit's peak rates and tile, the
memory's and the links' bandwidths, and the topology its collectives cross. From a target's datasheet constants
(`target_hardware`, olmax.scale.targets names their sources) or measured on this machine's CPU (`measure_cpu`).
On a GPU a matmul's rate is what XLA's measured GEMM table gives its shape and dtype (`gemm_rate`)."""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One device of a target as the model sees it (rates are per device, bytes per second one way)."""

    name: str
    platform: str  # tpu, gpu or cpu
    matmul_flops: dict  # operand dtype -> dense FLOP/s at the datasheet's peak
    matmul_efficiency: float  # the fraction of that peak a large matmul sustains
    memory_bandwidth: float
    memory_efficiency: float
    tile: tuple[int, int, int]  # the matrix unit's (m, n, k): dimensions are padded to multiples of these
    link_bandwidth: float = 0.0  # TPU: one ICI link, one way; GPU: NVLink per GPU, one way
    network_bandwidth: float = 0.0  # GPU: between hosts, per GPU, one way
    collective_efficiency: float = 1.0
    collective_latency: float = 0.0  # seconds per collective
    op_overhead: float = 0.0  # seconds per op launched
    cache_bytes: int = 0  # CPU: an op whose bytes fit its last-level cache moves them at cache_bandwidth
    cache_bandwidth: float = 0.0
    torus: tuple[int, ...] = ()  # TPU: chips per dimension of the slice
    wraparound: bool = False  # TPU: the slice's dimensions close into rings
    devices_per_chip: int = 1
    hosts: int = 1  # GPU: hosts of `devices_per_host`
    devices_per_host: int = 8
    gemm_table: str = ""  # GPU: XLA's measured GEMM table for this architecture (sm_90, sm_100): see gemm_rate
    clock: float = 0.0  # TPU: cycles a second, to read libtpu's estimated cycles per op as seconds



@functools.cache
def _gemm_tables() -> dict:
    from olmax.scale.targets import gemm_table

    return gemm_table()


def gemm_rate(architecture: str, dtype: str, m: int, n: int, k: int) -> float:
    """FLOP/s of an (m, n, k) GEMM on a GPU of `architecture` (sm_90, sm_100), by XLA's measured table
    (olmax/scale/targets/gemm_table.json, its source named there): interpolated linearly in the rate over the
    logarithms of m, n and k between the table's sizes, each size clamped to the table's range (256 to 4096),
    as XLA's own interpolator clamps. A batched matmul's batch is folded into m."""
    tables = _gemm_tables()
    table = tables[architecture]["f8" if dtype.startswith("f8") else "f32" if dtype == "f32" else "bf16"]
    grid = [math.log2(g) for g in tables["grid"]]

    def neighbours(size: int) -> tuple[int, float]:  # the lower grid index and the upper neighbour's weight
        at = min(max(math.log2(max(size, 1)), grid[0]), grid[-1])
        i = min(bisect.bisect_right(grid, at) - 1, len(grid) - 2)
        return i, (at - grid[i]) / (grid[i + 1] - grid[i])

    (i, wi), (j, wj), (h, wh) = neighbours(m), neighbours(n), neighbours(k)
    rate = 0.0
    for a, b, c in ((a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)):
        weight = (wi if a else 1 - wi) * (wj if b else 1 - wj) * (wh if c else 1 - wh)
        rate += weight * table[i + a][j + b][h + c]
    return rate * 1e12



def target_hardware(target) -> Hardware:
    """The model's view of one device of a target (olmax.scale.targets.Target): its datasheet constants."""
    from olmax.scale.targets import (COLLECTIVE_EFFICIENCY, COLLECTIVE_LATENCY, GPUS_PER_HOST, HBM_EFFICIENCY,
                                      OP_OVERHEAD)

    a = target.accelerator
    per_device = 1 / a.devices_per_chip
    dims = [int(d) for d in target.topology.split("x")]
    if a.platform == "tpu":
        # wraparound links close a slice's dimensions into rings on whole cubes of 4x4x4 (3D) or the whole 16x16
        # pod (2D); smaller slices are meshes
        wrap = all(d % 4 == 0 for d in dims) if a.torus_dimensions == 3 else all(d == 16 for d in dims)
        topology = dict(torus=tuple(dims), wraparound=wrap, devices_per_chip=a.devices_per_chip)
    else:
        topology = dict(hosts=dims[1], devices_per_host=min(GPUS_PER_HOST, target.chips))
    return Hardware(
        name=target.name, platform=a.platform,
        matmul_flops={"bf16": a.peak_flops_per_chip * per_device, "f8": a.fp8_flops_per_chip * per_device,
                      "f16": a.peak_flops_per_chip * per_device,
                      # float32 operands: one bf16 pass on a TPU (XLA's default precision), TF32 (half) on a GPU
                      "f32": a.peak_flops_per_chip * per_device * (1.0 if a.platform == "tpu" else 0.5)},
        matmul_efficiency=a.matmul_efficiency, memory_bandwidth=a.memory_bandwidth * per_device,
        memory_efficiency=HBM_EFFICIENCY, tile=a.matrix_tile, link_bandwidth=a.link_bandwidth,
        network_bandwidth=a.network_bandwidth, collective_efficiency=COLLECTIVE_EFFICIENCY,
        collective_latency=COLLECTIVE_LATENCY[a.platform], op_overhead=OP_OVERHEAD[a.platform],
        gemm_table=a.gemm_table, clock=a.clock, **topology)


def measure_cpu(repeats: int = 7) -> Hardware:
    """This machine's CPU as the model sees it, measured now (each figure the best of `repeats`): the matmul
    rate of a 1024^3 float32 and bfloat16 matmul; the bandwidth of an elementwise pass over 256 MiB (memory)
    and over 4 MiB (its last-level cache, whose size sysfs gives); the cost of one op inside a compiled program
    (a chain of 257 small matmuls against a chain of 1)."""
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return min(times)

    rates = {}
    for dtype in ("f32", "bf16"):
        a = jnp.ones((1024, 1024), {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype])
        rates[dtype] = 2 * 1024**3 / best(jax.jit(jnp.matmul), a, a)
    double = jax.jit(lambda x: x * 2.0)
    bandwidth = {}
    for size in (2**20, 64 * 2**20):  # float32 elements: 4 MiB, 256 MiB
        x = jnp.ones((size,), jnp.float32)
        bandwidth[size] = 2 * x.nbytes / best(double, x)

    def chain(n):
        def run(x):
            for _ in range(n):
                x = jnp.tanh(x @ x)
            return x
        return jax.jit(run)

    small = jnp.full((8, 8), 0.1, jnp.float32)
    per_op = max((best(chain(257), small) - best(chain(1), small)) / 256, 0.0)
    sizes = [Path(p).read_text().strip() for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    cache = max((int(v[:-1]) * {"K": 2**10, "M": 2**20}[v[-1]] for v in sizes if v[-1] in "KM"), default=0)
    return Hardware(name="this CPU", platform="cpu", matmul_flops={"f32": rates["f32"], "bf16": rates["bf16"],
                                                                   "f16": rates["bf16"]},
                    matmul_efficiency=1.0, memory_bandwidth=bandwidth[64 * 2**20], memory_efficiency=1.0,
                    tile=(1, 1, 1), op_overhead=per_op, cache_bytes=cache, cache_bandwidth=bandwidth[2**20])
