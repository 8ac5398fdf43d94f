"""The experts' grouped matmul on Hopper (sm_90), olmax's kernels on wgmma: the product of rows x [M, K] in the
block loop's layout (each group's rows padded to a multiple of ALIGN = 64 rows) with w[g] ([G, K, N]) for each
group g (`matmul_kernel`; the input gradient is the same kernel on w^T), and the weight gradient x^T dy per group
(`weight_grad_kernel`). With groups aligned to 64-row tiles each tile belongs to one group, so a program
multiplies by one w[g] and stores its tile whole, a weight gradient sums whole tiles without masking rows, tiles
after the last group (the unused part of the layout's static bound: a quarter of the rows at
impl.moe.ep_capacity=1.25) are skipped, and the grids are one program per output tile (no SM count). bf16 or
float32 in (float32 as TF32), accumulated in float32, out in the input's dtype. They run on a CPU under Pallas's
GPU interpreter, where the tests check them; their work for the step-time model is beside them (`WORK`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from olmax.model import kernel_work
from olmax.model.moe.kernels.chip import (ALIGN, WARPGROUP, item, matmul_loads, moved_routed, one_launch_a_device,
                                          padded, routed_rows, tile_groups, tiled_weight_grad_work)


@dataclass(frozen=True)
class TuningConfig:
    """Output tiles of block_n columns and ALIGN rows (a wgmma's, and a group's alignment: the forward) or block_m
    rows (the weight gradient), block_k-deep steps, max_concurrent_steps in flight."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int


# At most 4 x (128 x 64 + 64 x 128) x 2 B = 128 KiB of shared memory of 228.
TUNING = TuningConfig(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)


@one_launch_a_device
def matmul_kernel(x, w, block_starts):
    """Hopper: x [M, K] times w[g] ([G, K, N]) for groups that start on multiples of ALIGN rows (block_starts in
    ALIGN-row tiles): one program per (column tile, ALIGN-row tile), each tile in one group, so it multiplies by
    one w[g] and stores whole; tiles after the last group are skipped (their rows left unwritten). Column tiles
    vary fastest: the programs running at once share their rows of x, and consecutive row tiles their w[g]."""
    (m, k), (groups, _, n) = x.shape, w.shape
    bm, bn, bk = ALIGN, TUNING.block_n, TUNING.block_k
    tiles = -(-m // bm)

    def body(tile_groups_gmem, x_gmem, w_gmem, out_gmem):
        mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        g = tile_groups_gmem[mi]

        @pl.when(g < groups)
        def _():
            def accumulate(acc):
                plgpu.emit_pipeline(
                    lambda _, x_smem, w_smem: plgpu.wgmma(acc, x_smem, w_smem),
                    grid=(k // bk,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda i: (mi, i), delay_release=1),
                              plgpu.BlockSpec((bk, bn), lambda i: (i, ni), delay_release=1)],
                    max_concurrent_steps=TUNING.max_concurrent_steps,
                )(x_gmem, w_gmem.at[g])
                return acc[...]

            _store(pl.run_scoped(accumulate, plgpu.ACC((bm, bn))), out_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])

    y = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((tiles * bm, n), x.dtype), grid=(n // bn, tiles), grid_names=("n", "m"),
        kernel_name="grouped_matmul", compiler_params=WARPGROUP,
    )(tile_groups(block_starts, tiles), padded(x, bm), w)
    return y[:m]


def _store(acc, out_gmem):
    """A program's float32 accumulator to its output tile, in the output's dtype, through shared memory."""
    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM(acc.shape, out_gmem.dtype))
    def store(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@one_launch_a_device
def weight_grad_kernel(xt, dy, block_starts):
    """Per group, xt[:, its rows] @ dy[its rows] ([G, K, N] from xt [K, M] and dy [M, N]) on Hopper, for groups
    that start and end on multiples of ALIGN rows, their padding rows zero in xt and dy: each (group, tile)
    program sums the group's ALIGN-row steps with wgmma, no row masked. Non-persistent: one program per output
    tile, so no SM count; a group's tiles run together (the group varies slowest), sharing its rows."""
    k, n, groups = xt.shape[0], dy.shape[1], block_starts.shape[0] - 1
    bm, bn, bk = TUNING.block_m, TUNING.block_n, ALIGN

    def body(starts_gmem, xt_gmem, dy_gmem, out_gmem):
        g, mi, ni = (jax.lax.axis_index(axis) for axis in ("g", "m", "n"))
        first, last = starts_gmem[g], starts_gmem[g + 1]

        def accumulate(acc):
            plgpu.emit_pipeline(
                lambda _, xt_smem, dy_smem: plgpu.wgmma(acc, xt_smem, dy_smem),
                grid=(last - first,),
                in_specs=[plgpu.BlockSpec((bm, bk), lambda i: (mi, first + i), delay_release=1),
                          plgpu.BlockSpec((bk, bn), lambda i: (first + i, ni), delay_release=1)],
                max_concurrent_steps=TUNING.max_concurrent_steps,
            )(xt_gmem, dy_gmem)
            return acc[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))
        _store(acc, out_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((groups, k, n), xt.dtype), grid=(n // bn, k // bm, groups),
        grid_names=("n", "m", "g"), kernel_name="grouped_weight_grad", compiler_params=WARPGROUP,
    )(block_starts, xt, dy)


# One warpgroup a program, its loads pipelined (no warp of its own for them), a program per output tile.
DESIGN = "pipelined"


def matmul_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    _, x, w = call.operands
    (rows, k), n, out = x.dims, w.dims[2], call.outputs[0]
    used = routed_rows(call, rows)
    over_rows = x.bytes + out.bytes
    loaded = matmul_loads(used, k, n, item(x), item(w), item(out), ALIGN, TUNING.block_n)
    return kernel_work.Work(2.0 * used * k * n, moved_routed(call, over_rows, used / rows), (ALIGN, TUNING.block_n, k),
                            x.dtype, loaded, kernel_work.OF_CUBLAS[DESIGN])


def weight_grad_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    return tiled_weight_grad_work(call, ALIGN, TUNING.block_m, TUNING.block_n, DESIGN)


WORK = {"grouped_matmul": matmul_work, "grouped_weight_grad": weight_grad_work}  # by the kernels' names
