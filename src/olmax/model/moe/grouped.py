"""The experts' grouped matmul on NVIDIA GPUs as Pallas Mosaic GPU kernels: `impl.moe.dispatch=grouped`.

Rows x [M, K] in the block loop's layout (gmm._swiglu_blocks: sorted by group, each group padded with zero rows
to a multiple of the chip's block, 64 on Hopper and 256 on Blackwell), group g's rows times w[g] ([G, K, N]),
under one custom VJP whose three products are grouped kernels, each GPU running only its own (resident) experts'
rows:

    product        Hopper (sm_90, wgmma)       Blackwell (sm_100, tcgen05)          Blackwell, MXFP8
    y  = x w       grouped_matmul              JAX's blackwell_ragged_dot_mgpu      blackwell_mx_grouped_matmul on w^T
    dx = dy w^T    grouped_matmul on w^T       JAX's blackwell_ragged_dot_mgpu      blackwell_mx_grouped_matmul on w
                                               on w^T
    dw = x^T dy    grouped_weight_grad on x^T  blackwell_weight_grad on x^T         blackwell_mx_weight_grad on x^T,
                                                                                    dy^T

bf16 in (float32 too on Hopper), accumulated in float32, out in the input's dtype. MXFP8 (impl.fp8=mxfp8,
Blackwell only): each product's operands quantized once a call along its contraction (fp8.mx_quantize: e4m3
values, an e8m0 scale per 32), both laid out along it as JAX's scaled tcgen05 MMAs take them (hence the
transposes, by XLA before quantizing), the scales in tensor memory for tcgen05's block-scaled MMA;
the weight gradient's contraction is the rows, in 32-row blocks within one group (groups are 256-row aligned). The Hopper kernels and
Blackwell's weight gradient are olmax's: with groups aligned to 64-row tiles each tile belongs to one group, so
a program multiplies by one w[g] and stores its tile whole, a weight gradient sums whole tiles without masking
rows, tiles after the last group (the unused part of the layout's static bound: a quarter of the rows at
impl.moe.ep_capacity=1.25) are skipped, and the grids are one program per output tile (no SM count). w^T and
x^T are XLA transposes: the interpreter that tests the Hopper kernels on a CPU cannot run a wgmma on a
transposed view of shared memory.

Evaluated and not taken (jax 0.10.2, tokamax 0.0.12):
- tokamax, openxla's Pallas kernel library: its `ragged_dot` picks its kernel from the compute capability of the
  process's default device, so a compile from a CPU host for a GPU target gets XLA's dense expansion
  (implementation="mosaic" and "triton": "Not supported on cpu"); its kernels are private modules; it has no
  sm_100 kernel for the weight gradient (ragged contraction); and importing it imports qwix, which imports flax.
- JAX's Hopper kernels: `ragged_dot_mgpu` sizes its persistent grid for an H100's 132 SMs, runs every tile of
  its grid (tiles past the last group included) and cannot be named for the step-time model (its kernel is
  "body"); `transposed_ragged_dot_mgpu` reads the SM count from jax.devices()[0] (a CPU when compiling from
  one) and transposes in shared memory, which the interpreter cannot run.
- Blackwell: `blackwell_ragged_dot_mgpu` is taken. Its tensor memory the interpreter cannot run ("Unsupported
  memory space: tmem"), so it is checked by compiling for a B300; it reads the SM count from
  jax.local_devices()[0], which `_on_device` makes the target's; its `collective=False` form does not trace
  (an unbound cluster axis), so it runs in pairs of SMs on 256 x 256 tiles. JAX has no tcgen05 kernel for the
  weight gradient (a ragged contraction): olmax's `blackwell_weight_grad` runs a program per (column tile, row
  tile of K, group) on one SM each, 128 x 256 tiles accumulated in tensor memory, no cluster: a collective pair
  would share a 256 x 256 tile (half the shared-memory reads a FLOP) but tie two SMs' programs together, and it
  is checked by compiling for a B300 as the other is. In float32 neither compiles (JAX's tiles exceed shared
  memory; tcgen05 in warpgroup semantics takes no TF32): the check before a run (selfcheck) falls back to the
  block loop.
Mosaic GPU assembles its kernels with ptxas when XLA compiles the program (CUDA_ROOT, the nvidia-cuda-nvcc
package, or the PATH provide it), and keeps the first GPU generation a process compiles for: one target a
process (as `olmax compile` runs).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import blackwell_ragged_dot_mgpu

from olmax.model import fp8, kernel_work
from olmax.model.fp8 import MX_BLOCK, MX_SCALES, MX_VALUES

# Tiles (rows x columns x contraction). Hopper: output tiles of 128 columns and 64 rows (a wgmma's, and a group's
# alignment: the forward) or 128 (the weight gradient), 64-deep steps, 4 in flight: at most 4 x (128 x 64 + 64 x
# 128) x 2 B = 128 KiB of shared memory of 228. Blackwell: 128 x 128 per SM, two SMs of a cluster sharing one
# 256 x 256 tile (the kernel's `collective` form, the one its benchmark tunes).
HOPPER = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)
BLACKWELL = blackwell_ragged_dot_mgpu.TuningConfig(
    tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, collective=True, grid_tile_width=1,
    grid_minor_dim=blackwell_ragged_dot_mgpu.blackwell_matmul_mgpu.MatmulDimension.M)
ROW_TILE = 2 * BLACKWELL.tile_m
WARPGROUP = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
ALIGN = 64  # rows: each group padded to a multiple (gmm's `block`), the weight gradient's contraction step
# Blackwell's layout: 256-row blocks, taken when its weight gradient was XLA's block loop over them (a quarter
# of 64-row blocks' steps); its kernel steps through 64 rows at a time, so ALIGN would do, with under 64 zero
# rows a group instead of 256.
BLACKWELL_BLOCK = 256
# Blackwell's weight gradient: 128 x 256 output tiles on one SM, accumulated in 256 columns of tensor memory, in
# steps of rows 128 bytes wide in shared memory (the widest swizzle: 64 rows of bf16), 4 in flight: 4 x (128 x
# 64 + 64 x 256) x 2 B = 192 KiB of shared memory, and 2 x 16 KiB for the stores, of 227.
BLACKWELL_GRAD = dict(block_m=128, block_n=256, max_concurrent_steps=4)
SWIZZLE = 128  # bytes
# The kernels' widths (d_model and expert_hidden), by compute capability's major version: Hopper's tiles are 128
# and 64 wide, Blackwell's 256 (JAX's kernel's cluster tiles, and the weight gradient's columns). Other widths
# are padded with zeros to a multiple (`gmm`): the 1.2T MoE's 4,480-wide experts run 4,608 columns on a B300
# (2.9% more work), as they are on an H100.
WIDTH_MULTIPLE = {9: 128, 10: 256}


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
    """Why the grouped kernels cannot run the experts on `device`, or None when they can (any width: `gmm`)."""
    if device is None:
        return "its kernels are chosen for a GPU's compute capability, and no device was given"
    cc = getattr(device, "compute_capability", None)
    major = None if cc is None else int(float(cc))
    if device.platform not in ("gpu", "cuda") or major not in WIDTH_MULTIPLE:
        return f"its kernels are for NVIDIA Hopper (sm_90) and Blackwell (sm_100) GPUs, not {device.device_kind}"
    return None


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


def _padded(a, rows: int = ROW_TILE):
    # Whole tiles of rows: no tile reads past the array, and Blackwell's kernel takes no partial tile. The rows
    # added are zeros and belong to no group.
    return jnp.pad(a, ((0, -a.shape[0] % rows), (0, 0)))


def _product(x, w, counts, block_starts, chip: Chip):
    """x [M, K] times w[g] ([G, K, N]), group g's rows in order: [M, N], garbage after the last group's rows (the
    kernels write only the groups' rows)."""
    if chip.major == 9:
        return _grouped_matmul(x, w, block_starts)
    with _on_device(chip):
        y = blackwell_ragged_dot_mgpu.ragged_dot_kernel(_padded(x), w, counts, BLACKWELL)
    return y[: x.shape[0]]


def _tile_groups(block_starts, tiles: int):
    """The group of each ALIGN-row tile of rows ([tiles]; G after the last group)."""
    return jnp.searchsorted(block_starts, jnp.arange(tiles, dtype=block_starts.dtype), side="right") - 1


def _grouped_matmul(x, w, block_starts):
    """Hopper: x [M, K] times w[g] ([G, K, N]) for groups that start on multiples of ALIGN rows (block_starts in
    ALIGN-row tiles): one program per (column tile, ALIGN-row tile), each tile in one group, so it multiplies by
    one w[g] and stores whole; tiles after the last group are skipped (their rows left unwritten). Column tiles
    vary fastest: the programs running at once share their rows of x, and consecutive row tiles their w[g]."""
    (m, k), (groups, _, n) = x.shape, w.shape
    bm, bn, bk = ALIGN, HOPPER["block_n"], HOPPER["block_k"]
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
                    max_concurrent_steps=HOPPER["max_concurrent_steps"],
                )(x_gmem, w_gmem.at[g])
                return acc[...]

            _store(pl.run_scoped(accumulate, plgpu.ACC((bm, bn))), out_gmem.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])

    y = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((tiles * bm, n), x.dtype), grid=(n // bn, tiles), grid_names=("n", "m"),
        kernel_name="grouped_matmul", compiler_params=WARPGROUP,
    )(_tile_groups(block_starts, tiles), _padded(x, bm), w)
    return y[:m]


