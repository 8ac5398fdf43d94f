"""The experts' grouped matmul on NVIDIA GPUs as Pallas Mosaic GPU kernels (`impl.moe.dispatch=grouped`): `matmul`,
the block loop's grouped matmul (olmax.model.moe.block_loop) as the kernels of a chip.

Rows x [M, K] in the block loop's layout (olmax.model.moe.experts: sorted by group, each group padded with zero
rows to a multiple of the chip's block, 64 on Hopper and 256 on Blackwell), group g's rows times w[g]
([G, K, N]), under one custom VJP whose three products are grouped kernels, each GPU running only its own
(resident) experts' rows:

    product        Hopper (sm_90, wgmma)          Blackwell (sm_100, tcgen05)          Blackwell, MXFP8
    y  = x w       hopper.matmul_kernel           blackwell.matmul_kernel (JAX's       mxfp8.matmul_kernel on w^T
                                                  blackwell_ragged_dot_mgpu)
    dx = dy w^T    hopper.matmul_kernel on w^T    blackwell.matmul_kernel on w^T       mxfp8.matmul_kernel on w
    dw = x^T dy    hopper.weight_grad_kernel      blackwell.weight_grad_kernel         mxfp8.weight_grad_kernel on
                   on x^T                         on x^T                               x^T, dy^T

bf16 in (float32 too on Hopper), accumulated in float32, out in the input's dtype; MXFP8 (impl.fp8=mxfp8) on
Blackwell only, its own VJP (mxfp8.matmul). w^T and x^T are XLA transposes: the interpreter that tests the Hopper
kernels on a CPU cannot run a wgmma on a transposed view of shared memory. Each kernel module keeps its tuning
configuration and its work for the step-time model beside its kernels.

Evaluated and not taken (jax 0.10.2, tokamax 0.0.12):
- tokamax, openxla's Pallas kernel library: its `ragged_dot` picks its kernel from the compute capability of the
  process's default device, so a compile from a CPU host for a GPU target gets XLA's dense expansion
  (implementation="mosaic" and "triton": "Not supported on cpu"); its kernels are private modules; it has no
  sm_100 kernel for the weight gradient (ragged contraction); and importing it imports qwix, which imports flax.
- JAX's Hopper kernels: `ragged_dot_mgpu` sizes its persistent grid for an H100's 132 SMs, runs every tile of
  its grid (tiles past the last group included) and cannot be named for the step-time model (its kernel is
  "body"); `transposed_ragged_dot_mgpu` reads the SM count from jax.devices()[0] (a CPU when compiling from
  one) and transposes in shared memory, which the interpreter cannot run.
- Blackwell: `blackwell_ragged_dot_mgpu` is taken (olmax.model.moe.kernels.blackwell says how).
Mosaic GPU assembles its kernels with ptxas when XLA compiles the program (CUDA_ROOT, the nvidia-cuda-nvcc
package, or the PATH provide it), and keeps the first GPU generation a process compiles for: one target a
process (as `olmax compile` runs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from olmax.model.moe.kernels import blackwell, hopper
from olmax.model.moe.kernels import mxfp8 as mx
from olmax.model.moe.kernels.chip import ALIGN, WIDTH_MULTIPLE, Chip, in_groups

MXFP8_ROWS = mx.TUNING.block_m  # the MXFP8 kernels' row tiles: a block must be a multiple


def matmul(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int, chip: Chip, mxfp8: bool = False
           ) -> jax.Array:
    """block_loop.matmul's grouped matmul (the same arguments: blocks block_starts[g] to block_starts[g + 1] - 1
    of x times w[g]) as grouped kernels for `chip`, any width: x's columns and w's rows and columns padded with
    zeros to the kernels' WIDTH_MULTIPLE (zeros add nothing to a product; the padded columns are cut off).
    `mxfp8`: the three products in MXFP8 (Blackwell, blocks of a multiple of 128 rows), as the block loop's
    fp8.MXDot computes them."""
    multiple, (k, n) = WIDTH_MULTIPLE[chip.major], w.shape[1:]
    if k % multiple or n % multiple:
        x = jnp.pad(x, ((0, 0), (0, -k % multiple)))
        w = jnp.pad(w, ((0, 0), (0, -k % multiple), (0, -n % multiple)))
    if mxfp8:
        if chip.major != 10 or block % MXFP8_ROWS:
            raise ValueError(f"MXFP8 grouped kernels run on Blackwell in blocks of a multiple of "
                             f"{MXFP8_ROWS} rows, not sm_{chip.major}0 in blocks of {block}")
        return mx.matmul(x, w, block_starts, block)[:, :n]
    return _bf16_matmul(x, w, block_starts, block, chip)[:, :n]


def _product(x, w, counts, block_starts, chip: Chip):
    """x [M, K] times w[g] ([G, K, N]), group g's rows in order: [M, N], garbage after the last group's rows (the
    kernels write only the groups' rows)."""
    if chip.major == 9:
        return hopper.matmul_kernel(x, w, block_starts)
    return blackwell.matmul_kernel(x, w, counts, chip=chip)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _bf16_matmul(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int, chip: Chip) -> jax.Array:
    counts = jnp.diff(block_starts) * block
    return in_groups(_product(x, w, counts, block_starts * (block // ALIGN), chip), counts)


def _bf16_matmul_fwd(x, w, block_starts, block, chip):
    return _bf16_matmul(x, w, block_starts, block, chip), (x, w, block_starts)


def _bf16_matmul_bwd(block, chip, res, dy):
    x, w, block_starts = res
    counts = jnp.diff(block_starts) * block
    # The input gradient is the forward kernel's product with each w[g] transposed by XLA first: a wgmma could
    # read w[g] transposed in shared memory, but Pallas' GPU interpreter cannot run that (wgmma on a
    # TransposeTransform), and the weights are small beside the rows. The same holds for x^T in the weight gradient.
    aligned = block_starts * (block // ALIGN)
    dx = in_groups(_product(dy, jnp.swapaxes(w, 1, 2), counts, aligned, chip), counts)
    if chip.major == 9:
        dw = hopper.weight_grad_kernel(x.T, dy, aligned)
    else:
        dw = blackwell.weight_grad_kernel(x.T, dy, aligned)
    return dx, dw.astype(w.dtype), None


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)

