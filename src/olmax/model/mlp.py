"""The SwiGLU MLP, written once (the dense sublayer, the experts and a shared expert all run it), and the
dense MLP sublayer with its training hooks (none: a dense MLP adds no loss, metric or state).

An MLP sublayer kind is `mlp(p, h) -> (out, aux)` plus training hooks the train step calls without knowing
the kind (olmax.model.moe.sublayer has the other kind):
    loss(aux, tokens, n_labels) -> (loss, logged)   what a micro-batch's aux adds to the loss, and its logs
    metrics(logged) -> metrics                       the step's metrics from the logs summed over micro-batches
    after_update(params, old, logged) -> params      state moved outside the gradient after the update
    key(step, micro) -> key or None                  the sublayer's PRNG key for a micro-batch of a step
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def swiglu(x: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array, matmul: Callable) -> jax.Array:
    """w2(silu(w1 x) * w3 x); `matmul(x, w, name)` is one projection, `name` its remat checkpoint name."""
    gate = jax.nn.silu(matmul(x, w1, "mlpwi_0"))
    up = matmul(x, w3, "mlpwi_1")
    return matmul(gate * up, w2, "mlpwo")


def dense_mlp(p: dict, h: jax.Array, dense: Callable) -> tuple[jax.Array, dict]:
    """The dense sublayer: SwiGLU with the block's projection matmul `dense`; no aux."""
    return swiglu(h, p["w1"], p["w3"], p["w2"], dense), {}


class DenseTraining:
    """The dense sublayer's training hooks: no auxiliary loss, metrics, state or randomness."""

    def loss(self, aux: dict, tokens: int, n_labels: jax.Array) -> tuple[jax.Array, dict]:
        return jnp.float32(0.0), {}

    def metrics(self, logged: dict) -> dict:
        return logged

    def after_update(self, params: dict, old: dict, logged: dict) -> dict:
        return params

    def key(self, step: jax.Array, micro: jax.Array) -> None:
        return None
