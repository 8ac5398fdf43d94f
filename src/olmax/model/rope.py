"""Rotate-half RoPE per layer kind: default and YaRN, computed as transformers computes them.

Tables are numpy float32, constants of the compiled step: inside the trace, XLA's CPU backend fuses the
cos/sin into every consumer and recomputes them per element (about 0.7 s of a 6.5 s benchmark step).
The angles are float32 products of float32 positions and correctly rounded float32 inverse
frequencies, as torch (OLMo-core, HF) computes them; XLA's float32 pow is 1 ulp off, an angle error that
grows with position (1.7e-4 in logits at 8192 tokens).

YaRN (Peng et al. 2023, arXiv:2309.00071; transformers' `_compute_yarn_parameters`): frequencies that
rotate fewer than `beta_slow` times over the original context are interpolated (divided by `factor`),
those above `beta_fast` kept, a linear ramp between; cos and sin are scaled by the attention factor
(0.1 ln(factor) + 1 unless given).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [head_dim / 2], cos/sin scale)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    base_powers = np.power(np.float64(rope.theta), exponents.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / base_powers
    if rope.type == "default":
        return inv_freq, 1.0
    factor = rope.factor
    low, high = (_correction_dim(rotations, head_dim, rope) for rotations in (rope.beta_fast, rope.beta_slow))
    low, high = max(math.floor(low), 0), min(math.ceil(high), head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1) - ramp.astype(np.float32)
    interpolated = np.float32(1.0) / (np.float32(factor) * base_powers)
    inv_freq = interpolated * (np.float32(1) - keep) + inv_freq * keep
    scale = rope.attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq.astype(np.float32), scale


def _correction_dim(rotations: float, head_dim: int, rope: RopeConfig) -> float:
    """The dimension whose frequency turns `rotations` times over the original context."""
    context = rope.original_max_position_embeddings
    return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))


def tables(rope: RopeConfig, head_dim: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [*positions.shape, head_dim] in float32."""
    inv_freq, scale = inverse_frequencies(rope, head_dim)
    angles = positions.astype(np.float32)[..., None] * inv_freq
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos, sin


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE in float32 on x [B, T, heads, head_dim]; cos/sin [T, head_dim] or [B, T, head_dim]."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).astype(x.dtype)
