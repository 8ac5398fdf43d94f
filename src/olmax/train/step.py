"""The train state and the one jitted train step: a pure function of (state, batch).

A batch is the global batch cut into micro-batches, `input_ids [A, M, T]` and
`instance_mask [A, M]`. Each micro-batch's summed loss is divided by the label
count of the whole global batch, so accumulating A micro-batches gives the
gradient of one big batch. Auxiliary losses of the model's sublayers (`aux`,
stacked over layers) enter in one place, `auxiliary`, summed over tokens and
divided by the same label count (OLMo-core's MoE router losses).

A mixture of experts adds its true load over the global batch to the metrics
(`load_metrics`) and moves its selection bias after the update (even on a
skipped step, as OLMo-core does); routing="random" draws from a key that is a
function of the step, so a resumed run routes as the continuous one.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from olmax.config import ConfigError, RunConfig
from olmax.model import families, moe, transformer
from olmax.model.loss import label_mask, loss_sums
from olmax.parallel.mesh import Layout
from olmax.train.optimizer import adam_count, build_optimizer, lr_at, with_lr


class TrainState(NamedTuple):
    step: jax.Array  # steps completed: the state in checkpoint N has step == N
    params: dict
    opt_state: Any


def optimizer_for(cfg: RunConfig):
    shapes = jax.eval_shape(functools.partial(families.init_params, cfg.model), jax.random.key(0))
    return build_optimizer(cfg.optim, shapes)


def init_state(cfg: RunConfig, key: jax.Array) -> TrainState:
    params = families.init_params(cfg.model, key)
    return TrainState(jnp.int32(0), params, optimizer_for(cfg).init(params))


def state_shardings(cfg: RunConfig, layout: Layout) -> TrainState:
    abstract = jax.eval_shape(functools.partial(init_state, cfg), jax.random.key(0))
    params = layout.shardings(families.param_axes(cfg.model), abstract.params)
    opt_state = optax.tree_map_params(
        optimizer_for(cfg), lambda _, sharding: sharding, abstract.opt_state, params,
        transform_non_params=lambda _: layout.replicated,
    )
    return TrainState(layout.replicated, params, opt_state)


def create_state(cfg: RunConfig, layout: Layout, key: jax.Array) -> TrainState:
    """The initial state, created already sharded (no full copy on one device)."""
    return jax.jit(functools.partial(init_state, cfg), out_shardings=state_shardings(cfg, layout))(key)


def micro_batch_rows(cfg: RunConfig, dp_size: int) -> int:
    """Instances per micro-step over the whole mesh; the global batch must be a whole number of them."""
    global_batch = cfg.train.global_batch_instances
    per_device = cfg.train.micro_batch_per_device
    rows = global_batch if per_device is None else per_device * dp_size
    if global_batch % dp_size or global_batch % rows:
        raise ConfigError(
            f"train.global_batch_instances {global_batch} must be divisible by data-parallel size {dp_size} "
            f"x train.micro_batch_per_device {per_device or global_batch // dp_size} = {rows}; "
            "change the global batch or the micro-batch"
        )
    return rows


def batch_shardings(layout: Layout, seq_len: int, micro_rows: int) -> dict:
    return {"input_ids": layout.sharding(("layers", "batch", "length"), (1, micro_rows, seq_len)),
            "instance_mask": layout.sharding(("layers", "batch"), (1, micro_rows))}


def auxiliary(cfg: RunConfig, aux: dict, tokens: int, n_labels: jax.Array) -> tuple[jax.Array, dict]:
    """The one place auxiliary losses enter the loss: (what a micro-batch of `tokens` tokens adds to the loss,
    already divided by the global batch's label count, and the values summed over micro-batches for the
    metrics) from the model's per-layer aux. A dense model has none."""
    if cfg.model.mlp != "moe":
        return jnp.float32(0.0), {}
    loss, logged = moe.aux_loss(cfg.model.moe, aux, cfg.model.n_layers, tokens, n_labels)
    return loss, {f"train/{name}": value for name, value in logged.items()} | {
        "tokens_per_expert": aux["tokens_per_expert"], "dropped_tokens": aux["dropped_tokens"]}


def load_metrics(cfg: RunConfig, logged: dict) -> dict:
    """The step's metrics from the summed aux values: the true load of the global batch per MoE layer
    (assignments per expert, a vector metric: a histogram in the event files), and the worst layer's
    load imbalance (max / mean, OLMo-core's metric and reduction) and busiest expert share."""
    counts, dropped = logged.pop("tokens_per_expert"), logged.pop("dropped_tokens")
    load = moe.load_metrics(counts, dropped)
    metrics = {"train/load imbalance": jnp.max(load["load imbalance"]),
               "train/busiest expert share": jnp.max(load["busiest expert share"]),
               "train/dropped rate": jnp.sum(dropped) / jnp.sum(counts)}
    for i in range(counts.shape[0]):
        layer = cfg.model.dense_layers + i
        metrics[f"train/block {layer:02d}/load imbalance"] = load["load imbalance"][i]
        metrics[f"train/block {layer:02d}/tokens per expert"] = counts[i]
    return logged | metrics


