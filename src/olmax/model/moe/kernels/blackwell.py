"""The experts' grouped matmul on Blackwell (sm_100, tcgen05), bf16: JAX's `blackwell_ragged_dot_mgpu` for the
product of rows x [M, K] in the block loop's layout (each group's rows padded to a multiple of BLACKWELL_BLOCK =
256 rows) with w[g] ([G, K, N]) and for the input gradient on w^T (`matmul_kernel`), and olmax's weight gradient
x^T dy per group (`weight_grad_kernel`), which JAX has no tcgen05 kernel for (a ragged contraction).

JAX's kernel reads the SM count from jax.local_devices()[0], which `_on_device` makes the target's; its
`collective=False` form does not trace (an unbound cluster axis), so it runs in pairs of SMs on 256 x 256 tiles.
olmax's weight gradient runs a program per (column tile, row tile of K, group) on one SM each, 128 x 256 tiles
accumulated in tensor memory (`tcgen05_tiles`, which the MXFP8 kernels share), no cluster: a collective pair
would share a 256 x 256 tile (half the shared-memory reads a FLOP) but tie two SMs' programs together. Tensor
memory does not run under Pallas's GPU interpreter ("Unsupported memory space: tmem"), so both are checked by
compiling for a B300. In float32 neither compiles (JAX's tiles exceed shared memory; tcgen05 in warpgroup
semantics takes no TF32): the check before a run (olmax.model.moe.selfcheck) falls back to the block loop. Their
work for the step-time model is beside them (`WORK`)."""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import blackwell_ragged_dot_mgpu

from olmax.model import kernel_work
from olmax.model.fp8 import MX_BLOCK, MX_SCALES
from olmax.model.moe.kernels.chip import (BLACKWELL_BLOCK, WARPGROUP, Chip, item, matmul_loads, one_launch_a_device,
                                          padded, tiled_weight_grad_work)

# JAX's kernel: 128 x 128 per SM, two SMs of a cluster sharing one 256 x 256 tile (the kernel's `collective`
# form, the one its benchmark tunes).
RAGGED_DOT = blackwell_ragged_dot_mgpu.TuningConfig(
    tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, collective=True, grid_tile_width=1,
    grid_minor_dim=blackwell_ragged_dot_mgpu.blackwell_matmul_mgpu.MatmulDimension.M)
ROW_TILE = 2 * RAGGED_DOT.tile_m  # rows a cluster's tile takes: the rows are padded to a multiple
SWIZZLE = 128  # bytes


# olmax's Blackwell kernels (tcgen05_tiles): a warp for the TMA loads, a warp for the MMAs, the epilogue stored in
# column slices; one SM a program, a program per output tile.
DESIGN = "warp-specialized"


@dataclass(frozen=True)
class WeightGradTuning:
    """olmax's weight gradient: block_m x block_n output tiles on one SM, accumulated in block_n columns of tensor
    memory, max_concurrent_steps steps of rows in flight (a step is SWIZZLE bytes of a row: 64 rows of bf16)."""

    block_m: int
    block_n: int
    max_concurrent_steps: int


# 4 x (128 x 64 + 64 x 256) x 2 B = 192 KiB of shared memory, and 2 x 16 KiB for the stores, of 227.
WEIGHT_GRAD = WeightGradTuning(block_m=128, block_n=256, max_concurrent_steps=4)


class _JaxOn(types.SimpleNamespace):
    """The jax module as JAX's kernel modules use it, with `device` as the process's only device."""

    def __init__(self, device):
        super().__init__(devices=lambda *_: [device], local_devices=lambda *_: [device])

    def __getattr__(self, name):
        return getattr(jax, name)


@contextlib.contextmanager
def _on_device(chip: Chip):
    # JAX's Blackwell kernel sizes its persistent grid from jax.local_devices()[0], a CPU when compiling from a CPU
    # host: while it is traced, its module sees a device with the target's SM count.
    saved = blackwell_ragged_dot_mgpu.jax
    blackwell_ragged_dot_mgpu.jax = _JaxOn(types.SimpleNamespace(core_count=chip.sms))
    try:
        yield
    finally:
        blackwell_ragged_dot_mgpu.jax = saved


