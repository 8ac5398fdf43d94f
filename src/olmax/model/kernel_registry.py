"""Every kernel the model calls, by the name the compiled program shows, with the work it does (olmax.model.
kernel_work): what the step-time model costs a custom call from.

olmax's kernels keep their work beside them, each module in its WORK; this registry names every such module, so
that what it holds is the same in every process, whatever was imported before (filled as a side effect of
importing the kernels' module, it costed the grouped kernels only in a process that had imported that module).
libtpu's own kernels, which no module of olmax defines, have their work here.

The name is the kernel's as the compiled program shows it:

- a Pallas call (Mosaic TPU `tpu_custom_call`, Mosaic GPU `mosaic_gpu_v2`, Pallas Triton
  `__gpu$xla.gpu.triton`): the `name=` given to `pl.pallas_call` (Mosaic GPU's `plgpu.kernel`: its
  `kernel_name`), which its op name carries as `.../NAME/pallas_call` (`.../NAME/mpmd_map`) on every backend (on
  TPU the instruction is named after it too);
- one of libtpu's own kernels (`tpu_custom_call` without a Pallas op name): its instruction's name less the
  numeric suffix, e.g. `ragged-dot-none` for the grouped matmul `jax.lax.ragged_dot` compiles to.

A name is looked up whole, then by its longest registered prefix followed by `-` (`ragged-dot` covers
`ragged-dot-none`). A custom call that is neither in WORK nor one the step-time model knows (cuBLAS/cuDNN GEMMs,
attention) is costed by its bytes and listed by name on the plan and the layout page.
"""

from __future__ import annotations

import math
from typing import Callable

from olmax.model.kernel_work import KernelCall, Work, moved
from olmax.model.moe.kernels import blackwell, hopper, mxfp8


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
    **hopper.WORK,
    **blackwell.WORK,
    **mxfp8.WORK,
}


def lookup(name: str) -> Callable[[KernelCall], Work] | None:
    """WORK's entry for kernel `name`: its own, else its longest registered prefix followed by `-`."""
    if name in WORK:
        return WORK[name]
    prefixes = [key for key in WORK if name.startswith(f"{key}-")]
    return WORK[max(prefixes, key=len)] if prefixes else None
