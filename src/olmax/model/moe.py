"""Mixture-of-experts MLP: a router sends each token to top_k of E SwiGLU experts.

    logits = x W_router                       float32, [tokens, E]
    scores = softmax(logits) | sigmoid(logits)
    chosen = top_k(scores + score_bias)       the bias moves selection only (auxiliary-loss-free balancing)
    gates  = scores[chosen]                   divided by their sum if normalize_gates
    out    = sum_k gates_k * expert_{chosen_k}(x)
           = (shared(x) + k * out) / (k + 1)  with a shared expert (OLMo-core's weighting)
    expert(x) = w2(silu(w1 x) * w3 x)

The experts run dropless by default: assignments are sorted by expert, each expert's rows
padded to a block multiple, and loops over the used blocks multiply each block by its expert's
weights (`gmm`). Work is the routed rows plus under one block per expert, whatever E;
a dense expansion (every expert on every token, or XLA:CPU's lowering of `ragged_dot`) grows
linearly with E. With several devices the same computation runs per device inside
`olmax.parallel.expert`, experts resident on the `expert` mesh axis and tokens exchanged.

Routing semantics and losses follow OLMo-core's MoE router (olmo_core/nn/moe/router.py, loss.py).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from olmax.config import MoEConfig
from olmax.parallel import expert as expert_parallel
from olmax.parallel.expert import rank_within

# OLMo-core adds this to sigmoid scores so that their sum, which the balancing loss divides by, is never 0.
SIGMOID_EPS = 1e-7


# Parameters of one layer. Expert weights keep only the `experts` axis sharded (on the `expert`
# mesh axis): their other dimensions are never sharded over data/fsdp, so nothing gathers them.
def param_axes(cfg: MoEConfig) -> dict:
    axes = {
        "router": ("embed", "router"),
        "w1": ("experts", "expert_embed", "expert_mlp"),
        "w3": ("experts", "expert_embed", "expert_mlp"),
        "w2": ("experts", "expert_mlp", "expert_embed"),
    }
    if cfg.shared_expert_hidden:
        axes |= {"shared_w1": ("embed", "mlp"), "shared_w3": ("embed", "mlp"), "shared_w2": ("mlp", "embed")}
    if cfg.bias_update_rate:
        axes["score_bias"] = ("router",)
    return axes


def param_shapes(cfg: MoEConfig, d_model: int) -> dict:
    E, D, F = cfg.num_experts, d_model, cfg.expert_hidden
    shapes = {"router": (D, E), "w1": (E, D, F), "w3": (E, D, F), "w2": (E, F, D)}
    if cfg.shared_expert_hidden:
        S = cfg.shared_expert_hidden
        shapes |= {"shared_w1": (D, S), "shared_w3": (D, S), "shared_w2": (S, D)}
    if cfg.bias_update_rate:
        shapes["score_bias"] = (E,)
    return shapes


def init_params(cfg: MoEConfig, d_model: int, key: jax.Array, std: float = 0.02) -> dict:
    """OLMo-core's init: every matrix ~ N(0, std) truncated at +-3 std; the selection bias starts at 0."""
    shapes = param_shapes(cfg, d_model)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    return {
        name: jnp.zeros(shape) if name == "score_bias"
        else std * jax.random.truncated_normal(keys[name], -3.0, 3.0, shape, jnp.float32)
        for name, shape in shapes.items()
    }


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


# Auxiliary losses (unscaled; the train step multiplies by the coefficients).

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

    Called by the train step after the optimizer update with the step's counts summed over the global
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


# Grouped matmul over blocks.

