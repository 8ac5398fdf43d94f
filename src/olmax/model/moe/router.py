"""The MoE router and its losses: top-k routing of tokens to experts, capacity drops, the auxiliary losses
(load balancing, router z-loss) with OLMo-core's weighting, the true load metrics, and the selection bias's
update (auxiliary-loss-free balancing).

    logits = x W_router                       float32, [tokens, E]
    scores = softmax(logits) | sigmoid(logits)
    chosen = top_k(scores + score_bias)       the bias moves selection only (auxiliary-loss-free balancing)
    gates  = scores[chosen]                   divided by their sum if normalize_gates

Routing semantics and losses follow OLMo-core's MoE router (olmo_core/nn/moe/router.py, loss.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from olmax.config import MoEConfig
from olmax.parallel.expert import rank_within

# OLMo-core adds this to sigmoid scores so that their sum, which the balancing loss divides by, is never 0.
SIGMOID_EPS = 1e-7


# Routing.

class Routing(NamedTuple):
    logits: jax.Array  # [N, E] float32
    scores: jax.Array  # [N, E] float32
    experts: jax.Array  # [N, k] int32
    gates: jax.Array  # [N, k] float32


def route(cfg: MoEConfig, p: dict, x: jax.Array, key: jax.Array | None = None, top_k=jax.lax.top_k) -> Routing:
    """Top-k routing of tokens x [N, D]. `key` drives routing="random" (required there, unused otherwise);
    `top_k(scores, k) -> (values, indices)` lets a caller run it per batch shard."""
    E, k = cfg.num_experts, cfg.top_k
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    if cfg.gating == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits) + SIGMOID_EPS
    if cfg.routing == "random":
        if key is None:
            raise ValueError("routing='random' needs a PRNG key")
        # `* 0` keeps the router's FLOPs and (zero) gradient in the step, as in OLMo-core.
        scores = scores * 0 + jax.random.uniform(key, scores.shape)
    selection = scores
    if "score_bias" in p:  # selection only: top_k's indices carry no gradient to the bias
        selection = scores + p["score_bias"]
    _, experts = top_k(selection, k)
    if cfg.routing == "uniform":
        experts = (jnp.arange(experts.size, dtype=jnp.int32) % E).reshape(experts.shape)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.normalize_gates:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return Routing(logits, scores, experts.astype(jnp.int32), gates)


def tokens_per_expert(experts: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert [E] (int32); ids equal to num_experts (dropped) are not counted."""
    return jnp.zeros(num_experts + 1, jnp.int32).at[experts.reshape(-1)].add(1)[:num_experts]


# Auxiliary losses (unscaled; `aux_loss` applies the coefficients).

def load_balancing_loss(scores: jax.Array, experts: jax.Array, top_k: int, groups: int = 1) -> jax.Array:
    """(E / k) * sum_e f_e * P_e, f_e = assignments to e per token, P_e = mean score of e (OLMo-core).

    Sigmoid scores must arrive divided by their sum over experts, as OLMo-core does.

    The batch is cut into `groups` equal contiguous parts (the data-parallel shards) and the loss is
    averaged over them: groups=1 counts over the whole batch ("global_batch"), groups=ranks gives
    each rank's own loss, which OLMo-core's default granularity (`local_batch`) averages.
    """
    E = scores.shape[-1]
    scores = scores.reshape(groups, -1, E)
    counts = jax.vmap(tokens_per_expert, in_axes=(0, None))(experts.reshape(groups, -1), E)
    fraction = counts.astype(jnp.float32) / scores.shape[1]
    return (E / top_k) * jnp.mean(jnp.sum(fraction * jnp.mean(scores, axis=1), axis=-1))


def router_z_loss(logits: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def load_metrics(tokens_per_expert: jax.Array, dropped: jax.Array) -> dict:
    """True load from assignment counts [..., E] summed over a whole global batch (any leading axes).

    `load imbalance` (max / mean, OLMo-core's name) and the busiest expert's share can rise while the
    balancing loss falls: that loss weighs counts by mean scores, which a router can keep low.
    """
    counts = tokens_per_expert.astype(jnp.float32)
    total = jnp.sum(counts, axis=-1)
    return {
        "load imbalance": jnp.max(counts, axis=-1) / jnp.mean(counts, axis=-1),
        "busiest expert share": jnp.max(counts, axis=-1) / total,
        "dropped rate": dropped.astype(jnp.float32) / total,
    }


def update_score_bias(score_bias: jax.Array, tokens_per_expert: jax.Array, rate: float) -> jax.Array:
    """Auxiliary-loss-free balancing (DeepSeek-V3, arXiv:2412.19437; OLMo-core's `bias_gamma`).

    Called after the optimizer update (the MoE sublayer's `after_update` training hook) with the step's counts summed over the global
    batch: under-loaded experts' bias rises by `rate`, over-loaded ones' falls. The bias lives in the
    params (`score_bias`, so checkpoints hold it) but is no trainable weight: it only moves the top-k
    selection, so its gradient is 0, and the optimizer must leave it alone (no weight decay).
    """
    counts = tokens_per_expert.astype(jnp.float32)
    return score_bias + rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)


# Capacity (dropping) mode.

def expert_capacity(cfg: MoEConfig, tokens: int) -> int:
    """Assignments an expert takes from one rank's `tokens`: OLMo-core's rule (rounded up to a multiple of 8)."""
    return 8 * math.ceil(int(cfg.capacity_factor * cfg.top_k * tokens / cfg.num_experts) / 8)


def drop_over_capacity(cfg: MoEConfig, experts: jax.Array, groups: int) -> jax.Array:
    """experts [N, k] with assignments beyond each rank's capacity set to E (dropped): in each of `groups`
    contiguous shards, an expert keeps its first `capacity` assignments in (token, slot) order."""
    per_group = experts.reshape(groups, -1)
    capacity = expert_capacity(cfg, experts.shape[0] // groups)
    rank, _ = jax.vmap(rank_within, in_axes=(0, None))(per_group, cfg.num_experts)
    return jnp.where(rank < capacity, per_group, cfg.num_experts).reshape(experts.shape)


def aux_loss(cfg: MoEConfig, aux: dict, n_layers: int, tokens: int, n_labels: jax.Array) -> tuple[jax.Array, dict]:
    """The router losses one micro-batch adds to the training loss, and their logged parts, from its aux
    stacked over the MoE layers (each value a mean over the micro-batch's `tokens` tokens).

    OLMo-core's semantics (olmo_core/nn/moe/moe.py, loss.py, and its train module): each layer's loss is
    weighted by coefficient / n_layers (`scale_loss_by_num_layers`, n_layers counting every layer of the
    model), and is a sum over tokens divided by the label count of the whole batch (`loss_div_factor`,
    B x (T - 1) without masking), as the CE loss is, not by the token count. Summed over the micro-batches
    of a step this is the batch's loss, logged as `load balancing loss` and `router Z loss`.
    """
    scale = tokens / (n_layers * n_labels)
    lb = cfg.load_balancing_loss * scale * jnp.sum(aux["load_balancing_loss"])
    z = cfg.router_z_loss * scale * jnp.sum(aux["router_z_loss"])
    return lb + z, {"load balancing loss": lb, "router Z loss": z}