def _store(acc, out_gmem):
    """A program's float32 accumulator to its output tile, in the output's dtype, through shared memory."""
    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM(acc.shape, out_gmem.dtype))
    def store(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _weight_grad(xt, dy, block_starts):
    """Per group, xt[:, its rows] @ dy[its rows] ([G, K, N] from xt [K, M] and dy [M, N]) on Hopper, for groups
    that start and end on multiples of ALIGN rows, their padding rows zero in xt and dy: each (group, tile)
    program sums the group's ALIGN-row steps with wgmma, no row masked. Non-persistent: one program per output
    tile, so no SM count; a group's tiles run together (the group varies slowest), sharing its rows."""
    k, n, groups = xt.shape[0], dy.shape[1], block_starts.shape[0] - 1
    bm, bn, bk = HOPPER["block_m"], HOPPER["block_n"], ALIGN

    def body(starts_gmem, xt_gmem, dy_gmem, out_gmem):
        g, mi, ni = (jax.lax.axis_index(axis) for axis in ("g", "m", "n"))
        first, last = starts_gmem[g], starts_gmem[g + 1]

        def accumulate(acc):
            plgpu.emit_pipeline(
                lambda _, xt_smem, dy_smem: plgpu.wgmma(acc, xt_smem, dy_smem),
                grid=(last - first,),
                in_specs=[plgpu.BlockSpec((bm, bk), lambda i: (mi, first + i), delay_release=1),
                          plgpu.BlockSpec((bk, bn), lambda i: (first + i, ni), delay_release=1)],
                max_concurrent_steps=HOPPER["max_concurrent_steps"],
            )(xt_gmem, dy_gmem)
            return acc[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))
        _store(acc, out_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((groups, k, n), xt.dtype), grid=(n // bn, k // bm, groups),
        grid_names=("n", "m", "g"), kernel_name="grouped_weight_grad", compiler_params=WARPGROUP,
    )(block_starts, xt, dy)


def _tcgen05_tiles(name: str, grid: dict, table, operands, out_type, program, ring_tiles, block_n: int, ring: int,
                   scaled: bool):
    """The Blackwell kernels olmax writes: one program per output tile [block_m, block_n] of `out_type` (a
    program per point of `grid`, {axis name: size}) on one SM, summing steps of its contraction in tensor memory.
    `program(ids, table, *operands, out)` says what a program does: (runs, steps, views, out_tile), `runs` whether
    it runs at all, `steps` how many steps it sums, `views(i)` the HBM tiles of its step i that TMA copies into
    the ring of shared memory `ring_tiles` describes ((shape, dtype, swizzled) each, `ring` slots): A [block_m,
    bk] and B, bf16 as [bk, block_n] or (`scaled`: MXFP8, e4m3 taken along the contraction) as [block_n, bk]
    followed by A's and B's e8m0 scales in tcgen05's layout (`mx_operand`), which the MMA warp copies into
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


def _blackwell_weight_grad(xt, dy, step_starts):
    """Per group, xt[:, its rows] @ dy[its rows] ([G, K, N] from xt [K, M] and dy [M, N]) on Blackwell, for
    groups that start and end on multiples of 64 rows (step_starts in 64-row steps: a step is 128 bytes of bf16),
    their padding rows zero: one program per (column tile, row tile of K, group) accumulates the group's steps in
    tensor memory (`_tcgen05_tiles`). An empty group runs no MMA and stores zeros."""
    k, n, groups, dtype = xt.shape[0], dy.shape[1], step_starts.shape[0] - 1, xt.dtype
    bm, bn = BLACKWELL_GRAD["block_m"], BLACKWELL_GRAD["block_n"]
    bk = SWIZZLE // jnp.dtype(dtype).itemsize  # rows a step

    def program(ids, starts_gmem, xt_gmem, dy_gmem, out_gmem):
        ni, mi, g = ids
        first, steps = starts_gmem[g], starts_gmem[g + 1] - starts_gmem[g]

        def views(i):
            rows = pl.ds((first + i) * bk, bk)
            return xt_gmem.at[pl.ds(mi * bm, bm), rows], dy_gmem.at[rows, pl.ds(ni * bn, bn)]

        return True, steps, views, out_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)]

    return _tcgen05_tiles(
        "blackwell_weight_grad", dict(n=n // bn, m=k // bm, g=groups), step_starts, (xt, dy),
        jax.ShapeDtypeStruct((groups, k, n), dtype), program, [((bm, bk), dtype, True), ((bk, bn), dtype, True)],
        bn, BLACKWELL_GRAD["max_concurrent_steps"], scaled=False)


# MXFP8 on Blackwell (impl.fp8=mxfp8): tcgen05's block-scaled MMA of e4m3 operands, both along the contraction,
# each 32 of them under an e8m0 scale (fp8.mx_quantize: the block loop's values and scales). Output tiles of
# 128 x 256 on one SM, steps of 128 along the contraction (128 bytes of e4m3, the widest swizzle), 3 in flight:
# 3 x (128 x 128 + 256 x 128 + 3 x 512 of scales) B = 148.5 KiB of shared memory, and 2 x 16 KiB for the stores,
# of 227 (4 in flight would need 230).
BLACKWELL_MX = dict(block_m=128, block_n=256, block_k=128, max_concurrent_steps=3)
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


def _mx_ring(block_m: int, block_n: int, bk: int) -> list:
    return [((block_m, bk), MX_VALUES, True), ((block_n, bk), MX_VALUES, True),
            ((block_m // SCALE_ROWS, 1, 32, 16), MX_SCALES, False), ((block_n // SCALE_ROWS, 1, 32, 16), MX_SCALES, False)]


def _mx_grouped_matmul(x, wt, tile_starts, out_dtype):
    """Blackwell, MXFP8: x [M, K] times w[g] for groups that start on multiples of 128 rows (tile_starts in
    128-row tiles), x = mx_operand(x) and wt = mx_operand(w^T) ([G, N, K]): one program per (column tile,
    row tile), each tile in one group, so it multiplies by one w[g] and stores whole; tiles after the last group
    are skipped (their rows left unwritten). Column tiles vary fastest, as in `_grouped_matmul`."""
    (xv, xs), (wv, ws) = x, wt
    (m, k), (groups, n, _) = xv.shape, wv.shape
    bm, bn, bk = BLACKWELL_MX["block_m"], BLACKWELL_MX["block_n"], BLACKWELL_MX["block_k"]
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

    return _tcgen05_tiles(
        "blackwell_mx_grouped_matmul", dict(n=n // bn, m=tiles), _tile_groups(tile_starts, tiles), (xv, wv, xs, ws),
        jax.ShapeDtypeStruct((m, n), out_dtype), program, _mx_ring(bm, bn, bk), bn,
        BLACKWELL_MX["max_concurrent_steps"], scaled=True)


def _mx_weight_grad(xt, dyt, step_starts, out_dtype):
    """Blackwell, MXFP8: per group, x[its rows]^T dy[its rows] ([G, K, N]) from xt = mx_operand(x^T) ([K, M])
    and dyt = mx_operand(dy^T) ([N, M]), both quantized along the rows in blocks of 32 (a group's rows start and
    end on multiples of 128: step_starts in 128-row steps, so no block holds two groups' rows), padding rows
    zero: one program per (column tile, row tile of K, group) sums the group's steps; an empty group stores
    zeros."""
    (xv, xs), (dv, dys) = xt, dyt
    k, n, groups = xv.shape[0], dv.shape[0], step_starts.shape[0] - 1
    bm, bn, bk = BLACKWELL_MX["block_m"], BLACKWELL_MX["block_n"], BLACKWELL_MX["block_k"]

    def program(ids, starts_gmem, xv_gmem, dv_gmem, xs_gmem, dys_gmem, out_gmem):
        ni, mi, g = ids
        first, steps = starts_gmem[g], starts_gmem[g + 1] - starts_gmem[g]

        def views(i):
            rows = pl.ds((first + i) * bk, bk)
            return (xv_gmem.at[pl.ds(mi * bm, bm), rows], dv_gmem.at[pl.ds(ni * bn, bn), rows],
                    xs_gmem.at[pl.ds(mi * (bm // SCALE_ROWS), bm // SCALE_ROWS), pl.ds(first + i, 1)],
                    dys_gmem.at[pl.ds(ni * (bn // SCALE_ROWS), bn // SCALE_ROWS), pl.ds(first + i, 1)])

        return True, steps, views, out_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)]

    return _tcgen05_tiles(
        "blackwell_mx_weight_grad", dict(n=n // bn, m=k // bm, g=groups), step_starts, (xv, dv, xs, dys),
        jax.ShapeDtypeStruct((groups, k, n), out_dtype), program, _mx_ring(bm, bn, bk), bn,
        BLACKWELL_MX["max_concurrent_steps"], scaled=True)


def _in_groups(y, counts):
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(counts))[:, None], y, 0)


def gmm(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int, chip: Chip, mxfp8: bool = False
        ) -> jax.Array:
    """gmm.gmm's grouped matmul (the same arguments: blocks block_starts[g] to block_starts[g + 1] - 1 of x
    times w[g]) as grouped kernels for `chip`, any width: x's columns and w's rows and columns padded with zeros
    to the kernels' WIDTH_MULTIPLE (zeros add nothing to a product; the padded columns are cut off). `mxfp8`:
    the three products in MXFP8 (Blackwell, blocks of a multiple of 128 rows), as the block loop's fp8.MXDot
    computes them."""
    multiple, (k, n) = WIDTH_MULTIPLE[chip.major], w.shape[1:]
    if k % multiple or n % multiple:
        x = jnp.pad(x, ((0, 0), (0, -k % multiple)))
        w = jnp.pad(w, ((0, 0), (0, -k % multiple), (0, -n % multiple)))
    if mxfp8:
        if chip.major != 10 or block % BLACKWELL_MX["block_m"]:
            raise ValueError(f"MXFP8 grouped kernels run on Blackwell in blocks of a multiple of "
                             f"{BLACKWELL_MX['block_m']} rows, not sm_{chip.major}0 in blocks of {block}")
        return _mx_gmm(x, w, block_starts, block)[:, :n]
    return _gmm(x, w, block_starts, block, chip)[:, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int, chip: Chip) -> jax.Array:
    counts = jnp.diff(block_starts) * block
    return _in_groups(_product(x, w, counts, block_starts * (block // ALIGN), chip), counts)


def _gmm_fwd(x, w, block_starts, block, chip):
    return _gmm(x, w, block_starts, block, chip), (x, w, block_starts)


def _gmm_bwd(block, chip, res, dy):
    x, w, block_starts = res
    counts = jnp.diff(block_starts) * block
    # The input gradient is the forward kernel's product with each w[g] transposed by XLA first: a wgmma could
    # read w[g] transposed in shared memory, but Pallas' GPU interpreter cannot run that (wgmma on a
    # TransposeTransform), and the weights are small beside the rows. The same holds for x^T in the weight gradient.
    aligned = block_starts * (block // ALIGN)
    dx = _in_groups(_product(dy, jnp.swapaxes(w, 1, 2), counts, aligned, chip), counts)
    if chip.major == 9:
        dw = _weight_grad(x.T, dy, aligned)
    else:
        dw = _blackwell_weight_grad(x.T, dy, aligned)
    return dx, dw.astype(w.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# MXFP8: each product quantizes its two operands along its contraction, once a call (x in the forward, dy once
# for each gradient, w once for each product), in the layout the kernels read: both operands along the
# contraction, so x^T, dy^T and w^T are XLA transposes (before quantizing: one pass each). What the backward keeps
# is x and w as they came (the block loop keeps the same).
MX_OPERANDS = {  # each product's two operands as its kernel takes them, quantized along the product's contraction
    "y": lambda x, w: (mx_operand(_padded(x)), mx_operand(jnp.swapaxes(w, 1, 2))),  # x [M, K], w^T [G, N, K]
    "dx": lambda dy, w: (mx_operand(_padded(dy)), mx_operand(w)),  # dy [M, N], w [G, K, N]
    "dw": lambda x, dy: (mx_operand(_padded(x).T), mx_operand(_padded(dy).T)),  # x^T [K, M], dy^T [N, M]
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mx_gmm(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int) -> jax.Array:
    tiles = block_starts * (block // BLACKWELL_MX["block_m"])
    y = _mx_grouped_matmul(*MX_OPERANDS["y"](x, w), tiles, x.dtype)
    return _in_groups(y[: x.shape[0]], jnp.diff(block_starts) * block)


def _mx_gmm_fwd(x, w, block_starts, block):
    return _mx_gmm(x, w, block_starts, block), (x, w, block_starts)


def _mx_gmm_bwd(block, res, dy):
    x, w, block_starts = res
    tiles = block_starts * (block // BLACKWELL_MX["block_m"])
    dx = _mx_grouped_matmul(*MX_OPERANDS["dx"](dy, w), tiles, dy.dtype)
    dx = _in_groups(dx[: x.shape[0]], jnp.diff(block_starts) * block)
    dw = _mx_weight_grad(*MX_OPERANDS["dw"](x, dy), tiles, dy.dtype)
    return dx, dw.astype(w.dtype), None


_mx_gmm.defvjp(_mx_gmm_fwd, _mx_gmm_bwd)


# The kernels' work for the step-time model (olmax.model.kernel_work), from their grids and tiles as they
# launch them, each operand read from HBM once (the grid orders keep the programs that run together on the same
# rows and weights). olmax's kernels skip the tiles after the last group: they run the rows the routing fills,
# each group's padded to whole tiles or blocks (at the routing's expectation where the step-time model gives it;
# the whole buffer otherwise, an upper bound). JAX's Blackwell kernel runs every row tile of its grid, filled or
# not.
def _routed_rows(call: kernel_work.KernelCall, rows: int, groups: int, block: int = ALIGN) -> int:
    if call.rows_per_group is None:
        return rows
    return min(rows, groups * -(-math.ceil(call.rows_per_group) // block) * block)


def grouped_matmul_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    x, w = call.operands[1], call.operands[2]
    rows, k = x.dims
    n = w.dims[2]
    used = _routed_rows(call, rows, w.dims[0])
    over_rows = x.bytes + sum(a.bytes for a in call.outputs)
    return kernel_work.Work(2.0 * used * k * n, _moved(call, over_rows, used / rows), (ALIGN, HOPPER["block_n"], k),
                            x.dtype)


def _weight_grad_work(call: kernel_work.KernelCall, block: int, tile_m: int, tile_n: int) -> kernel_work.Work:
    # a weight gradient's programs step over their group's rows, each group padded to whole blocks
    xt, dy = call.operands[1], call.operands[2]
    (k, rows), n, groups = xt.dims, dy.dims[1], call.outputs[0].dims[0]
    used = _routed_rows(call, rows, groups, block)
    tile = (tile_m, tile_n, max(used // groups, block))  # a group's rows, on average
    return kernel_work.Work(2.0 * k * used * n, _moved(call, xt.bytes + dy.bytes, used / rows), tile, xt.dtype)


def grouped_weight_grad_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    return _weight_grad_work(call, ALIGN, HOPPER["block_m"], HOPPER["block_n"])


def blackwell_weight_grad_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    return _weight_grad_work(call, BLACKWELL_BLOCK, BLACKWELL_GRAD["block_m"], BLACKWELL_GRAD["block_n"])


def _moved(call: kernel_work.KernelCall, over_rows: float, share: float) -> float:
    # the arrays over the rows are read or written only where a tile runs; the weights whole
    return kernel_work.moved(call) - over_rows * (1 - share)


def blackwell_ragged_dot_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    x, w = call.operands[0], call.operands[1]
    (rows, k), (groups, _, n) = x.dims, w.dims
    tile_m = 2 * BLACKWELL.tile_m  # a cluster's pair of SMs
    tiles = rows // tile_m + groups - 1  # the kernel's linear grid of row tiles: every group may start one
    return kernel_work.Work(2.0 * tiles * tile_m * k * n, kernel_work.moved(call),
                            (BLACKWELL.tile_m, 2 * BLACKWELL.tile_n, k), x.dtype)


# The MXFP8 kernels: e4m3 operands (the step-time model's float8 rate), the scales moved with them (a byte per 32
# values), the groups padded to Blackwell's 256-row blocks.
def blackwell_mx_grouped_matmul_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    _, x, w, x_scales, _ = call.operands
    (rows, k), (groups, n, _) = x.dims, w.dims
    used = _routed_rows(call, rows, groups, BLACKWELL_BLOCK)
    over_rows = x.bytes + x_scales.bytes + sum(a.bytes for a in call.outputs)
    return kernel_work.Work(2.0 * used * k * n, _moved(call, over_rows, used / rows),
                            (BLACKWELL_MX["block_m"], BLACKWELL_MX["block_n"], k), x.dtype)


def blackwell_mx_weight_grad_work(call: kernel_work.KernelCall) -> kernel_work.Work:
    xt, dyt = call.operands[1], call.operands[2]
    (k, rows), n, groups = xt.dims, dyt.dims[0], call.outputs[0].dims[0]
    used = _routed_rows(call, rows, groups, BLACKWELL_BLOCK)
    tile = (BLACKWELL_MX["block_m"], BLACKWELL_MX["block_n"], max(used // groups, BLACKWELL_BLOCK))
    over_rows = sum(a.bytes for a in call.operands[1:])  # the values and scales of x^T and dy^T
    return kernel_work.Work(2.0 * k * used * n, _moved(call, over_rows, used / rows), tile, xt.dtype)


kernel_work.WORK |= {"grouped_matmul": grouped_matmul_work, "grouped_weight_grad": grouped_weight_grad_work,
                     f"ragged_dot_kernel_{BLACKWELL}": blackwell_ragged_dot_work,
                     "blackwell_weight_grad": blackwell_weight_grad_work,
                     "blackwell_mx_grouped_matmul": blackwell_mx_grouped_matmul_work,
                     "blackwell_mx_weight_grad": blackwell_mx_weight_grad_work}