def auto_block_size(expected_rows: int, groups: int) -> int:
    """A power of two near a quarter of the mean rows per group, in [16, 128]: a group's last, partly
    filled block wastes half a block on average (about an eighth of the work), and smaller blocks make
    smaller, less efficient matmuls."""
    target = max(expected_rows // (4 * groups), 1)
    return min(max(1 << (target.bit_length() - 1), 16), 128)


def _vary_like(a, *like):
    # Inside shard_map, `a` made to vary over the mesh axes that `like` varies over (a no-op outside):
    # a loop carry must keep its type, and a custom_vjp's gradient must match its input's. The add's
    # transpose sums the gradient over those axes (over data-parallel replicas, for expert weights).
    return a + sum(jnp.zeros_like(b, a.dtype, shape=()) for b in like)


def _zeros(shape, dtype, *like):
    return _vary_like(jnp.zeros(shape, dtype), *like)


def _grouped_loop(x, w, block_starts, block: int, contract_w: int):
    def group(g, out):
        wg = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)  # one copy per group, not per block

        def one_block(b, out):
            xb = jax.lax.dynamic_slice_in_dim(x, b * block, block)
            yb = jax.lax.dot_general(xb, wg, (((1,), (contract_w,)), ((), ())), preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(out, yb.astype(out.dtype), b * block, 0)

        return jax.lax.fori_loop(block_starts[g], block_starts[g + 1], one_block, out)

    return jax.lax.fori_loop(0, w.shape[0], group, _zeros((x.shape[0], w.shape[2 - contract_w]), x.dtype, x, w))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(x: jax.Array, w: jax.Array, block_starts: jax.Array, block: int) -> jax.Array:
    """Grouped matmul over blocks of `block` rows: blocks block_starts[g] to block_starts[g + 1] - 1 of
    x [NB * block, D] times w[g] ([G, D, F]); rows after the last group's blocks are 0 and cost nothing
    (while loops over the used blocks only). The gradient runs the same loops: a while loop cannot be
    differentiated, and a scan's gradient would add a full [G, D, F] buffer per block."""
    return _grouped_loop(x, w, block_starts, block, contract_w=0)


def _gmm_fwd(x, w, block_starts, block):
    return gmm(x, w, block_starts, block), (x, w, block_starts)


def _gmm_bwd(block, res, dy):
    x, w, block_starts = res
    dx = _grouped_loop(dy, w, block_starts, block, contract_w=1)

    def group(g, dw):
        def one_block(b, acc):
            xb = jax.lax.dynamic_slice_in_dim(x, b * block, block)
            dyb = jax.lax.dynamic_slice_in_dim(dy, b * block, block)
            return acc + jax.lax.dot_general(xb, dyb, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        zeros = _zeros(w.shape[1:], jnp.float32, x, dy)
        acc = jax.lax.fori_loop(block_starts[g], block_starts[g + 1], one_block, zeros)
        return jax.lax.dynamic_update_index_in_dim(dw, acc, g, 0)

    dw = jax.lax.fori_loop(0, w.shape[0], group, _zeros(w.shape, jnp.float32, x, dy))
    return dx, dw.astype(w.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _swiglu_blocks(x, groups, w1, w3, w2, block):
    M, k = groups.shape
    G, R = w1.shape[0], groups.size
    flat = groups.reshape(-1)
    rank, counts = rank_within(flat, G + 1)
    blocks = -(-counts[:G] // block)
    block_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks)])
    # Static bound: at most min(k, G) real rows per row of x, and each group wastes under one block.
    n_blocks = -(-(M * min(k, G) + G * (block - 1)) // block)
    slot = jnp.where(flat < G, block_starts[jnp.minimum(flat, G - 1)] * block + rank, n_blocks * block)
    source = jnp.full(n_blocks * block, R, jnp.int32).at[slot].set(jnp.arange(R, dtype=jnp.int32), mode="drop")
    xp = jnp.take(x, source // k, axis=0, mode="fill", fill_value=0)
    w1, w3, w2 = (_vary_like(w.astype(x.dtype), x) for w in (w1, w3, w2))
    gate = jax.nn.silu(checkpoint_name(gmm(xp, w1, block_starts, block), "mlpwi_0"))
    up = checkpoint_name(gmm(xp, w3, block_starts, block), "mlpwi_1")
    y = checkpoint_name(gmm(gate * up, w2, block_starts, block), "mlpwo")
    return jnp.take(y, slot, axis=0, mode="fill", fill_value=0).reshape(M, k, -1)


def _swiglu_ragged(x, groups, w1, w3, w2):
    M, k = groups.shape
    G = w1.shape[0]
    flat = groups.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # dropped ids (G) sort last, outside every group
    counts = jnp.zeros(G + 1, jnp.int32).at[flat].add(1)[:G]
    xs = jnp.take(x, order // k, axis=0)
    gate = jax.nn.silu(checkpoint_name(jax.lax.ragged_dot(xs, w1.astype(x.dtype), counts), "mlpwi_0"))
    up = checkpoint_name(jax.lax.ragged_dot(xs, w3.astype(x.dtype), counts), "mlpwi_1")
    y = checkpoint_name(jax.lax.ragged_dot(gate * up, w2.astype(x.dtype), counts), "mlpwo")
    y = jnp.where((flat[order] < G)[:, None], y, 0)
    return jnp.zeros_like(y).at[order].set(y).reshape(M, k, -1)


def grouped_swiglu(x: jax.Array, groups: jax.Array, w1, w3, w2, *, dispatch: str, block: int) -> jax.Array:
    """Each row's experts on it: x [M, D], groups [M, k] ids in [0, G] (G = none) -> [M, k, D].

    w1, w3 [G, D, F] and w2 [G, F, D] are cast to x's dtype; rows with id G give 0."""
    if dispatch == "ragged_dot":
        return _swiglu_ragged(x, groups, w1, w3, w2)
    return _swiglu_blocks(x, groups, w1, w3, w2, block)


def combine(y: jax.Array, gates: jax.Array) -> jax.Array:
    """sum_k gates[n, k] * y[n, k, :], gates in float32."""
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), gates).astype(y.dtype)


# The sublayer.

def moe_mlp(
    cfg: MoEConfig,
    p: dict,
    x: jax.Array,
    *,
    key: jax.Array | None = None,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    dispatch: str = "blocks",
    block_size: int | None = None,
    ep_capacity: float | None = None,
) -> tuple[jax.Array, dict]:
    """One MoE layer on hidden states x [B, T, D] -> (out [B, T, D], aux); `key` drives routing="random".
    `dispatch` ("blocks" or "ragged_dot") and `block_size` (None = auto) choose how the experts run;
    `ep_capacity` (None: dropless) bounds what a device sends each peer of its expert group (see
    olmax.parallel.expert), dropping, and counting, assignments beyond it.

    aux (one layer's values; the model stacks them over layers):
      load_balancing_loss  f32 []   unscaled, see `load_balancing_loss`
      router_z_loss        f32 []   unscaled, mean(logsumexp(logits)^2)
      tokens_per_expert    i32 [E]  assignments routed to each expert (before any drop)
      dropped_tokens       i32 []   assignments over capacity (0 when dropless)
    With a mesh, tokens stay sharded over `batch_axes` and experts over its `expert` axis; `batch_axes`
    must then include `expert` when that axis is larger than 1. The batch's data-parallel shards
    (the product of the batch axes) are the ranks of micro_batch granularity and capacity.
    """
    B, T, D = x.shape
    tokens = x.reshape(B * T, D)
    ranks = expert_parallel.batch_shards(mesh, batch_axes) if mesh is not None else 1
    top_k = jax.lax.top_k
    if mesh is not None:
        def top_k(scores, k):
            return expert_parallel.per_shard(lambda s: jax.lax.top_k(s, k), mesh, batch_axes, scores)
    r = route(cfg, p, tokens, key, top_k)
    lb_groups = ranks if cfg.load_balancing_granularity == "micro_batch" else 1
    lb_scores = r.scores / jnp.sum(r.scores, axis=-1, keepdims=True) if cfg.gating == "sigmoid" else r.scores
    aux = {
        "load_balancing_loss": load_balancing_loss(lb_scores, r.experts, cfg.top_k, lb_groups),
        "router_z_loss": router_z_loss(r.logits),
        "tokens_per_expert": tokens_per_expert(r.experts, cfg.num_experts),
    }
    experts = r.experts
    if cfg.capacity_factor is not None:
        experts = drop_over_capacity(cfg, experts, ranks)
    ep = mesh.shape.get(expert_parallel.EXPERT_AXIS, 1) if mesh is not None else 1
    capacity = None
    if ep > 1 and ep_capacity is not None:
        capacity = expert_parallel.peer_capacity(tokens.shape[0] // ranks, cfg.top_k, ep, ep_capacity)
        experts = expert_parallel.drop_over_peer_capacity(experts, cfg.num_experts, ep, ranks, capacity)
    aux["dropped_tokens"] = jnp.sum(experts == cfg.num_experts, dtype=jnp.int32)

    def run_experts(x_local, groups, gates, w1, w3, w2, expected_rows):
        block = block_size or auto_block_size(expected_rows, w1.shape[0])
        return combine(grouped_swiglu(x_local, groups, w1, w3, w2, dispatch=dispatch, block=block), gates)

    weights = (p["w1"], p["w3"], p["w2"])
    if mesh is None:
        y = run_experts(tokens, experts, r.gates, *weights, experts.size)
    else:
        y = expert_parallel.routed_experts(run_experts, tokens, experts, r.gates, weights, mesh, batch_axes,
                                           capacity)
    if cfg.shared_expert_hidden:
        gate = jax.nn.silu(tokens @ p["shared_w1"].astype(x.dtype))
        shared = (gate * (tokens @ p["shared_w3"].astype(x.dtype))) @ p["shared_w2"].astype(x.dtype)
        y = (shared + cfg.top_k * y) / (cfg.top_k + 1)
    return y.reshape(B, T, D), aux


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
