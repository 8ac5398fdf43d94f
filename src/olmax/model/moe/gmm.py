"""The experts' grouped matmul: each row of x times the weights of its group (expert), over blocks of rows,
with a VJP that runs the same loops; and the experts' SwiGLU on it.

Assignments are sorted by expert, each expert's rows padded to a block multiple, and loops over the
used blocks multiply each block by its expert's weights (`gmm`). Work is the routed rows plus under
one block per expert, whatever E; a dense expansion (every expert on every token, or XLA:CPU's
lowering of `ragged_dot`, the other `dispatch`) grows linearly with E.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from olmax.model.mlp import swiglu
from olmax.parallel.expert import own_full, rank_within

def auto_block_size(expected_rows: int, groups: int, smallest: int = 16) -> int:
    """A power of two near a quarter of the mean rows per group, in [smallest, 128]: a group's last, partly
    filled block wastes half a block on average (about an eighth of the work), and smaller blocks make
    smaller, less efficient matmuls."""
    target = max(expected_rows // (4 * groups), 1)
    return min(max(1 << (target.bit_length() - 1), smallest), 128)


def _vary_like(a, *like):
    # Inside shard_map, `a` made to vary over the mesh axes that `like` varies over (a no-op outside):
    # a loop carry must keep its type, and a custom_vjp's gradient must match its input's. The add's
    # transpose sums the gradient over those axes (over data-parallel replicas, for expert weights).
    return a + sum(jnp.zeros_like(b, a.dtype, shape=()) for b in like)


def _zeros(shape, dtype, *like):
    return _vary_like(jnp.zeros(shape, dtype), *like)


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
def gmm(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int, dot=dot_f32) -> jax.Array:
    """Grouped matmul over blocks of `block` rows: blocks block_starts[g] to block_starts[g + 1] - 1 of
    x [NB * block, D] times w[g] ([G, D, F]); rows after the last group's blocks are 0 and cost nothing
    (while loops over the used blocks only). The gradient runs the same loops: a while loop cannot be
    differentiated, and a scan's gradient would add a full [G, D, F] buffer per block. `dot(a, b,
    dimension_numbers)` is every product, forward and backward, in float32 (dot_f32; fp8.MXDot for MXFP8,
    whose `weight` quantizes w once for the loops)."""
    return _grouped_loop(x, w, block_starts, block, dot, contract_w=0)


def _gmm_fwd(x, w, block_starts, block, dot):
    return gmm(x, w, block_starts, block, dot), (x, w, block_starts)


def _gmm_bwd(block, dot, res, dy):
    x, w, block_starts = res
    dx = _grouped_loop(dy, w, block_starts, block, dot, contract_w=1)
    return dx, weight_grad(x, dy, w.shape, block_starts, block, dot).astype(w.dtype), None


def weight_grad(x, dy, w_shape, block_starts, block: int, dot) -> jax.Array:
    """gmm's weight gradient in float32 [G, D, F]: per group, its blocks' x^T dy summed."""
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


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _swiglu_blocks(x, groups, w1, w3, w2, block, product, assignments=None, gates=None):
    M, k = groups.shape
    G, R = w1.shape[0], groups.size
    flat = groups.reshape(-1)
    rank, counts = rank_within(flat, G + 1)
    blocks = -(-counts[:G] // block)
    block_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks)])
    # Static bound: at most min(k, G) real rows per row of x (or the caller's bound), and each group wastes
    # under one block.
    real = min(M * min(k, G), assignments or M * min(k, G))
    n_blocks = -(-(real + G * (block - 1)) // block)
    slot = jnp.where(flat < G, block_starts[jnp.minimum(flat, G - 1)] * block + rank, n_blocks * block)
    source = jnp.full(n_blocks * block, R, jnp.int32).at[slot].set(jnp.arange(R, dtype=jnp.int32), mode="drop")
    xp = jnp.take(x, source // k, axis=0, mode="fill", fill_value=0)
    w1, w3, w2 = (_vary_like(w.astype(x.dtype), x) for w in (w1, w3, w2))
    y = swiglu(xp, w1, w3, w2, lambda a, w, name: checkpoint_name(product(a, w, block_starts, block), name))
    if gates is None or k == 1:  # one id a row (a capacity's exchange): a gather, no scatter
        y = jnp.take(y, slot, axis=0, mode="fill", fill_value=0).reshape(M, k, -1)
        return y if gates is None else combine(y, gates)
    return _summed(y, gates, source, M)


def _summed(y, gates, assignment, M: int) -> jax.Array:
    """[M, D]: each laid-out row of y, the output of flat assignment `assignment` of gates [M, k] (M x k: none),
    weighed by its gate and added to its row: the laid-out rows' work, not M x k rows'."""
    k = gates.shape[1]
    weighed = y.astype(jnp.float32) * jnp.take(gates.reshape(-1), assignment, mode="fill", fill_value=0)[:, None]
    out = own_full((M, y.shape[1]), 0, jnp.float32, assignment)
    return out.at[assignment // k].add(weighed, mode="drop").astype(y.dtype)


def _swiglu_ragged(x, groups, w1, w3, w2, assignments=None, gates=None):
    M, k = groups.shape
    G = w1.shape[0]
    flat = groups.reshape(-1)
    # dropped ids (G) sort last, outside every group: the first `assignments` hold every real one
    order = jnp.argsort(flat, stable=True)[:min(M * k, assignments or M * k)]
    counts = jnp.zeros(G + 1, jnp.int32).at[flat].add(1)[:G]
    xs = jnp.take(x, order // k, axis=0)
    y = swiglu(xs, w1, w3, w2,
               lambda a, w, name: checkpoint_name(jax.lax.ragged_dot(a, w.astype(x.dtype), counts), name))
    y = jnp.where((flat[order] < G)[:, None], y, 0)
    if gates is None:
        return jnp.zeros((M * k, y.shape[1]), y.dtype).at[order].set(y).reshape(M, k, -1)
    return _summed(y, gates, order, M)


def grouped_swiglu(x: jax.Array, groups: jax.Array, w1, w3, w2, *, dispatch: str, block: int,
                   dot=dot_f32, product=None, assignments: int | None = None, gates=None) -> jax.Array:
    """Each row's experts on it: x [M, D], groups [M, k] ids in [0, G] (G = none) -> [M, k, D]; with `gates`
    [M, k], their sum weighed by them (`combine`) [M, D].

    w1, w3 [G, D, F] and w2 [G, F, D] are cast to x's dtype; rows with id G give 0. `dot` is the block
    loop's product (see `gmm`); ragged_dot has its own. `product(x, w, block_starts, block)` replaces `gmm`
    over the same block layout (grouped.gmm: the GPU's grouped-matmul kernels). `assignments` bounds the ids
    below G, which sizes the block layout (None: M x min(k, G); an id past the bound would be lost)."""
    if dispatch == "ragged_dot":
        return _swiglu_ragged(x, groups, w1, w3, w2, assignments, gates)
    return _swiglu_blocks(x, groups, w1, w3, w2, block, product or (lambda a, w, starts, b: gmm(a, w, starts, b, dot)),
                          assignments, gates)


def combine(y: jax.Array, gates: jax.Array) -> jax.Array:
    """sum_k gates[n, k] * y[n, k, :], gates in float32."""
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), gates).astype(y.dtype)
