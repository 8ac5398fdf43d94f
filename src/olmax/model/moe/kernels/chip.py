"""The GPU the grouped kernels are built for (`Chip`), whether they run the experts on a device (`unsupported`), and
what the kernels of each generation share: the rows' layout (each group's rows padded with zero rows to a multiple
of the chip's block), the tiles of rows a program takes, and how their work is counted for the step-time model."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from olmax.model import kernel_work

ALIGN = 64  # rows: each group padded to a multiple (the block loop's `block`), the weight gradient's contraction step
# Blackwell's layout: 256-row blocks, taken when its weight gradient was XLA's block loop over them (a quarter
# of 64-row blocks' steps); its kernel steps through 64 rows at a time, so ALIGN would do, with under 64 zero
# rows a group instead of 256.
BLACKWELL_BLOCK = 256
# The kernels' widths (d_model and expert_hidden), by compute capability's major version: Hopper's tiles are 128
# and 64 wide, Blackwell's 256 (JAX's kernel's cluster tiles, and the weight gradient's columns). Other widths
# are padded with zeros to a multiple (grouped.matmul): the 1.2T MoE's 4,480-wide experts run 4,608 columns on a
# B300 (2.9% more work), as they are on an H100.
WIDTH_MULTIPLE = {9: 128, 10: 256}
WARPGROUP = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


@dataclass(frozen=True)
class Chip:
    """The GPU the kernels are built for: its compute capability's major version (9 Hopper, 10 Blackwell) and
    SM count, as the target's devices report them (a compile-only device has both)."""

    major: int
    sms: int

    @classmethod
    def of(cls, device) -> Chip:
        return cls(int(float(device.compute_capability)), device.core_count)

    @property
    def block(self) -> int:
        """The layout's block: rows each group is padded to a multiple of."""
        return ALIGN if self.major == 9 else BLACKWELL_BLOCK


def unsupported(device) -> str | None:
    """Why the grouped kernels cannot run the experts on `device`, or None when they can (any width:
    grouped.matmul)."""
    if device is None:
        return "its kernels are chosen for a GPU's compute capability, and no device was given"
    cc = getattr(device, "compute_capability", None)
    major = None if cc is None else int(float(cc))
    if device.platform not in ("gpu", "cuda") or major not in WIDTH_MULTIPLE:
        return f"its kernels are for NVIDIA Hopper (sm_90) and Blackwell (sm_100) GPUs, not {device.device_kind}"
    return None


def one_launch_a_device(kernel):
    """`kernel(*arrays, **static)` as one launch over one GPU's arrays wherever it is called: under a vmap (the
    pipeline's over its stages, which puts each stage on devices of its own) it runs once per mapped element, in a
    loop of one trip a device, instead of being batched: a kernel's grid covers one GPU's rows and takes no batch
    dimension. Unmapped, it is the plain call."""
    @functools.wraps(kernel)
    def launch(*arrays, **static):
        return jax.custom_batching.sequential_vmap(functools.partial(kernel, **static))(*arrays)

    return launch


def padded(a, rows: int):
    # Whole tiles of rows: no tile reads past the array, and Blackwell's kernel takes no partial tile. The rows
    # added are zeros and belong to no group.
    return jnp.pad(a, ((0, -a.shape[0] % rows), (0, 0)))


def tile_groups(block_starts, tiles: int):
    """The group of each tile of rows ([tiles]; G after the last group), for groups starting at `block_starts` in
    tiles."""
    return jnp.searchsorted(block_starts, jnp.arange(tiles, dtype=block_starts.dtype), side="right") - 1


def in_groups(y, counts):
    """y with its rows after the last group's zeroed (the kernels leave them unwritten)."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(counts))[:, None], y, 0)


# The kernels' work for the step-time model (olmax.model.kernel_work), from their grids and tiles as they launch
# them: each operand read from HBM once (the grid orders keep the programs that run together on the same rows and
# weights, so L2 serves their re-reads), and at the range's other end every tile load from HBM. olmax's kernels skip
# the tiles after the last group: they run the rows the routing fills, each group's padded to whole tiles or blocks
# (the busiest device's under the routing's distribution where the step-time model gives it; the whole buffer
# otherwise, an upper bound). JAX's Blackwell kernel runs every row tile of its grid, filled or not.
def routed_rows(call: kernel_work.KernelCall, rows: int, block: int = ALIGN) -> float:
    if call.routed is None:
        return rows
    return min(rows, call.routed.launched(block))


def moved_routed(call: kernel_work.KernelCall, over_rows: float, share: float) -> float:
    """Bytes a kernel moves that reads or writes the arrays over the rows (`over_rows` bytes of them) only where a
    tile runs, `share` of them, and the weights whole."""
    return kernel_work.moved(call) - over_rows * (1 - share)


def item(a) -> float:
    """Bytes an element of `a` takes in HBM."""
    return a.bytes / math.prod(a.dims)


def matmul_loads(rows: float, k: int, n: int, x_item: float, w_item: float, out_item: float, tile_m: int,
                 tile_n: int) -> float:
    """Bytes a grouped matmul's tiles load and store over `rows` rows: a program of a tile_m x tile_n output tile
    reads its rows of x whole along k and its group's w[:, its columns], so x is read once a column tile and each
    w[g] once a row tile of its group; the output is stored once."""
    return rows * k * x_item * -(-n // tile_n) + rows / tile_m * k * n * w_item + rows * n * out_item


def weight_grad_loads(rows: float, k: int, n: int, xt_item: float, dy_item: float, out_bytes: float, tile_m: int,
                      tile_n: int) -> float:
    """Bytes a weight gradient's tiles load and store: a program of a tile_m x tile_n tile of a group's [k, n]
    reads its tile_m rows of x^T and tile_n columns of dy over the group's rows, so x^T is read once a column
    tile and dy once a row tile of k; the output is stored once."""
    return rows * k * xt_item * -(-n // tile_n) + rows * n * dy_item * -(-k // tile_m) + out_bytes


def tiled_weight_grad_work(call: kernel_work.KernelCall, block: int, tile_m: int, tile_n: int, design: str
                           ) -> kernel_work.Work:
    """A weight gradient's work (olmax's kernels, Hopper's and Blackwell's): its programs, one per tile_m x tile_n
    output tile and group, step over their group's rows, each group padded to whole blocks."""
    xt, dy = call.operands[1], call.operands[2]
    (k, rows), n, groups = xt.dims, dy.dims[1], call.outputs[0].dims[0]
    used = routed_rows(call, rows, block)
    tile = (tile_m, tile_n, max(int(used // groups), block))  # a group's rows, on average
    loaded = weight_grad_loads(used, k, n, item(xt), item(dy), call.outputs[0].bytes, tile_m, tile_n)
    return kernel_work.Work(2.0 * k * used * n, moved_routed(call, xt.bytes + dy.bytes, used / rows), tile, xt.dtype,
                            loaded, kernel_work.OF_CUBLAS[design])
