"""XLA's block loop, the experts' grouped matmul on any device: each row of x times the weights of its group
(expert), over blocks of rows, with a VJP that runs the same loops (`matmul`).

The rows come sorted by expert, each expert's rows padded to a block multiple (olmax.model.moe.experts), and loops
over the used blocks multiply each block by its expert's weights. Work is the routed rows plus under one block per
expert, whatever E; a dense expansion (every expert on every token, or XLA:CPU's lowering of `ragged_dot`, the
other `dispatch`) grows linearly with E.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

def vary_like(a, *like):
    # Inside shard_map, `a` made to vary over the mesh axes that `like` varies over (a no-op outside):
    # a loop carry must keep its type, and a custom_vjp's gradient must match its input's. The add's
    # transpose sums the gradient over those axes (over data-parallel replicas, for expert weights).
    return a + sum(jnp.zeros_like(b, a.dtype, shape=()) for b in like)


def _zeros(shape, dtype, *like):
    return vary_like(jnp.zeros(shape, dtype), *like)


def dot_f32(a: jax.Array, b: jax.Array, dimension_numbers) -> jax.Array:
    """The grouped matmul's default product: lax.dot_general accumulated and returned in float32."""
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)


# The name of the loops over one group's blocks, whose trip count is data (the rows routed to the group): the
# step-time model finds them by it in the compiled program (olmax.scale.op_cost.ExpertBlocks).
BLOCK_LOOP = "expert_block_loop"


def _grouped_loop(x, w, block_starts, block: int, dot, contract_w: int):
    groups, out = w.shape[0], _zeros((x.shape[0], w.shape[2 - contract_w]), x.dtype, x, w)
    if hasattr(dot, "weight"):  # the weights as the dot takes them (an MXFP8 dot's: quantized), once for all blocks
        w = dot.weight(w, 1 + contract_w)

    def group(g, out):
        # one copy per group, not per block
        wg = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, g, keepdims=False), w)

        def one_block(b, out):
            xb = jax.lax.dynamic_slice_in_dim(x, b * block, block)
            yb = dot(xb, wg, (((1,), (contract_w,)), ((), ())))
            return jax.lax.dynamic_update_slice_in_dim(out, yb.astype(out.dtype), b * block, 0)

        with jax.named_scope(BLOCK_LOOP):
            return jax.lax.fori_loop(block_starts[g], block_starts[g + 1], one_block, out)

    return jax.lax.fori_loop(0, groups, group, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matmul(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int, dot=dot_f32) -> jax.Array:
    """Grouped matmul over blocks of `block` rows: blocks block_starts[g] to block_starts[g + 1] - 1 of
    x [NB * block, D] times w[g] ([G, D, F]); rows after the last group's blocks are 0 and cost nothing
    (while loops over the used blocks only). The gradient runs the same loops: a while loop cannot be
    differentiated, and a scan's gradient would add a full [G, D, F] buffer per block. `dot(a, b,
    dimension_numbers)` is every product, forward and backward, in float32 (dot_f32; fp8.MXDot for MXFP8,
    whose `weight` quantizes w once for the loops)."""
    return _grouped_loop(x, w, block_starts, block, dot, contract_w=0)


def _matmul_fwd(x, w, block_starts, block, dot):
    return matmul(x, w, block_starts, block, dot), (x, w, block_starts)


def _matmul_bwd(block, dot, res, dy):
    x, w, block_starts = res
    dx = _grouped_loop(dy, w, block_starts, block, dot, contract_w=1)
    return dx, weight_grad(x, dy, w.shape, block_starts, block, dot).astype(w.dtype), None


def weight_grad(x, dy, w_shape, block_starts, block: int, dot) -> jax.Array:
    """matmul's weight gradient in float32 [G, D, F]: per group, its blocks' x^T dy summed."""
    def group(g, dw):
        def one_block(b, acc):
            xb = jax.lax.dynamic_slice_in_dim(x, b * block, block)
            dyb = jax.lax.dynamic_slice_in_dim(dy, b * block, block)
            return acc + dot(xb, dyb, (((0,), (0,)), ((), ())))

        zeros = _zeros(w_shape[1:], jnp.float32, x, dy)
        with jax.named_scope(BLOCK_LOOP):
            acc = jax.lax.fori_loop(block_starts[g], block_starts[g + 1], one_block, zeros)
        return jax.lax.dynamic_update_index_in_dim(dw, acc, g, 0)

    return jax.lax.fori_loop(0, w_shape[0], group, _zeros(w_shape, jnp.float32, x, dy))


matmul.defvjp(_matmul_fwd, _matmul_bwd)
