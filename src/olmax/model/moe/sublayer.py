"""The mixture-of-experts MLP sublayer and its training hooks: a router sends each token to top_k of E
SwiGLU experts (router.py), which run as grouped matmuls over the rows routed to them (experts.py: XLA's
block loop, block_loop.py, `jax.lax.ragged_dot`, or the GPU kernels of kernels/).

    out    = sum_k gates_k * expert_{chosen_k}(x)
           = (shared(x) + k * out) / (k + 1)  with a shared expert (OLMo-core's weighting)
    expert(x) = w2(silu(w1 x) * w3 x)

The experts run dropless by default. With several devices the same computation runs per device
inside `olmax.parallel.expert`, experts resident on the `expert` mesh axis and tokens exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from olmax.config import ConfigError, ImplConfig, ModelConfig, MoEConfig
from olmax.model import fp8
from olmax.model.mlp import swiglu
from olmax.model.moe import block_loop, router
from olmax.model.moe.experts import grouped_swiglu
from olmax.model.moe.kernels import grouped
from olmax.model.moe.kernels.chip import Chip, unsupported
from olmax.parallel import expert as expert_parallel
from olmax.parallel import moe_sizing
from olmax.parallel.mesh import Layout, platform


class MoETarget(NamedTuple):
    """The devices the experts run on, as dispatch_for takes them."""

    platform: str  # cpu, gpu or tpu
    device: object  # one of the devices (a GPU's compute capability picks its kernels)
    mxfp8: bool  # impl.fp8=mxfp8


def dispatch_for(chosen: str, platform: str, device=None, mxfp8: bool = False) -> str:
    """The experts' matmul `impl.moe.dispatch` means on `platform` ('cpu', 'gpu', 'tpu'), for GPUs on `device`
    (one of the target's), with or without pipeline stages (each kernel launch runs unbatched under the pipeline's
    map over its stages: olmax.model.moe.kernels.chip.one_launch_a_device, experts.ragged_dot). `auto`
    takes ragged_dot where the compiler runs it as a grouped-matmul kernel: on TPU (its `ragged-dot` kernels,
    tests/scale/test_scale_compile.py). XLA:CPU expands ragged_dot densely, and so did XLA:GPU in jax 0.10.2 (a
    compile for gpu:h100x8 made each expert matmul a batched dot over every expert and every row), so on GPUs
    `auto` takes `grouped`, the Pallas Mosaic GPU kernels of olmax.model.moe.kernels, where they run (Hopper and
    Blackwell, any width; `mxfp8` on Blackwell only), and the block loop elsewhere (the CPU emulates MXFP8 in
    it)."""
    if chosen in ("auto", "grouped"):
        refusal = None
        if platform != "gpu":
            refusal = f"its kernels are for NVIDIA GPUs, and this layout's devices are {platform.upper()}s"
        else:
            refusal = unsupported(device)
        if not refusal and mxfp8 and Chip.of(device).major != 10:
            refusal = "its MXFP8 kernels are Blackwell's (sm_100, tcgen05's block-scaled MMA)"
        if chosen == "grouped" and refusal:
            raise ConfigError(f"impl.moe.dispatch=grouped: {refusal}; set impl.moe.dispatch=auto or blocks")
        if chosen == "auto":
            return "ragged_dot" if platform == "tpu" else "blocks" if refusal else "grouped"
    return chosen


def moe_target(cfg: ModelConfig, impl: ImplConfig, layout: Layout | None) -> MoETarget:
    """What dispatch_for needs beyond impl.moe.dispatch, of the layout's devices (this process's without one)."""
    device = layout.mesh.devices.flat[0] if layout else jax.devices()[0]
    return MoETarget(platform(layout), device, impl.fp8 == "mxfp8")


def dispatch_for_layout(cfg: ModelConfig, impl: ImplConfig, layout: Layout | None) -> str:
    """The experts' matmul impl.moe.dispatch means on the layout's devices (`dispatch_for`); ConfigError where it
    cannot run there."""
    return dispatch_for(impl.moe.dispatch, *moe_target(cfg, impl, layout))


def layer_rows(cfg: MoEConfig, mesh: Mesh | None, batch_axes: tuple[str, ...], tokens: int,
               ep_capacity: float | None = None, exchange_chunks: int = 1,
               ep_buffer: float | None = None) -> moe_sizing.LayerRows:
    """The rows of a layer run on `tokens` tokens (all the mesh's) at once (olmax.parallel.moe_sizing): each
    batch shard's tokens, over the mesh's expert axis."""
    ranks = expert_parallel.batch_shards(mesh, batch_axes) if mesh is not None else 1
    ep = mesh.shape.get(expert_parallel.EXPERT_AXIS, 1) if mesh is not None else 1
    return moe_sizing.layer_rows(cfg.num_experts, cfg.top_k, ep, tokens // ranks, ep_capacity, exchange_chunks,
                                 ep_buffer)


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
    exchange_chunks: int = 1,
    ep_buffer: float | None = None,
    dot=block_loop.dot_f32,
    smallest_block: int = 16,
    chip: Chip | None = None,
) -> tuple[jax.Array, dict]:
    """One MoE layer on hidden states x [B, T, D] -> (out [B, T, D], aux); `key` drives routing="random".
    `dispatch` ("blocks", "ragged_dot" or "grouped": the kernels for GPU `chip`) and `block_size` (None = auto,
    at least `smallest_block`) choose how the experts run, `dot` the block loop's products (block_loop.matmul);
    `ep_capacity` (None: dropless) bounds what a device sends each peer of its expert group (see
    olmax.parallel.expert), dropping, and counting, assignments beyond it; dropless, `exchange_chunks` parts of
    each device's tokens are exchanged and run one after another, so one's exchange can overlap another's experts,
    each into a receive buffer of `ep_buffer` x the rows expected (None: the worst case), in rounds while rows are
    left.

    aux (one layer's values; the model stacks them over layers):
      load_balancing_loss  f32 []   unscaled, see `load_balancing_loss`
      router_z_loss        f32 []   unscaled, mean(logsumexp(logits)^2)
      tokens_per_expert    i32 [E]  assignments routed to each expert (before any drop)
      dropped_tokens       i32 []   assignments over capacity (0 when dropless)
      exchange_rounds      i32 []   rounds past the first of a bounded dropless exchange, the most of any group
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
    r = router.route(cfg, p, tokens, key, top_k)
    lb_groups = ranks if cfg.load_balancing_granularity == "micro_batch" else 1
    lb_scores = r.scores / jnp.sum(r.scores, axis=-1, keepdims=True) if cfg.gating == "sigmoid" else r.scores
    aux = {
        "load_balancing_loss": router.load_balancing_loss(lb_scores, r.experts, cfg.top_k, lb_groups),
        "router_z_loss": router.router_z_loss(r.logits),
        "tokens_per_expert": router.tokens_per_expert(r.experts, cfg.num_experts),
    }
    experts = r.experts
    if cfg.capacity_factor is not None:
        experts = router.drop_over_capacity(cfg, experts, ranks)
    rows = layer_rows(cfg, mesh, batch_axes, tokens.shape[0], ep_capacity, exchange_chunks, ep_buffer)
    if rows.capacity is not None:
        experts = expert_parallel.drop_over_peer_capacity(experts, cfg.num_experts, rows.ep, ranks, rows.capacity)
    aux["dropped_tokens"] = jnp.sum(experts == cfg.num_experts, dtype=jnp.int32)

    def run_experts(x_local, groups, gates, w1, w3, w2, expected_rows, assignments=None):
        # the layer's block (moe_sizing), sized for the rows the exchange says it expects (`expected_rows`)
        block = rows.block(block_size, smallest_block)
        product = None
        if dispatch == "grouped":  # the kernels' layout (Chip.block), whatever impl.moe.block
            # the block loop's MXFP8 product means the kernels' MXFP8 products
            mxfp8 = isinstance(dot, fp8.MXDot)
            block, product = chip.block, lambda a, w, starts, b: grouped.matmul(a, w, starts, b, chip, mxfp8)
        return grouped_swiglu(x_local, groups, w1, w3, w2, dispatch=dispatch, block=block, dot=dot, product=product,
                              assignments=assignments, gates=gates)

    weights = (p["w1"], p["w3"], p["w2"])
    aux["exchange_rounds"] = jnp.zeros((), jnp.int32)
    if mesh is None:
        y = run_experts(tokens, experts, r.gates, *weights, experts.size)
    else:
        y, aux["exchange_rounds"] = expert_parallel.routed_experts(
            run_experts, tokens, experts, r.gates, weights, mesh, batch_axes, rows.capacity, exchange_chunks, ep_buffer)
    if cfg.shared_expert_hidden:
        shared = swiglu(tokens, p["shared_w1"], p["shared_w3"], p["shared_w2"], lambda a, w, _: a @ w.astype(x.dtype))
        y = (shared + cfg.top_k * y) / (cfg.top_k + 1)
    return y.reshape(B, T, D), aux


@dataclass(frozen=True)
class MoETraining:
    """The MoE sublayer's training hooks (see olmax.model.mlp): the router losses, the true load over the
    global batch, the selection bias's move after the update, and routing="random"'s key."""

    model: ModelConfig
    seed: int  # train.seed: routing="random" draws from a key of (seed, step, micro-batch)

    def loss(self, aux: dict, tokens: int, n_labels: jax.Array) -> tuple[jax.Array, dict]:
        """What a micro-batch of `tokens` tokens adds to the loss, already divided by the global batch's label
        count, and the values to sum over micro-batches for the metrics, from the per-layer aux."""
        loss, logged = router.aux_loss(self.model.moe, aux, self.model.n_layers, tokens, n_labels)
        return loss, {f"train/{name}": value for name, value in logged.items()} | {
            "tokens_per_expert": aux["tokens_per_expert"], "dropped_tokens": aux["dropped_tokens"],
            "exchange_rounds": jnp.sum(aux["exchange_rounds"])}

    def metrics(self, logged: dict) -> dict:
        """The step's metrics from the summed values: the true load of the global batch per MoE layer
        (assignments per expert, a vector metric: a histogram in the event files), and the worst layer's
        load imbalance (max / mean, OLMo-core's metric and reduction) and busiest expert share."""
        logged = dict(logged)
        counts, dropped = logged.pop("tokens_per_expert"), logged.pop("dropped_tokens")
        load = router.load_metrics(counts, dropped)
        metrics = {"train/load imbalance": jnp.max(load["load imbalance"]),
                   "train/busiest expert share": jnp.max(load["busiest expert share"]),
                   "train/dropped rate": jnp.sum(dropped) / jnp.sum(counts),
                   # the exchange's receive buffer overflowed: rounds it took past the first, over layers and
                   # micro-batches (impl.moe.ep_buffer; exact either way, slower)
                   "train/exchange extra rounds": logged.pop("exchange_rounds")}
        for i in range(counts.shape[0]):
            layer = self.model.dense_layers + i
            metrics[f"train/block {layer:02d}/load imbalance"] = load["load imbalance"][i]
            metrics[f"train/block {layer:02d}/tokens per expert"] = counts[i]
        return logged | metrics

    def after_update(self, params: dict, old: dict, logged: dict) -> dict:
        """params with the selection bias moved from its value in `old` by the step's load (OLMo-core's
        `bias_gamma` update; even on a skipped step, as OLMo-core does): the bias is no trainable weight, so
        neither Adam nor weight decay may move it."""
        rate = self.model.moe.bias_update_rate
        if not rate:
            return params
        bias = router.update_score_bias(old["blocks"]["score_bias"], logged["tokens_per_expert"], rate)
        return params | {"blocks": params["blocks"] | {"score_bias": bias}}

    def key(self, step: jax.Array, micro: jax.Array) -> jax.Array | None:
        """The key of routing="random" for micro-batch `micro` of trainer step `step` (1-based): a function of
        the step, not of anything carried in the state, so a resumed run draws what the continuous one drew."""
        if self.model.moe.routing != "random":
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step), micro)
