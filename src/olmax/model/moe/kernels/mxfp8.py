"""The experts' grouped matmul in MXFP8 on Blackwell (impl.fp8=mxfp8), olmax's kernels on tcgen05's block-scaled
MMA: the product of rows x [M, K] in the block loop's layout (each group's rows padded to a multiple of 256 rows)
with w[g] and the input gradient (`matmul_kernel`), and the weight gradient per group (`weight_grad_kernel`),
under one custom VJP (`matmul`). Each product's operands are quantized once a call along its contraction
(fp8.mx_quantize: e4m3 values, an e8m0 scale per 32), both laid out along it as JAX's scaled tcgen05 MMAs take
them (hence the transposes, by XLA before quantizing: `OPERANDS`), the scales in tensor memory for the
block-scaled MMA; the weight gradient's contraction is the rows, in 32-row blocks within one group (groups are
256-row aligned). Compiled for a B300 to check them (tensor memory does not run under the interpreter); their work
for the step-time model is beside them (`WORK`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from olmax.model import fp8, kernel_work
from olmax.model.fp8 import MX_BLOCK, MX_SCALES, MX_VALUES
from olmax.model.moe.kernels.blackwell import DESIGN, ROW_TILE, tcgen05_tiles
from olmax.model.moe.kernels.chip import (BLACKWELL_BLOCK, in_groups, item, matmul_loads, moved_routed,
                                          one_launch_a_device, padded, routed_rows, tile_groups, weight_grad_loads)


@dataclass(frozen=True)
class TuningConfig:
    """Output tiles of block_m x block_n on one SM, steps of block_k along the contraction (block_k bytes of e4m3:
    128, the widest swizzle), max_concurrent_steps in flight."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int


# 3 x (128 x 128 + 256 x 128 + 3 x 512 of scales) B = 148.5 KiB of shared memory, and 2 x 16 KiB for the stores,
# of 227 (4 in flight would need 230).
TUNING = TuningConfig(block_m=128, block_n=256, block_k=128, max_concurrent_steps=3)
SCALE_ROWS = 128  # tcgen05's scale layout: scales of 128 rows by 4 blocks, 512 bytes