@one_launch_a_device
def matmul_kernel(x, w, counts, chip: Chip):
    """JAX's kernel: x [M, K] times w[g] ([G, K, N]) for groups of `counts` rows in order: [M, N], garbage after
    the last group's rows."""
    with _on_device(chip):
        y = blackwell_ragged_dot_mgpu.ragged_dot_kernel(padded(x, ROW_TILE), w, counts, RAGGED_DOT)
    return y[: x.shape[0]]


def tcgen05_tiles(name: str, grid: dict, table, operands, out_type, program, ring_tiles, block_n: int, ring: int,
                   scaled: bool):
    """The Blackwell kernels olmax writes: one program per output tile [block_m, block_n] of `out_type` (a
    program per point of `grid`, {axis name: size}) on one SM, summing steps of its contraction in tensor memory.
    `program(ids, table, *operands, out)` says what a program does: (runs, steps, views, out_tile), `runs` whether
    it runs at all, `steps` how many steps it sums, `views(i)` the HBM tiles of its step i that TMA copies into
    the ring of shared memory `ring_tiles` describes ((shape, dtype, swizzled) each, `ring` slots): A [block_m,
    bk] and B, bf16 as [bk, block_n] or (`scaled`: MXFP8, e4m3 taken along the contraction) as [block_n, bk]
    followed by A's and B's e8m0 scales in tcgen05's layout (mxfp8.mx_operand), which the MMA warp copies into
    tensor memory before each step's scaled MMA. In one warpgroup, a warp issues the TMA copies of each step into
    a slot, another the tcgen05 MMAs, each MMA freeing its slot when it has read it; then the warpgroup stores
    the accumulator in column slices. A program of no steps runs no MMA and stores zeros (its tensor memory is
    never written)."""
    (block_m, bk), out_dtype = ring_tiles[0][0], out_type.dtype
    columns_stored = SWIZZLE // jnp.dtype(out_dtype).itemsize  # columns a store

    def swizzled(dtype):  # 8-row tiles of 128-byte rows, swizzled, as tcgen05 and TMA take them
        return plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE)

    TMA_WARP, MMA_WARP = 0, 1

    def body(table_gmem, *refs, rings, acc_tmem, scales_tmem, out_smem, loaded, consumed, mma_done):
        *operands_gmem, out_gmem = refs
        ids = tuple(jax.lax.axis_index(axis) for axis in grid)
        runs, steps, views, out_tile = program(ids, table_gmem, *operands_gmem, out_gmem)

        @pl.when(runs)
        def _():
            @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
            def _():
                warp = jax.lax.axis_index("warp")

                @pl.when(warp == TMA_WARP)
                def _():
                    def load(i, _):
                        slot = jax.lax.rem(i, ring)

                        @pl.when(i >= ring)  # the slot's previous step read by its MMA
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        for view, smem in zip(views(i), rings):
                            plgpu.copy_gmem_to_smem(view, smem.at[slot], loaded.at[slot])

                    jax.lax.fori_loop(0, steps, load, None)

                @pl.when(jnp.logical_and(warp == MMA_WARP, steps > 0))
                def _():
                    def multiply(i, _):
                        slot = jax.lax.rem(i, ring)
                        plgpu.barrier_wait(loaded.at[slot])
                        a, b = rings[0].at[slot], rings[1].at[slot]
                        scales = {}
                        if scaled:
                            # One copy of the scales in tensor memory, rewritten each step: tcgen05's copies and
                            # MMAs issued by one thread run in order, so a step's copy waits for the MMA before it.
                            for smem, tmem in zip(rings[2:], scales_tmem):
                                plgpu.async_copy_scales_to_tmem(smem.at[slot], tmem)
                            b, scales = plgpu.transpose_ref(b, (1, 0)), dict(zip(("a_scale", "b_scale"), scales_tmem))
                        plgpu.tcgen05_mma(acc_tmem, a, b, consumed.at[slot], accumulate=i > 0, **scales)

                    jax.lax.fori_loop(0, steps, multiply, None)
                    plgpu.tcgen05_commit_arrive(mma_done)

            @pl.when(steps > 0)
            def _():
                plgpu.barrier_wait(mma_done)

            for c in range(block_n // columns_stored):
                columns, buffer = pl.ds(c * columns_stored, columns_stored), out_smem.at[c % 2]

                @pl.when(steps > 0)
                def _():
                    buffer[...] = plgpu.async_load_tmem(acc_tmem.at[:, columns]).astype(buffer.dtype)

                @pl.when(steps == 0)
                def _():
                    zeros = jnp.zeros(buffer.shape, buffer.dtype)
                    # per lane (the MXFP8 kernels' semantics) a constant has no layout of its own to store from
                    buffer[...] = plgpu.layout_cast(zeros, plgpu.Layout.TCGEN05) if scaled else zeros

                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buffer, out_tile.at[:, columns])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the other buffer free for the next slice
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    tmem_scales = [plgpu.TMEM((rows, bk // MX_BLOCK), MX_SCALES, layout=plgpu.TMEMLayout.SCALES_LAYOUT)
                   for rows in (block_m, block_n)] if scaled else []
    return plgpu.kernel(
        body, out_type=out_type, grid=tuple(grid.values()), grid_names=tuple(grid), kernel_name=name,
        # async_copy_scales_to_tmem lowers per lane only
        compiler_params=None if scaled else WARPGROUP,
        scratch_types=dict(
            rings=[plgpu.SMEM((ring, *shape), dtype, transforms=swizzled(dtype) if swizzle else ())
                   for shape, dtype, swizzle in ring_tiles],
            acc_tmem=plgpu.TMEM((block_m, block_n), jnp.float32),
            scales_tmem=tmem_scales,
            out_smem=plgpu.SMEM((2, block_m, columns_stored), out_dtype, transforms=swizzled(out_dtype)),
            loaded=plgpu.Barrier(num_arrivals=len(ring_tiles), num_barriers=ring),  # every tile's copy
            consumed=plgpu.Barrier(num_arrivals=1, num_barriers=ring, orders_tensor_core=True),
            mma_done=plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        ),
    )(table, *operands)


@one_launch_a_device
def weight_grad_kernel(xt, dy, step_starts):
    """Per group, xt[:, its rows] @ dy[its rows] ([G, K, N] from xt [K, M] and dy [M, N]) on Blackwell, for
    groups that start and end on multiples of 64 rows (step_starts in 64-row steps: a step is 128 bytes of bf16),
    their padding rows zero: one program per (column tile, row tile of K, group) accumulates the group's steps in
    tensor memory (`tcgen05_tiles`). An empty group runs no MMA and stores zeros."""
    k, n, groups, dtype = xt.shape[0], dy.shape[1], step_starts.shape[0] - 1, xt.dtype
    bm, bn = WEIGHT_GRAD.block_m, WEIGHT_GRAD.block_n
    bk = SWIZZLE // jnp.dtype(dtype).itemsize  # rows a step

    def program(ids, starts_gmem, xt_gmem, dy_gmem, out_gmem):
        ni, mi, g = ids
        first, steps = starts_gmem[g], starts_gmem[g + 1] - starts_gmem[g]

        def views(i):
            rows = pl.ds((first + i) * bk, bk)
            return xt_gmem.at[pl.ds(mi * bm, bm), rows], dy_gmem.at[rows, pl.ds(ni * bn, bn)]

        return True, steps, views, out_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)]

    return tcgen05_tiles(
        "blackwell_weight_grad", dict(n=n // bn, m=k // bm, g=groups), step_starts, (xt, dy),
        jax.ShapeDtypeStruct((groups, k, n), dtype), program, [((bm, bk), dtype, True), ((bk, bn), dtype, True)],
        bn, WEIGHT_GRAD.max_concurrent_steps, scaled=False)


def ragged_dot_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    x, w, _ = call.operands
    (rows, k), (groups, _, n), out = x.dims, w.dims, call.outputs[0]
    tile_m, tile_n = ROW_TILE, 2 * RAGGED_DOT.tile_n  # a cluster's pair of SMs
    tiles = rows // tile_m + groups - 1  # the kernel's linear grid of row tiles: every group may start one
    loaded = matmul_loads(tiles * tile_m, k, n, item(x), item(w), 0, tile_m, tile_n) + out.bytes
    return kernel_work.Work(2.0 * tiles * tile_m * k * n, kernel_work.moved(call), (RAGGED_DOT.tile_m, tile_n, k),
                            x.dtype, loaded, kernel_work.OF_CUBLAS["persistent, collective"])


def weight_grad_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    return tiled_weight_grad_work(call, BLACKWELL_BLOCK, WEIGHT_GRAD.block_m, WEIGHT_GRAD.block_n, DESIGN)


WORK = {f"ragged_dot_kernel_{RAGGED_DOT}": ragged_dot_work,  # by the kernels' names
        "blackwell_weight_grad": weight_grad_work}
