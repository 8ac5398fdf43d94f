"""The experts' SwiGLU over the rows routed to them (`grouped_swiglu`): each row's assignments laid out by expert,
each expert's rows padded to a block multiple (the layout the block loop, olmax.model.moe.block_loop, and the GPU
kernels, olmax.model.moe.kernels, run on), or sorted for `jax.lax.ragged_dot`; the outputs weighed by their gates
and summed per row. The rows are moved by olmax.parallel.permute's gathers, whose backward is the gather of the
other direction: no scatter-add of rows runs, forward or backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from olmax.model.mlp import swiglu
from olmax.model.moe.block_loop import dot_f32, matmul, vary_like
from olmax.parallel.expert import rank_within
from olmax.parallel.permute import sum_rows, take_rows


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
    # the layout row of each assignment (past the layout: dropped) and the assignment of each layout row (R: none)
    slot = jnp.where(flat < G, block_starts[jnp.minimum(flat, G - 1)] * block + rank, n_blocks * block)
    source = jnp.full(n_blocks * block, R, jnp.int32).at[slot].set(jnp.arange(R, dtype=jnp.int32), mode="drop")
    xp = take_rows(x, source // k, slot.reshape(M, k))
    w1, w3, w2 = (vary_like(w.astype(x.dtype), x) for w in (w1, w3, w2))
    y = swiglu(xp, w1, w3, w2, lambda a, w, name: checkpoint_name(product(a, w, block_starts, block), name))
    if gates is None:  # each assignment's output (a capacity's exchange)
        return take_rows(y, slot, source[:, None]).reshape(M, k, -1)
    return sum_rows(y, slot.reshape(M, k), source, gates)


@jax.custom_vjp
def ragged_dot(x: jax.Array, w: jax.Array, counts: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(x, w, counts) whose forward and both gradients each run unbatched under a vmap (in a loop
    of one trip a device under the pipeline's map over its stages): the TPU's ragged-dot kernel takes no batch
    dimension ("Failed to create RaggedConvSpec"). Its gradients are ragged_dot's own."""
    return jax.custom_batching.sequential_vmap(jax.lax.ragged_dot)(x, w, counts)


def _ragged_dot_fwd(x, w, counts):
    return ragged_dot(x, w, counts), (x, w, counts)


@jax.custom_batching.sequential_vmap
def _ragged_dot_grads(x, w, counts, dy):
    return jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, counts), x, w)[1](dy)


def _ragged_dot_bwd(saved, dy):
    return (*_ragged_dot_grads(*saved, dy), None)


ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _swiglu_ragged(x, groups, w1, w3, w2, assignments=None, gates=None):
    M, k = groups.shape
    G = w1.shape[0]
    flat = groups.reshape(-1)
    # dropped ids (G) sort last, outside every group: the first `assignments` hold every real one
    used = min(M * k, assignments or M * k)
    order = jnp.argsort(flat, stable=True)[:used]
    counts = jnp.zeros(G + 1, jnp.int32).at[flat].add(1)[:G]
    # where each assignment's row is in the sorted rows (used: past them, or dropped), and each sorted row's
    # assignment (M x k: dropped)
    position = jnp.where(flat < G, jnp.full(M * k, used, jnp.int32).at[order].set(jnp.arange(used, dtype=jnp.int32)),
                         used)
    order = jnp.where(flat[order] < G, order, M * k)
    xs = take_rows(x, order // k, position.reshape(M, k))
    y = swiglu(xs, w1, w3, w2,
               lambda a, w, name: checkpoint_name(ragged_dot(a, w.astype(x.dtype), counts), name))
    if gates is None:
        return take_rows(y, position, order[:, None]).reshape(M, k, -1)
    return sum_rows(y, position.reshape(M, k), order, gates)


def grouped_swiglu(x: jax.Array, groups: jax.Array, w1, w3, w2, *, dispatch: str, block: int,
                   dot=dot_f32, product=None, assignments: int | None = None, gates=None) -> jax.Array:
    """Each row's experts on it: x [M, D], groups [M, k] ids in [0, G] (G = none) -> [M, k, D]; with `gates`
    [M, k], their sum weighed by them (`combine`) [M, D].

    w1, w3 [G, D, F] and w2 [G, F, D] are cast to x's dtype; rows with id G give 0. `dot` is the block
    loop's product (see block_loop.matmul); ragged_dot has its own. `product(x, w, block_starts, block)` replaces
    block_loop.matmul over the same block layout (kernels.grouped.matmul: the GPU's grouped-matmul kernels).
    `assignments` bounds the ids below G, which sizes the block layout (None: M x min(k, G); an id past the bound
    would be lost)."""
    if dispatch == "ragged_dot":
        return _swiglu_ragged(x, groups, w1, w3, w2, assignments, gates)
    product = product or (lambda a, w, starts, b: matmul(a, w, starts, b, dot))
    return _swiglu_blocks(x, groups, w1, w3, w2, block, product, assignments, gates)


def combine(y: jax.Array, gates: jax.Array) -> jax.Array:
    """sum_k gates[n, k] * y[n, k, :], gates in float32."""
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), gates).astype(y.dtype)

