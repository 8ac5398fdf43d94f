"""Float8 matmuls for training: per-tensor current scaling (impl.fp8=true) and MXFP8 (impl.fp8=mxfp8).

Per tensor, each operand is divided by a scale from its own amax of this step (no history) and rounded to float8:
inputs and weights to e4m3 (more precision), the gradient flowing back to e5m2 (more range). The dots
take the float8 operands themselves, accumulate in float32 and multiply the scales back, so XLA's GPU
compiler emits float8 GEMMs (Hopper and later); other platforms compute the same rounded values in a
wider type. Both products of the backward pass reuse the forward's float8 operands, which are also
what the backward keeps: 1 byte an element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from olmax.config import ConfigError
from olmax.parallel.mesh import platform

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


# MXFP8 (OCP microscaling; impl.fp8=mxfp8): every run of 32 consecutive values along a product's contraction
# is rounded to e4m3 under its own power-of-two (e8m0) scale, the smallest that holds the run's amax. The
# forward and both gradient products quantize their two operands along the dimension they contract, as
# jax.nn.scaled_dot_general does (the gradient in e4m3 too); on a GPU each product is that function with
# JAX's mxfp8 config (cuDNN's block-scaled GEMM on Blackwell), elsewhere the same rounded values are
# multiplied in the operands' own wider type. The backward keeps x and w as they are, as JAX's does.
MX_BLOCK = 32
MX_VALUES, MX_SCALES = jnp.float8_e4m3fn, jnp.float8_e8m0fnu


def check_mxfp8(layout) -> None:
    """Refuse impl.fp8=mxfp8 where it cannot run as MXFP8: TPUs (JAX has no MXFP8 matmul for them) and GPUs
    below compute capability 10 (cuDNN's block-scaled GEMM is Blackwell's). CPUs emulate it."""
    where = platform(layout)
    if where == "tpu":
        raise ConfigError("impl.fp8=mxfp8 needs a GPU of compute capability 10.x (Blackwell) or a CPU (emulated), "
                          "not a TPU; set impl.fp8 to true or false")
    if where == "gpu":
        device = layout.mesh.devices.flat[0] if layout is not None else jax.devices()[0]
        capability = str(getattr(device, "compute_capability", "0"))
        if int(capability.split(".")[0]) < 10:
            raise ConfigError(f"impl.fp8=mxfp8 needs a GPU of compute capability 10.x (Blackwell), not "
                              f"{device.device_kind} ({capability}); set impl.fp8 to true or false")


def mx_quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """(x / its block scales in e4m3, the e8m0 scales): blocks of MX_BLOCK along `axis`, which the scales keep
    (its size divided by MX_BLOCK). The scale is the power of two at or above the block's amax over e4m3's
    largest (2^-127 for a block of zeros), rounded up as JAX's mxfp8 quantization rounds it."""
    x = jnp.moveaxis(x, axis, -1)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    largest = float(jnp.finfo(MX_VALUES).max)
    ratio = (jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / jnp.asarray(largest, x.dtype)).astype(jnp.float32)
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = jnp.clip(jnp.where(mantissa == 0.5, exponent - 1, exponent), -127, 127)
    exponent = jnp.where(ratio == 0, -127, exponent)
    # times 2^-exponent rather than over 2^exponent (the same, exactly): 2^-127 is a float32 subnormal, which
    # XLA flushes to 0, and a block of zeros would become NaN
    values = jnp.clip(blocks * jnp.ldexp(jnp.ones((), x.dtype), -exponent), -largest, largest).astype(MX_VALUES)
    scales = jax.lax.bitcast_convert_type((exponent[..., 0] + 127).astype(jnp.uint8), MX_SCALES)
    return jnp.moveaxis(values.reshape(x.shape), -1, axis), jnp.moveaxis(scales, -1, axis)


def mx_round(x: jax.Array, axis: int) -> jax.Array:
    """x's values after MXFP8 quantization along `axis`, in x's dtype (exact: e4m3 times a power of two)."""
    values, scales = mx_quantize(x, axis)
    return (values.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), MX_BLOCK, axis=axis)).astype(x.dtype)


def mx_dot_general(a: jax.Array, b: jax.Array, dimension_numbers, platform: str, out_dtype=jnp.float32) -> jax.Array:
    """lax.dot_general of a and b (one contracting dimension each, a multiple of MX_BLOCK) in MXFP8."""
    if platform == "gpu":
        return jax.nn.scaled_dot_general(a, b, dimension_numbers, preferred_element_type=out_dtype,
                                         configs=[jax.nn.get_scaled_dot_general_config("mxfp8")] * 3)
    ((ca,), (cb,)), _ = dimension_numbers
    return jax.lax.dot_general(mx_round(a, ca), mx_round(b, cb), dimension_numbers, preferred_element_type=out_dtype)


_NN, _NT, _TN = ((((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def mx_matmul(x: jax.Array, w: jax.Array, platform: str) -> jax.Array:
    """x [N, K] @ w [K, F] (one dtype) in MXFP8 on `platform` ('gpu': cuDNN; else emulated); N, K and F
    multiples of MX_BLOCK (the weight gradient contracts N)."""
    return mx_dot_general(x, w, _NN, platform, x.dtype)


def _mx_forward(x, w, platform):
    return mx_matmul(x, w, platform), (x, w)


def _mx_backward(platform, residuals, g):
    x, w = residuals
    return mx_dot_general(g, w, _NT, platform, g.dtype), mx_dot_general(x, g, _TN, platform, g.dtype)


mx_matmul.defvjp(_mx_forward, _mx_backward)
