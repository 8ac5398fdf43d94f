"""The experts' grouped matmul on NVIDIA GPUs as Pallas Mosaic GPU kernels: `impl.moe.dispatch=grouped`.

Rows x [M, K] sorted by group, group g's rows times w[g] ([G, K, N]), under one custom VJP whose three products
are grouped kernels where one exists for the chip, each GPU running only its own (resident) experts' rows:

    product           Hopper (sm_90)                               Blackwell (sm_100)
    y  = x w          ragged_dot_mgpu.ragged_dot (wgmma)           blackwell_ragged_dot_mgpu (tcgen05)
    dx = dy w^T       ragged_dot_mgpu.ragged_dot, transpose_rhs    blackwell_ragged_dot_mgpu on w^T
    dw = x^T dy       transposed_ragged_dot_mgpu (wgmma)           the block loop (gmm.py): no tcgen05 kernel

All three are JAX's own kernels (jax.experimental.pallas.ops.gpu, jax 0.10.2): bf16 (or float32) in,
accumulated in float32, out in the input's dtype. The layout is the block loop's (gmm._swiglu_blocks): each
group padded to a multiple of `block` rows, which the Blackwell weight gradient's loop needs and the kernels
ignore (their tiles cross groups; an empty group costs nothing). Rows after the last group are 0.

Why these and not tokamax 0.0.12 (openxla's kernel library, which wraps kernels of the same design): its
`ragged_dot` chooses its kernel from the compute capability of the process's default device, so a compile from
a CPU host for a GPU target gets XLA's dense expansion ("Not supported on cpu" for implementation="mosaic"),
and reaching its kernels means importing its private modules; it has no sm_100 kernel for the weight gradient
either; and importing it imports qwix, which imports flax. JAX's kernels read the SM count from the process's
first device (the Hopper forward kernel assumes an H100's 132); `_on_device` gives them the target's.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import blackwell_ragged_dot_mgpu, ragged_dot_mgpu

from olmax.model.moe import gmm as block_loop

# Tiles (rows x columns x contraction). Hopper: a wgmma is 64 rows; 128 x 128 output tiles, 64-deep steps, 4 in
# flight: 4 x (128 x 64 + 64 x 128) x 2 B = 128 KiB of shared memory of 228. Blackwell: 128 x 128 per SM, two SMs
# of a cluster sharing one 256 x 256 tile (the kernel's `collective` form, the one its benchmark tunes).
HOPPER = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)
BLACKWELL = blackwell_ragged_dot_mgpu.TuningConfig(
    tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, collective=True, grid_tile_width=1,
    grid_minor_dim=blackwell_ragged_dot_mgpu.blackwell_matmul_mgpu.MatmulDimension.M)
ROW_TILE = 2 * BLACKWELL.tile_m
ALIGN = 64  # rows: each group padded to a multiple (gmm's `block`), the weight gradient's contraction step
WIDTH_MULTIPLE = 256  # d_model and expert_hidden: Blackwell's 256-wide cluster tiles, Hopper's 128 and 64


@dataclass(frozen=True)
class Chip:
    """The GPU the kernels are built for: its compute capability's major version (9 Hopper, 10 Blackwell) and
    SM count, as the target's devices report them (a compile-only device has both)."""

    major: int
    sms: int

    @classmethod
    def of(cls, device) -> Chip:
        return cls(int(float(device.compute_capability)), device.core_count)


def unsupported(device, widths: dict[str, int]) -> str | None:
    """Why the grouped kernels cannot run the experts on `device` with these widths, or None when they can."""
    cc = getattr(device, "compute_capability", None)
    if device.platform not in ("gpu", "cuda") or cc is None or int(float(cc)) not in (9, 10):
        return f"its kernels are for NVIDIA Hopper (sm_90) and Blackwell (sm_100) GPUs, not {device.device_kind}"
    for name, value in widths.items():
        if value % WIDTH_MULTIPLE:
            return f"its kernels tile {name} ({value}) in multiples of {WIDTH_MULTIPLE}"
    return None


