"""Float8 matmuls for training: per-tensor current scaling (impl.fp8=true) and MXFP8 (impl.fp8=mxfp8).

Per tensor, each operand is divided by a scale from its own amax of this step (no history) and rounded to float8:
inputs and weights to e4m3 (more precision), the gradient flowing back to e5m2 (more range). The dots
take the float8 operands themselves, accumulate in float32 and multiply the scales back, so XLA's GPU
compiler emits float8 GEMMs (Hopper and later); other platforms compute the same rounded values in a
wider type. Both products of the backward pass reuse the forward's float8 operands, which are also
what the backward keeps: 1 byte an element.
"""

from __future__ import annotations

import dataclasses
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
# jax.nn.scaled_dot_general does (the gradient in e4m3 too); on a GPU each product is jax.nn.scaled_matmul on
# the quantized operands (cuDNN's block-scaled GEMM on Blackwell; the experts under impl.moe.dispatch=grouped
# run olmax's MXFP8 grouped kernels on the same values, olmax.model.moe.kernels.mxfp8), elsewhere the same rounded
# values are multiplied in float32. What the backward keeps of a projection is its input as the forward quantized it
# (1 byte an element and a scale per 32), from which the weight gradient is made (dequantized: exact, then
# quantized along the tokens), and the weight as it came in (an FSDP shard): the whole weight is gathered in
# the compute dtype and quantized again in the backward, not kept between the passes.
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


def mx_dequantize(quantized: tuple[jax.Array, jax.Array], axis: int, dtype=jnp.float32) -> jax.Array:
    """The values mx_quantize(x, axis) stands for, in `dtype` (exact in float32 and bfloat16)."""
    values, scales = quantized
    return (values.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), MX_BLOCK, axis=axis)).astype(dtype)


def mx_round(x: jax.Array, axis: int) -> jax.Array:
    """x's values after MXFP8 quantization along `axis`, in x's dtype (exact: e4m3 times a power of two)."""
    return mx_dequantize(mx_quantize(x, axis), axis, x.dtype)


def mx_dot(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], dimension_numbers, platform: str,
           out_dtype=jnp.float32) -> jax.Array:
    """lax.dot_general of two 2-D MXFP8 operands, each (values, scales) quantized along its contracting dimension
    (mx_quantize), accumulated in float32, in `out_dtype`: on a GPU jax.nn.scaled_matmul (cuDNN), elsewhere the
    product of the dequantized values."""
    ((ca,), (cb,)), _ = dimension_numbers
    if platform == "gpu":  # [1, M, K] x [1, N, K]: the contraction last
        lhs, rhs = ([jnp.moveaxis(t, c, 1)[None] for t in q] for q, c in ((a, ca), (b, cb)))
        return jax.nn.scaled_matmul(lhs[0], rhs[0], lhs[1], rhs[1], preferred_element_type=out_dtype)[0]
    return jax.lax.dot_general(mx_dequantize(a, ca), mx_dequantize(b, cb), dimension_numbers,
                               preferred_element_type=jnp.float32).astype(out_dtype)


def mx_dot_general(a: jax.Array, b, dimension_numbers, platform: str, out_dtype=jnp.float32) -> jax.Array:
    """lax.dot_general of a and b (one contracting dimension each, a multiple of MX_BLOCK) in MXFP8; b may come
    quantized already, as mx_quantize's pair along its contracting dimension."""
    ((ca,), (cb,)), _ = dimension_numbers
    b = b if isinstance(b, tuple) else mx_quantize(b, cb)
    return mx_dot(mx_quantize(a, ca), b, dimension_numbers, platform, out_dtype)


@dataclasses.dataclass(frozen=True)
class MXDot:
    """The experts' grouped matmul in MXFP8 on `platform` (see olmax.model.moe.block_loop): `dot(a, b,
    dimension_numbers)` in float32, and `weight(w, axis)`, the expert weights quantized along `axis` once for all
    their blocks."""

    platform: str

    def __call__(self, a, b, dimension_numbers) -> jax.Array:
        return mx_dot_general(a, b, dimension_numbers, self.platform)

    @staticmethod
    def weight(w: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
        return mx_quantize(w, axis)


_NN, _NT, _TN = ((((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ())))


def _whole(w: jax.Array, whole) -> jax.Array:
    return w if whole is None else jax.lax.with_sharding_constraint(w, whole)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def mx_matmul(x: jax.Array, w: jax.Array, platform: str, whole=None) -> jax.Array:
    """x [N, K] @ w [K, F] (one dtype) in MXFP8 on `platform` ('gpu': cuDNN; else emulated); N, K and F
    multiples of MX_BLOCK (the weight gradient contracts N). `whole` (a sharding, or None for w as it is): where
    w is gathered before it is quantized, in w's dtype, in the forward and again in the backward; a GPU must
    not gather the quantized weight (NCCL has no e8m0 type)."""
    return _mx_forward(x, w, platform, whole)[0]


def _mx_forward(x, w, platform, whole):
    x_q = mx_quantize(x, 1)
    return mx_dot(x_q, mx_quantize(_whole(w, whole), 0), _NN, platform, x.dtype), (x_q, w)


def _mx_backward(platform, whole, residuals, g):
    x_q, w = residuals
    dx = mx_dot(mx_quantize(g, 1), mx_quantize(_whole(w, whole), 1), _NT, platform, g.dtype)
    x = mx_dequantize(x_q, 1, g.dtype)
    dw = mx_dot(mx_quantize(x, 0), mx_quantize(g, 0), _TN, platform, g.dtype)
    return dx, dw.astype(w.dtype)


mx_matmul.defvjp(_mx_forward, _mx_backward)
