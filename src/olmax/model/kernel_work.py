"""The work a kernel does, as the step-time model (olmax.scale.step_time) costs it: from this, never from a cost
estimate its author set in the kernel.

A kernel reaches the compiled program as a custom call whose FLOPs the compiler does not count. The step-time
model finds the kernel's entry in the registry (olmax.model.kernel_registry) by its name and costs it from what
the entry returns:

    Callable[[KernelCall], Work]

The entry gets a `KernelCall`: the operands' and outputs' shapes, the grid where the program states it (Pallas
Triton's `grid_x/y/z`; Mosaic kernels serialize theirs, so an entry computes its grid from the shapes as its
kernel does), the call's frontend attributes and, for MoE kernels, the routing's distribution of the rows its
groups get (`RoutedRows`). It returns the kernel's `Work` in all (every grid step together): FLOPs, bytes moved to
and from HBM with each operand read once (L2 serving every re-read), the bytes its tiles load (each re-read from
HBM), the matmul tile each grid step multiplies (m, n, k: how well it fills the matrix unit), the operands' dtype
and the rate its design reaches as a fraction of cuBLAS's (`OF_CUBLAS`). A kernel's entry lives beside the
kernel, in its module's WORK, which the registry names.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Protocol

# A kernel's TensorCore rate as a fraction of cuBLAS's, by how far its design goes: JAX's guide "Writing
# high-performance matrix multiplication kernels for Blackwell" (docs.jax.dev; jax-ml/jax,
# docs/pallas/gpu/blackwell_matmul.md) measures each step of one kernel against cuBLAS (jax.dot) on a 4096 x 8192
# x 4096 float16 matmul: pipelined in one warpgroup, 59.4%; warp-specialized (a TMA warp, an MMA warp) with a tiled
# epilogue, 88.1%; with 2-SM collective MMAs, persistent, with a warpgroup of its own for the epilogue, 100%. The
# step-time model rates a kernel at cuBLAS's rate for its tiles, and at this fraction of it at the slow end of the
# kernel's range.
OF_CUBLAS = {"pipelined": 0.594, "warp-specialized": 0.881, "persistent, collective": 1.0}


class Shape(Protocol):
    dims: tuple[int, ...]
    dtype: str  # as HLO writes it: bf16, f32, f8e4m3fn, s32
    bytes: float  # its size in HBM


@dataclass(frozen=True)
class RoutedRows:
    """The rows an MoE layer's grouped kernels run on a device, from the routing's distribution: each of the
    `devices` x `tokens` tokens of an expert group sends its top_k assignments to distinct experts of `experts`,
    each expert equally likely (OLMo-core's random routing for system benchmarks; a balanced router's average,
    with its spread). A device runs its experts / devices experts, a group each. An expert's rows are binomial,
    not their mean, so its group is padded to a block by (-rows) mod block rows whatever the mean; and the
    devices' rows differ, so the busiest device, whose kernels the others wait for at the exchange back, runs
    more than the mean."""

    experts: int
    top_k: int
    devices: int  # of the expert group (1: each device runs every expert on its own tokens)
    tokens: int  # a device's, in one exchange (or, without expert parallelism, in one call)

    @property
    def groups(self) -> int:
        return self.experts // self.devices

    @property
    def per_group(self) -> float:
        """Rows an expert gets, expected."""
        return self.devices * self.tokens * self.top_k / self.experts

    def padding(self, block: int) -> float:
        """Rows a group is padded with to a multiple of `block`, expected."""
        return _padding(self.devices * self.tokens, self.top_k, self.experts, block)[0]

    def busiest(self, block: int) -> float:
        """Rows the busiest device of the group runs over a device's mean, its groups padded to `block`, expected.
        A token sends a device a hypergeometric number of its top_k assignments, so a device's rows are near
        normal; its groups' paddings add their own spread; the devices' rows sum to the group's assignments (a
        correlation of -1 / (n - 1) between two devices' rows): the largest of n exceeds the mean by
        E[max of n standard normals] x sqrt(its variance x (1 - their correlation))."""
        n = self.devices
        if n == 1:
            return 0.0
        share = self.groups / self.experts
        rows = (n * self.tokens * self.top_k * share * (1 - share) * (self.experts - self.top_k)
                / (self.experts - 1))
        padding = self.groups * _padding(n * self.tokens, self.top_k, self.experts, block)[1]
        return _largest_normal(n) * math.sqrt(rows * n / (n - 1) + padding)

    def launched(self, block: int) -> float:
        """Rows the busiest device's kernels run, each group padded to a multiple of `block`, expected."""
        return self.groups * (self.per_group + self.padding(block)) + self.busiest(block)


@functools.cache
def _padding(trials: int, top_k: int, experts: int, block: int) -> tuple[float, float]:
    """The mean and variance of (-X) mod block for X ~ Binomial(trials, top_k / experts), over X within 12 sd of
    its mean."""
    p = top_k / experts
    if p >= 1:
        return -trials % block, 0.0
    mean, sd = trials * p, math.sqrt(trials * p * (1 - p))
    low, high = max(0, math.floor(mean - 12 * sd - 1)), min(trials, math.ceil(mean + 12 * sd + 1))
    log_p, log_q, log_all = math.log(p), math.log1p(-p), math.lgamma(trials + 1)
    moments = [0.0, 0.0]
    for x in range(low, high + 1):
        weight = math.exp(log_all - math.lgamma(x + 1) - math.lgamma(trials - x + 1) + x * log_p + (trials - x) * log_q)
        moments[0] += weight * (-x % block)
        moments[1] += weight * (-x % block) ** 2
    return moments[0], moments[1] - moments[0] ** 2


@functools.cache
def _largest_normal(n: int, steps: int = 4000) -> float:
    """E[max of n independent standard normals]: x n phi(x) Phi(x)^(n - 1) integrated over [-10, 10]."""
    h = 20 / steps
    total = 0.0
    for i in range(steps + 1):
        x = -10 + i * h
        density = n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 + 0.5 * math.erf(x / math.sqrt(2))) ** (n - 1)
        total += (0.5 if i in (0, steps) else 1.0) * x * density
    return total * h


@dataclass(frozen=True)
class KernelCall:
    name: str
    operands: list  # Shape each
    outputs: list  # Shape each
    grid: tuple[int, ...] | None = None  # where the compiled program states it
    attributes: dict = field(default_factory=dict)  # the custom call's frontend attributes
    # for a kernel over an MoE's routed rows: how the routing spreads them over its groups (experts); the program
    # states only the static buffer. A kernel that skips the rows no group fills counts these, one that runs its
    # whole grid ignores them.
    routed: RoutedRows | None = None


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float  # each operand read and each output written once
    tile: tuple[int, int, int]  # (m, n, k) of the matmul each grid step runs
    dtype: str  # the matmul operands' dtype (picks the peak rate)
    loaded: float | None = None  # bytes its tiles load and store, each re-read counted (None: `bytes`)
    of_cublas: float = 1.0  # its design's rate as a fraction of cuBLAS's (OF_CUBLAS)


def moved(call: KernelCall) -> float:
    """Bytes a kernel that reads each operand and writes each output once moves."""
    return sum(a.bytes for a in call.operands) + sum(a.bytes for a in call.outputs)
