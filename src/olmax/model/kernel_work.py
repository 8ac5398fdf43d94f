"""The work each kernel the model calls does, for the step-time model (olmax.scale.step_time), which costs a
kernel from this and never from a cost estimate its author set in the kernel.

A kernel reaches the compiled program as a custom call whose FLOPs the compiler does not count. The step-time
model looks each custom call up in `WORK` by the kernel's name and costs it from what the entry returns:

    WORK: dict[str, Callable[[KernelCall], Work]]

The name is the kernel's as the compiled program shows it:

- a Pallas call (Mosaic TPU `tpu_custom_call`, Mosaic GPU `mosaic_gpu_v2`, Pallas Triton
  `__gpu$xla.gpu.triton`): the `name=` given to `pl.pallas_call`, which its op name carries as
  `.../NAME/pallas_call` on every backend (on TPU the instruction is named after it too);
- one of libtpu's own kernels (`tpu_custom_call` without a Pallas op name): its instruction's name less the
  numeric suffix, e.g. `ragged-dot-none` for the grouped matmul `jax.lax.ragged_dot` compiles to.

A name is looked up whole, then by its longest registered prefix followed by `-` (`ragged-dot` covers
`ragged-dot-none`). The entry gets a `KernelCall`: the operands' and outputs' shapes, the grid where the
program states it (Pallas Triton's `grid_x/y/z`; Mosaic kernels serialize theirs, so an entry computes its grid
from the shapes as its kernel does), the call's frontend attributes and, for MoE kernels, the rows each group is
expected to get. It returns the kernel's `Work` in all
(every grid step together): FLOPs, bytes moved to and from HBM, the matmul tile each grid step multiplies
(m, n, k: how well it fills the matrix unit) and the operands' dtype. A kernel's entry lives beside the
kernel: register it with `WORK["my_kernel"] = my_kernel_work` in the kernel's module, or add it here.

A custom call that is neither in `WORK` nor one the step-time model knows (cuBLAS/cuDNN GEMMs, attention) is
costed by its bytes and listed by name on the plan and the layout page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

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


def ragged_dot(call: KernelCall) -> Work:
    """jax.lax.ragged_dot on TPU (libtpu's `ragged-dot-*` kernels): rows [M, K] of a ragged operand each times
    one group's [K, N] of a [G, K, N] operand, forward and for the rows' gradient alike: 2 M K N FLOPs in all,
    whatever the groups' sizes. The tiles are the call's `ragged_dot_tiling` (tm, tk, tn) where given."""
    matrices = [a for a in call.operands if len(a.dims) == 2 and not a.dtype.startswith(("s", "u"))]
    grouped = next(a for a in call.operands if len(a.dims) == 3)
    rows = matrices[0].dims[0]
    k_by_n = math.prod(grouped.dims[1:])
    n = call.outputs[0].dims[-1]
    tiling = call.attributes.get("ragged_dot_tiling")
    tm, tk, tn = (int(v) for v in tiling.split(",")) if tiling else (rows, k_by_n // n, n)
    return Work(2.0 * rows * k_by_n, moved(call), (tm, tn, tk), matrices[0].dtype)


def ragged_dot_metadata(call: KernelCall) -> Work:
    """The group offsets and tile ids libtpu computes from the group sizes before a ragged dot: no matmul."""
    return Work(0.0, moved(call), (1, 1, 1), "s32")


WORK: dict[str, Callable[[KernelCall], Work]] = {
    "ragged-dot-metadata": ragged_dot_metadata,
    "ragged-dot": ragged_dot,
}


def lookup(name: str) -> Callable[[KernelCall], Work] | None:
    """WORK's entry for kernel `name`: its own, else its longest registered prefix followed by `-`."""
    if name in WORK:
        return WORK[name]
    prefixes = [key for key in WORK if name.startswith(f"{key}-")]
    return WORK[max(prefixes, key=len)] if prefixes else None