def routing_key(cfg: RunConfig, step: jax.Array, micro: jax.Array) -> jax.Array | None:
    """The key of routing="random" for micro-batch `micro` of trainer step `step` (1-based): a function of
    the step, not of anything carried in the state, so a resumed run draws what the continuous one drew."""
    if cfg.model.mlp != "moe" or cfg.model.moe.routing != "random":
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.train.seed), step), micro)


def with_score_bias(cfg: RunConfig, params: dict, old: dict, counts: jax.Array) -> dict:
    """params with the MoE selection bias moved from its value in `old` by this step's load (OLMo-core's
    `bias_gamma` update): the bias is no trainable weight, so neither Adam nor weight decay may move it."""
    rate = cfg.model.mlp == "moe" and cfg.model.moe.bias_update_rate
    if not rate:
        return params
    bias = moe.update_score_bias(old["blocks"]["score_bias"], counts, rate)
    return params | {"blocks": params["blocks"] | {"score_bias": bias}}


def make_train_step(cfg: RunConfig, layout: Layout):
    optimizer = optimizer_for(cfg)
    model_cfg, impl, loss_cfg = cfg.model, cfg.impl, cfg.loss

    def micro_loss(params, input_ids, instance_mask, n_labels, key):
        hidden, aux = transformer.forward(model_cfg, impl, params, input_ids, layout, key)
        mask = label_mask(input_ids, cfg.data.pad_id, loss_cfg.mask_pad)
        ce, z = loss_sums(params, hidden, input_ids, mask, instance_mask, impl.loss_chunk)
        aux_loss, aux_metrics = auxiliary(cfg, aux, input_ids.size, n_labels)
        return (ce + loss_cfg.z_loss * z) / n_labels + aux_loss, (ce, z, aux_metrics)

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def train_step(state: TrainState, batch: dict):
        input_ids, instance_mask = batch["input_ids"], batch["instance_mask"]
        all_rows = input_ids.reshape(-1, input_ids.shape[-1])
        n_labels = jnp.maximum(label_mask(all_rows, cfg.data.pad_id, loss_cfg.mask_pad).sum(), 1).astype(jnp.float32)
        n_micro = input_ids.shape[0]

        def accumulate(carry, inputs):
            micro, index = inputs
            grads, ce, z = carry
            g, (micro_ce, micro_z, logged) = grad_fn(state.params, micro["input_ids"], micro["instance_mask"],
                                                     n_labels, routing_key(cfg, state.step + 1, index))
            return (jax.tree.map(jnp.add, grads, g), ce + micro_ce, z + micro_z), logged

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (grads, ce, z), logged = jax.lax.scan(accumulate, (zeros, 0.0, 0.0), (batch, jnp.arange(n_micro)))
        logged = jax.tree.map(lambda a: a.sum(0), logged)
        counts = logged.get("tokens_per_expert")  # [MoE layers, experts] over the global batch
        if counts is not None:
            logged = load_metrics(cfg, logged)
        ce_loss, z_loss = ce / n_labels, loss_cfg.z_loss * z / n_labels

        lr = lr_at(cfg.schedule, cfg.optim.lr, cfg.train.steps, state.step + 1)
        opt_state = with_lr(state.opt_state, lr)
        updates, opt_state = optimizer.update(grads, opt_state, state.params, loss=ce_loss)
        params = with_score_bias(cfg, optax.apply_updates(state.params, updates), state.params, counts)
        metrics = {
            "train/CE loss": ce_loss,
            "train/Z loss": z_loss,
            "optim/total grad norm": opt_state.grad_norm,
            "optim/LR (group 0)": lr,
            "optim/step skipped": opt_state.skipped.astype(jnp.float32),
            "optim/adam step": adam_count(opt_state),
            "train/masked instances (%)": 100.0 * (1.0 - instance_mask.mean()),
            **logged,
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def jit_train_step(cfg: RunConfig, layout: Layout, micro_rows: int):
    state_sh = state_shardings(cfg, layout)
    return jax.jit(
        make_train_step(cfg, layout),
        in_shardings=(state_sh, batch_shardings(layout, cfg.data.sequence_length, micro_rows)),
        out_shardings=(state_sh, None),
        donate_argnums=0,
    )
