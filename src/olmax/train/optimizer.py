"""The recipe's optimizer: skip-step around (clip -> AdamW with decoupled decay), LR set per step.

The LR is a function of the trainer step, not of Adam's count, so the schedule
keeps advancing through skipped steps while Adam's count does not (OLMo-core's
SkipStepOptimizer). It is injected into the optimizer state before every update.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from olmax.config import OptimConfig, ScheduleConfig


def lr_at(cfg: ScheduleConfig, peak: float, total_steps: int, step: jax.Array) -> jax.Array:
    """LR of 1-based trainer step `step` (OLMo-core's schedulers: warmup from 0, then decay to final x peak)."""
    step = jnp.asarray(step, jnp.float32)
    warmup = cfg.warmup_steps
    horizon = cfg.horizon_steps or total_steps
    final = peak * cfg.final_lr_fraction
    progress = jnp.clip((step - warmup) / max(horizon - warmup, 1), 0.0, 1.0)
    if cfg.kind == "cosine":
        decayed = final + (peak - final) * (1 + jnp.cos(math.pi * progress)) / 2
    elif cfg.kind == "linear":
        decayed = peak - (peak - final) * progress
    elif cfg.kind == "wsd":
        into_decay = jnp.clip((step - (horizon - cfg.decay_steps)) / cfg.decay_steps, 0.0, 1.0)
        decayed = peak - (peak - final) * into_decay
    else:
        decayed = jnp.asarray(peak, jnp.float32)
    if warmup == 0:
        return decayed
    return jnp.where(step < warmup, peak * step / warmup, decayed)


def decay_mask(params: Any, no_decay: list[str]) -> Any:
    """True for parameters that get weight decay: all but those whose path starts with a no_decay entry."""
    patterns = [re.compile(rf"^{re.escape(p)}(/|$)") for p in no_decay]

    def decayed(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return not any(p.match(name) for p in patterns)

    return jax.tree_util.tree_map_with_path(decayed, params)


class SkipStepState(NamedTuple):
    inner: Any
    losses: jax.Array  # ring buffer of previous CE losses
    grad_norms: jax.Array  # ring buffer of previous pre-clip grad norms
    filled: jax.Array  # how many ring slots hold values
    next_slot: jax.Array
    grad_norm: jax.Array  # pre-clip norm of the latest update
    skipped: jax.Array  # whether the latest update was skipped


def _spike(x, history, filled, sigma):
    valid = jnp.arange(history.shape[0]) < filled
    n = jnp.maximum(filled, 1).astype(jnp.float32)
    mean = jnp.where(valid, history, 0.0).sum() / n
    var = jnp.where(valid, (history - mean) ** 2, 0.0).sum() / jnp.maximum(n - 1, 1)
    return x - mean > sigma * jnp.sqrt(var)


def skip_step(inner: optax.GradientTransformation, window: int, min_values: int, sigma: float,
              enabled: bool = True) -> optax.GradientTransformationExtraArgs:
    """Skip the update when the CE loss or the pre-clip grad norm spikes (OLMo-core's SkipStepOptimizer).

    The history holds up to `window` previous values; once the current value plus
    the history make `min_values`, a value more than `sigma` (Bessel) standard
    deviations above the mean of the previous values skips the step. A non-finite
    loss or norm is always skipped and is not recorded: one NaN in the history
    would otherwise fail every check for the next `window` steps. A skipped step
    leaves the inner state (moments, Adam's count) untouched and applies no update.
    """

    def init(params):
        zeros = jnp.zeros((window,), jnp.float32)
        return SkipStepState(inner.init(params), zeros, zeros, jnp.int32(0), jnp.int32(0),
                             jnp.float32(0), jnp.bool_(False))

    def update(updates, state, params=None, *, loss, grad_norm=None, **extra):
        loss = jnp.asarray(loss, jnp.float32)
        norm = jnp.asarray(optax.tree.norm(updates) if grad_norm is None else grad_norm, jnp.float32)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm)
        checked = state.filled + 1 >= min_values
        spike = _spike(loss, state.losses, state.filled, sigma) | _spike(norm, state.grad_norms, state.filled, sigma)
        skip = ~finite | (checked & spike) if enabled else jnp.bool_(False)

        new_updates, new_inner = inner.update(updates, state.inner, params, grad_norm=norm)
        new_updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
        new_inner = jax.tree.map(lambda new, old: jnp.where(skip, old, new), new_inner, state.inner)

        record = finite if enabled else jnp.bool_(True)
        slot = state.next_slot
        losses = jnp.where(record, state.losses.at[slot].set(loss), state.losses)
        norms = jnp.where(record, state.grad_norms.at[slot].set(norm), state.grad_norms)
        filled = jnp.where(record, jnp.minimum(state.filled + 1, window), state.filled)
        next_slot = jnp.where(record, (slot + 1) % window, slot)
        return new_updates, SkipStepState(new_inner, losses, norms, filled, next_slot, norm, skip)

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm with the norm given (`grad_norm`), not recomputed from the updates: the
    updates may be ZeRO-1 shards, whose norm would be summed in another order (train/zero.py)."""

    def update(updates, state, params=None, *, grad_norm, **extra):
        within = grad_norm < max_norm

        def clip(t):
            return jax.lax.select(within, t, (t / grad_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def build_optimizer(cfg: OptimConfig, params: Any) -> optax.GradientTransformationExtraArgs:
    """Skip-step around (clip -> AdamW); `update(..., loss=CE loss, grad_norm=None)`: the pre-clip global
    norm of the gradients, computed from them when not given."""
    moment_dtype = jnp.dtype(cfg.moment_dtype)

    def clipped_adamw(learning_rate):
        clip = clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip else optax.identity()
        adamw = optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            mask=decay_mask(params, cfg.no_decay), mu_dtype=moment_dtype)
        return optax.chain(clip, adamw)

    inner = optax.inject_hyperparams(clipped_adamw)(learning_rate=0.0)
    s = cfg.skip_step
    return skip_step(inner, s.window, s.min_values, s.sigma, enabled=s.enabled)


def with_lr(opt_state: SkipStepState, lr: jax.Array) -> SkipStepState:
    hyper = dict(opt_state.inner.hyperparams, learning_rate=jnp.asarray(lr, jnp.float32))
    return opt_state._replace(inner=opt_state.inner._replace(hyperparams=hyper))


def adam_count(opt_state: SkipStepState) -> jax.Array:
    """Adam's own step count (the bias-correction t), which skipped steps do not advance."""
    return opt_state.inner.inner_state[1][0].count