class _JaxOn(types.SimpleNamespace):
    """The jax module as JAX's kernel modules use it, with `device` as the process's only device."""

    def __init__(self, device):
        super().__init__(devices=lambda *_: [device], local_devices=lambda *_: [device])

    def __getattr__(self, name):
        return getattr(jax, name)


@contextlib.contextmanager
def _on_device(chip: Chip):
    # While the kernels are traced, their modules see a device with the target's SM count: they size their
    # persistent grids from jax.devices()[0] or jax.local_devices()[0], a CPU when compiling from a CPU host.
    modules = (blackwell_ragged_dot_mgpu,)
    saved = [m.jax for m in modules]
    for m in modules:
        m.jax = _JaxOn(types.SimpleNamespace(core_count=chip.sms))
    try:
        yield
    finally:
        for m, j in zip(modules, saved):
            m.jax = j


def _padded(a):
    # Whole tiles of rows (Blackwell's cluster tile of 256 is a multiple of Hopper's 128): no tile reads past the
    # array, and Blackwell's kernel takes no partial tile. The rows added are zeros and belong to no group.
    return jnp.pad(a, ((0, -a.shape[0] % ROW_TILE), (0, 0)))


def _product(x, w, counts, chip: Chip):
    """x [M, K] times w[g] ([G, K, N]), group g's rows in order: [M, N], garbage after the last group's rows (the
    kernels write only the groups' rows)."""
    if chip.major == 9:
        y = ragged_dot_mgpu.ragged_dot(_padded(x), w, group_sizes=counts, grid_block_n=1, **HOPPER)
    else:
        with _on_device(chip):
            y = blackwell_ragged_dot_mgpu.ragged_dot_kernel(_padded(x), w, counts, BLACKWELL)
    return y[: x.shape[0]]


def _weight_grad(xt, dy, block_starts):
    """Per group, xt[:, its rows] @ dy[its rows] ([G, K, N] from xt [K, M] and dy [M, N]) on Hopper, for groups
    that start and end on multiples of ALIGN rows, their padding rows zero in xt and dy: each (group, tile)
    program sums the group's ALIGN-row steps with wgmma, no row masked. Non-persistent: one program per output
    tile, so no SM count."""
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

        @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((bm, bn), out_gmem.dtype))
        def store(out_smem):
            out_smem[...] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((groups, k, n), xt.dtype), grid=(groups, k // bm, n // bn),
        grid_names=("g", "m", "n"), kernel_name="grouped_weight_grad",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(block_starts, xt, dy)


def _in_groups(y, counts):
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(counts))[:, None], y, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int, chip: Chip) -> jax.Array:
    """gmm.gmm's grouped matmul (the same arguments: blocks block_starts[g] to block_starts[g + 1] - 1 of x
    times w[g]) as grouped kernels for `chip`."""
    counts = jnp.diff(block_starts) * block
    return _in_groups(_product(x, w, counts, chip), counts)


def _gmm_fwd(x, w, block_starts, block, chip):
    return gmm(x, w, block_starts, block, chip), (x, w, block_starts)


def _gmm_bwd(block, chip, res, dy):
    x, w, block_starts = res
    counts = jnp.diff(block_starts) * block
    # The input gradient is the forward kernel's product with each w[g] transposed by XLA first: JAX's kernel
    # can transpose its operand in shared memory, but Pallas' GPU interpreter cannot run that (wgmma on a
    # TransposeTransform), and the weights are small beside the rows.
    dx = _in_groups(_product(dy, jnp.swapaxes(w, 1, 2), counts, chip), counts)
    if chip.major == 9:
        dw = _weight_grad(x.T, dy, block_starts * (block // ALIGN))
    else:
        dw = block_loop.weight_grad(x, dy, w.shape, block_starts, block, block_loop.dot_f32)
    return dx, dw.astype(w.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
