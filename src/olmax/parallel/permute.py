"""Rows moved by the routing and summed back, each the other's backward, written by hand (`take_rows`,
`sum_rows`): the rows a device sends its peers, the experts' layout of the rows a device received, and the sums
of what comes back.

A row of `x` may be taken several times (a token sent to several devices, a row routed to several experts): for
each of them `inverse` lists where it went, W places a row ([rows of x, W], past the end: nowhere). Taking is a
gather; its transpose, which autodiff would build as a scatter-add into a buffer of zeros, is a gather of those W
places summed. Summing back (a token's rows returned from its peers, a row's experts' outputs weighed by its
gates) is that same gather-sum, in float32 within the fusion; its transpose is the gather. No scatter runs and no
buffer of zeros is written, forward or backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _summed(y: jax.Array, inverse: jax.Array, weights: jax.Array | None, dtype) -> jax.Array:
    taken = _gather(y, inverse).astype(jnp.float32)  # [rows, W, ...]
    if weights is not None:
        taken = taken * weights.astype(jnp.float32).reshape(*weights.shape, *(1,) * (taken.ndim - 2))
    return jnp.sum(taken, axis=1).astype(dtype)


@jax.custom_vjp
def take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[index] ([len(index), ...]; an index past x's rows gives zeros), where row r of x went to the places
    inverse[r] ([rows of x, W]; past len(index): nowhere), each place listed once."""
    return _gather(x, index)


def _take_rows_fwd(x, index, inverse):
    return _gather(x, index), (index, inverse)


def _take_rows_bwd(saved, g):
    index, inverse = saved
    return _summed(g, inverse, None, g.dtype), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@jax.custom_vjp
def sum_rows(y: jax.Array, inverse: jax.Array, index: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Row r of the result: the rows y[inverse[r, w]] summed over w (weighed by weights[r, w], in float32), in y's
    dtype; inverse [rows, W] (past y's rows: nothing), where index [len(y)] says which r * W + w each row of y
    is (past rows x W: none), each listed once."""
    return _summed(y, inverse, weights, y.dtype)


def _sum_rows_fwd(y, inverse, index, weights):
    # y is kept only for the weights' gradient: unweighed, the backward needs none of the forward's values (a
    # rematerialized caller would otherwise run what made y again)
    kept = y if weights is not None else jnp.zeros((0, *y.shape[1:]), y.dtype)
    return _summed(y, inverse, weights, y.dtype), (kept, inverse, index, weights)


def _sum_rows_bwd(saved, g):
    y, inverse, index, weights = saved
    width = inverse.shape[1]
    dy = _gather(g, index // width).astype(jnp.float32)
    if weights is None:
        return dy.astype(y.dtype), None, None, None
    weight = _gather(weights.reshape(-1), index).astype(jnp.float32)
    dy = dy * weight.reshape(-1, *(1,) * (dy.ndim - 1))
    taken = _gather(y, inverse).astype(jnp.float32)  # [rows, W, ...]
    dweights = jnp.sum(taken * g.astype(jnp.float32)[:, None], axis=tuple(range(2, taken.ndim)))
    return dy.astype(y.dtype), None, None, dweights.astype(weights.dtype)


sum_rows.defvjp(_sum_rows_fwd, _sum_rows_bwd)