def mx_operand(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """a [..., R, C] in MXFP8 along its last axis as the scaled kernels take it: the e4m3 values [..., R, C]
    (fp8.mx_quantize's) and their e8m0 scales [..., R / 128, C / 128, 32, 16] in tcgen05's layout for 128 rows
    by 4 scales (https://docs.nvidia.com/cuda/parallel-thread-execution/#tcgen05-mma-scale-factor-a-layout-1x):
    the scale of row r, column block j at [r // 128, j // 4, r % 32, (r % 128) // 32 * 4 + j % 4]."""
    values, scales = fp8.mx_quantize(a, a.ndim - 1)
    *lead, rows, blocks = scales.shape
    tiled = scales.reshape(*lead, rows // SCALE_ROWS, 4, 32, blocks // 4, 4)
    tiled = jnp.moveaxis(tiled, -2, -4)  # [..., R / 128, C / 128, 4, 32, 4]
    tiled = jnp.swapaxes(tiled, -3, -2)  # [..., R / 128, C / 128, 32, 4 (row quarter), 4 (block)]
    return values, tiled.reshape(*lead, rows // SCALE_ROWS, blocks // 4, 32, 16)


def _ring(block_m: int, block_n: int, bk: int) -> list:
    return [((block_m, bk), MX_VALUES, True), ((block_n, bk), MX_VALUES, True),
            ((block_m // SCALE_ROWS, 1, 32, 16), MX_SCALES, False),
            ((block_n // SCALE_ROWS, 1, 32, 16), MX_SCALES, False)]


@one_launch_a_device
def matmul_kernel(x, wt, tile_starts, out_dtype):
    """Blackwell, MXFP8: x [M, K] times w[g] for groups that start on multiples of 128 rows (tile_starts in
    128-row tiles), x = mx_operand(x) and wt = mx_operand(w^T) ([G, N, K]): one program per (column tile,
    row tile), each tile in one group, so it multiplies by one w[g] and stores whole; tiles after the last group
    are skipped (their rows left unwritten). Column tiles vary fastest, as in Hopper's."""
    (xv, xs), (wv, ws) = x, wt
    (m, k), (groups, n, _) = xv.shape, wv.shape
    bm, bn, bk = TUNING.block_m, TUNING.block_n, TUNING.block_k
    tiles = m // bm

    def program(ids, tile_groups_gmem, xv_gmem, wv_gmem, xs_gmem, ws_gmem, out_gmem):
        ni, mi = ids
        g = tile_groups_gmem[mi]

        def views(i):
            return (xv_gmem.at[pl.ds(mi * bm, bm), pl.ds(i * bk, bk)],
                    wv_gmem.at[g, pl.ds(ni * bn, bn), pl.ds(i * bk, bk)],
                    xs_gmem.at[pl.ds(mi * (bm // SCALE_ROWS), bm // SCALE_ROWS), pl.ds(i, 1)],
                    ws_gmem.at[g, pl.ds(ni * (bn // SCALE_ROWS), bn // SCALE_ROWS), pl.ds(i, 1)])

        return g < groups, k // bk, views, out_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)]

    return tcgen05_tiles(
        "blackwell_mx_grouped_matmul", dict(n=n // bn, m=tiles), tile_groups(tile_starts, tiles), (xv, wv, xs, ws),
        jax.ShapeDtypeStruct((m, n), out_dtype), program, _ring(bm, bn, bk), bn,
        TUNING.max_concurrent_steps, scaled=True)


@one_launch_a_device
def weight_grad_kernel(xt, dyt, step_starts, out_dtype):
    """Blackwell, MXFP8: per group, x[its rows]^T dy[its rows] ([G, K, N]) from xt = mx_operand(x^T) ([K, M])
    and dyt = mx_operand(dy^T) ([N, M]), both quantized along the rows in blocks of 32 (a group's rows start and
    end on multiples of 128: step_starts in 128-row steps, so no block holds two groups' rows), padding rows
    zero: one program per (column tile, row tile of K, group) sums the group's steps; an empty group stores
    zeros."""
    (xv, xs), (dv, dys) = xt, dyt
    k, n, groups = xv.shape[0], dv.shape[0], step_starts.shape[0] - 1
    bm, bn, bk = TUNING.block_m, TUNING.block_n, TUNING.block_k

    def program(ids, starts_gmem, xv_gmem, dv_gmem, xs_gmem, dys_gmem, out_gmem):
        ni, mi, g = ids
        first, steps = starts_gmem[g], starts_gmem[g + 1] - starts_gmem[g]

        def views(i):
            rows = pl.ds((first + i) * bk, bk)
            return (xv_gmem.at[pl.ds(mi * bm, bm), rows], dv_gmem.at[pl.ds(ni * bn, bn), rows],
                    xs_gmem.at[pl.ds(mi * (bm // SCALE_ROWS), bm // SCALE_ROWS), pl.ds(first + i, 1)],
                    dys_gmem.at[pl.ds(ni * (bn // SCALE_ROWS), bn // SCALE_ROWS), pl.ds(first + i, 1)])

        return True, steps, views, out_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)]

    return tcgen05_tiles(
        "blackwell_mx_weight_grad", dict(n=n // bn, m=k // bm, g=groups), step_starts, (xv, dv, xs, dys),
        jax.ShapeDtypeStruct((groups, k, n), out_dtype), program, _ring(bm, bn, bk), bn,
        TUNING.max_concurrent_steps, scaled=True)


# MXFP8: each product quantizes its two operands along its contraction, once a call (x in the forward, dy once
# for each gradient, w once for each product), in the layout the kernels read: both operands along the
# contraction, so x^T, dy^T and w^T are XLA transposes (before quantizing: one pass each). What the backward keeps
# is x and w as they came (the block loop keeps the same).
OPERANDS = {  # each product's two operands as its kernel takes them, quantized along the product's contraction
    # x [M, K], w^T [G, N, K]
    "y": lambda x, w: (mx_operand(padded(x, ROW_TILE)), mx_operand(jnp.swapaxes(w, 1, 2))),
    # dy [M, N], w [G, K, N]
    "dx": lambda dy, w: (mx_operand(padded(dy, ROW_TILE)), mx_operand(w)),
    # x^T [K, M], dy^T [N, M]
    "dw": lambda x, dy: (mx_operand(padded(x, ROW_TILE).T), mx_operand(padded(dy, ROW_TILE).T)),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def matmul(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int) -> jax.Array:
    """The block loop's grouped matmul (its arguments: blocks block_starts[g] to block_starts[g + 1] - 1 of x
    times w[g]) in MXFP8, its three products the kernels above, for blocks of a multiple of 128 rows."""
    tiles = block_starts * (block // TUNING.block_m)
    y = matmul_kernel(*OPERANDS["y"](x, w), tiles, out_dtype=x.dtype)
    return in_groups(y[: x.shape[0]], jnp.diff(block_starts) * block)


def _matmul_fwd(x, w, block_starts, block):
    return matmul(x, w, block_starts, block), (x, w, block_starts)


def _matmul_bwd(block, res, dy):
    x, w, block_starts = res
    tiles = block_starts * (block // TUNING.block_m)
    dx = matmul_kernel(*OPERANDS["dx"](dy, w), tiles, out_dtype=dy.dtype)
    dx = in_groups(dx[: x.shape[0]], jnp.diff(block_starts) * block)
    dw = weight_grad_kernel(*OPERANDS["dw"](x, dy), tiles, out_dtype=dy.dtype)
    return dx, dw.astype(w.dtype), None


matmul.defvjp(_matmul_fwd, _matmul_bwd)


# The kernels' work: e4m3 operands (the step-time model's float8 rate), the scales moved with them (a byte per 32
# values), the groups padded to Blackwell's 256-row blocks.
def matmul_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    _, x, w, x_scales, _ = call.operands
    (rows, k), n, out = x.dims, w.dims[1], call.outputs[0]
    used = routed_rows(call, rows, BLACKWELL_BLOCK)
    over_rows = x.bytes + x_scales.bytes + out.bytes
    scaled = 1 + 1 / MX_BLOCK  # an e4m3 value and its share of an e8m0 scale
    loaded = matmul_loads(used, k, n, scaled, scaled, item(out), TUNING.block_m, TUNING.block_n)
    return kernel_work.Work(2.0 * used * k * n, moved_routed(call, over_rows, used / rows),
                            (TUNING.block_m, TUNING.block_n, k), x.dtype, loaded, kernel_work.OF_CUBLAS[DESIGN])


def weight_grad_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    xt, dyt = call.operands[1], call.operands[2]
    (k, rows), n, groups = xt.dims, dyt.dims[0], call.outputs[0].dims[0]
    used = routed_rows(call, rows, BLACKWELL_BLOCK)
    tile = (TUNING.block_m, TUNING.block_n, max(int(used // groups), BLACKWELL_BLOCK))
    over_rows = sum(a.bytes for a in call.operands[1:])  # the values and scales of x^T and dy^T
    scaled = 1 + 1 / MX_BLOCK
    loaded = weight_grad_loads(used, k, n, scaled, scaled, call.outputs[0].bytes, TUNING.block_m, TUNING.block_n)
    return kernel_work.Work(2.0 * k * used * n, moved_routed(call, over_rows, used / rows), tile, xt.dtype, loaded,
                            kernel_work.OF_CUBLAS[DESIGN])


# by the kernels' names
WORK = {"blackwell_mx_grouped_matmul": matmul_work, "blackwell_mx_weight_grad": weight_grad_work}
