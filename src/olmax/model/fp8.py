"""Float8 matmuls for training, with per-tensor current scaling.

Each operand is divided by a scale from its own amax of this step (no history) and rounded to float8:
inputs and weights to e4m3 (more precision), the gradient flowing back to e5m2 (more range). The dots
take the float8 operands themselves, accumulate in float32 and multiply the scales back, so XLA's GPU
compiler emits float8 GEMMs (Hopper and later); other platforms compute the same rounded values in a
wider type. Both products of the backward pass reuse the forward's float8 operands, which are also
what the backward keeps: 1 byte an element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORWARD, BACKWARD = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(x / scale in float8 `dtype`, float32 scale): one scale for the tensor, its amax over the dtype's largest."""
    largest = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype), scale


def _dot(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], dtype) -> jax.Array:
    """(a_q, a_scale) @ (b_q, b_scale), float8 operands accumulated in float32, in `dtype`."""
    (a_q, a_scale), (b_q, b_scale) = a, b
    return (jax.lax.dot(a_q, b_q, preferred_element_type=jnp.float32) * (a_scale * b_scale)).astype(dtype)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [N, K] @ w [K, F] (one dtype) through float8."""
    return _forward(x, w)[0]


def _forward(x, w):
    xq, wq = quantize(x, FORWARD), quantize(w, FORWARD)
    return _dot(xq, wq, x.dtype), (xq, wq)


def _backward(residuals, g):  # g has the dtype of x and w
    (x_q, x_scale), (w_q, w_scale) = residuals
    gq = quantize(g, BACKWARD)
    return _dot(gq, (w_q.T, w_scale), g.dtype), _dot((x_q.T, x_scale), gq, g.dtype)


matmul.defvjp(_forward, _backward)
