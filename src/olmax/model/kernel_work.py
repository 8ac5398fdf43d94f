"""The work a kernel does, as the step-time model (olmax.scale.step_time) costs it: from this, never from a cost
estimate its author set in the kernel.

A kernel reaches the compiled program as a custom call whose FLOPs the compiler does not count. The step-time
model finds the kernel's entry in the registry (olmax.model.kernel_registry) by its name and costs it from what
the entry returns:

    Callable[[KernelCall], Work]

The entry gets a `KernelCall`: the operands' and outputs' shapes, the grid where the program states it (Pallas
Triton's `grid_x/y/z`; Mosaic kernels serialize theirs, so an entry computes its grid from the shapes as its
kernel does), the call's frontend attributes and, for MoE kernels, the rows each group is expected to get. It
returns the kernel's `Work` in all (every grid step together): FLOPs, bytes moved to and from HBM, the matmul
tile each grid step multiplies (m, n, k: how well it fills the matrix unit) and the operands' dtype. A kernel's
entry lives beside the kernel, in its module's WORK, which the registry names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Shape(Protocol):
    dims: tuple[int, ...]
    dtype: str  # as HLO writes it: bf16, f32, f8e4m3fn, s32
    bytes: float  # its size in HBM


@dataclass(frozen=True)
class KernelCall:
    name: str
    operands: list  # Shape each
    outputs: list  # Shape each
    grid: tuple[int, ...] | None = None  # where the compiled program states it
    attributes: dict = field(default_factory=dict)  # the custom call's frontend attributes
    # for a kernel over an MoE's routed rows: the rows each group (expert) is expected to get, from the routing's
    # expectation (the program states only the static buffer); a kernel that skips the rows no group fills counts
    # these, one that runs its whole grid ignores them
    rows_per_group: float | None = None


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float
    tile: tuple[int, int, int]  # (m, n, k) of the matmul each grid step runs
    dtype: str  # the matmul operands' dtype (picks the peak rate)


def moved(call: KernelCall) -> float:
    """Bytes a kernel that reads each operand and writes each output once moves."""
    return sum(a.bytes for a in call.operands) + sum(a.bytes for a in call.outputs)
