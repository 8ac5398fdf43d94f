"""The train state and the one jitted train step: a pure function of (state, batch).

A batch is the global batch cut into micro-batches, `input_ids [A, M, T]` and
`instance_mask [A, M]`. Each micro-batch's summed loss is divided by the label
count of the whole global batch, so accumulating A micro-batches gives the
gradient of one big batch. What the MLP sublayer kind adds to training comes
from its training hooks (olmax.model.mlp): the loss of its `aux` (stacked over
layers), already divided by the same label count; its metrics; state it moves
after the update; its key for each micro-batch of a step. The step knows no
kind. With pipeline stages (mesh.stage > 1) each micro-batch is cut again into
the pipeline's micro-batches, and the loss hook sees each of those as a
micro-batch of its own; a 1F1B schedule computes the loss of each inside the
pipeline (transformer.forward_loss), its gradient scheduled by the pipeline.

The optimizer gets the global gradient norm computed here, from the gradients in
the parameters' layout; with `impl.shard_optimizer` it then updates ZeRO-1
shards (train/zero.py).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from olmax.config import ConfigError, RunConfig
from olmax.model import families, transformer
from olmax.model.block import training_hooks
from olmax.model.loss import label_count, label_mask, loss_sums
from olmax.parallel import schedules
from olmax.parallel.mesh import Layout
from olmax.train import zero
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


def param_shardings(cfg: RunConfig, layout: Layout) -> dict:
    return layout.shardings(families.param_axes(cfg.model), families.param_shapes(cfg.model))


def update_shardings(cfg: RunConfig, layout: Layout) -> dict:
    """Where the optimizer's update runs: on the parameters' layout, or on ZeRO-1 shards."""
    params = param_shardings(cfg, layout)
    return zero.shardings(params, families.param_shapes(cfg.model)) if cfg.impl.shard_optimizer else params


def state_shardings(cfg: RunConfig, layout: Layout) -> TrainState:
    abstract = jax.eval_shape(functools.partial(init_state, cfg), jax.random.key(0))
    opt_state = optax.tree_map_params(
        optimizer_for(cfg), lambda _, sharding: sharding, abstract.opt_state, update_shardings(cfg, layout),
        transform_non_params=lambda _: layout.replicated,
    )
    return TrainState(layout.replicated, param_shardings(cfg, layout), opt_state)


def abstract_state(cfg: RunConfig, layout: Layout) -> TrainState:
    """The train state as shapes placed on the layout (ShapeDtypeStructs, nothing allocated): what a restore
    fills and what an ahead-of-time compile takes."""
    shapes = jax.eval_shape(functools.partial(init_state, cfg), jax.random.key(0))
    return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        shapes, state_shardings(cfg, layout))


def create_state(cfg: RunConfig, layout: Layout, key: jax.Array) -> TrainState:
    """The initial state, created already sharded (no full copy on one device)."""
    return jax.jit(functools.partial(init_state, cfg), out_shardings=state_shardings(cfg, layout))(key)


def micro_batch_rows(cfg: RunConfig, dp_size: int) -> int:
    """Instances per micro-step over the whole mesh; the global batch must be a whole number of them."""
    global_batch = cfg.train.global_batch_instances
    per_device = cfg.train.micro_batch_per_device
    rows = global_batch if per_device is None else per_device * dp_size
    if global_batch % dp_size:
        raise ConfigError(f"train.global_batch_instances {global_batch} must be divisible by the data-parallel size "
                          f"{dp_size} (mesh data x fsdp x expert); change the global batch or the mesh")
    if global_batch % rows:
        raise ConfigError(
            f"train.global_batch_instances {global_batch} must be divisible by data-parallel size {dp_size} "
            f"x train.micro_batch_per_device {per_device} = {rows}; change the global batch or the micro-batch"
        )
    schedules.check_rows(cfg, rows // dp_size)
    return rows


def batch_shardings(layout: Layout, seq_len: int, micro_rows: int) -> dict:
    """[A, M, ...]: the micro-step axis A whole on every device, the rows M over the batch axes."""
    def sharding(names, shape):
        return NamedSharding(layout.mesh, PartitionSpec(None, *layout.spec(names, shape)))

    return {"input_ids": sharding(("batch", "length"), (micro_rows, seq_len)),
            "instance_mask": sharding(("batch",), (micro_rows,))}


def per_microbatch_loss(hooks, aux: dict, microbatches: int, tokens: int, n_labels: jax.Array) -> tuple[jax.Array, dict]:
    """The hooks' `loss` of each pipeline micro-batch of tokens / microbatches tokens (aux leaves [microbatches,
    n_layers, ...]): their summed loss and logs, as if each were a micro-batch of the gradient accumulation."""
    parts = [hooks.loss(jax.tree.map(lambda a: a[m], aux), tokens // microbatches, n_labels)
             for m in range(microbatches)]
    loss = sum(part[0] for part in parts)
    return loss, jax.tree.map(lambda *values: sum(values), *(part[1] for part in parts))


def global_norm(grads: dict, shardings: dict) -> jax.Array:
    """The global L2 norm, each square summed in its parameter's layout (one all-reduce of the partial sums
    over the axes the parameter is sharded on): left free, XLA may sum the squares on the optimizer's ZeRO-1
    shards instead, in another order, and ZeRO-1 must not change a bit (train/zero.py)."""
    squares = jax.tree.map(lambda g, sharding: jax.lax.with_sharding_constraint(g * g, sharding), grads, shardings)
    return jnp.sqrt(jax.tree.reduce(operator.add, jax.tree.map(jnp.sum, squares), initializer=0))


def make_train_step(cfg: RunConfig, layout: Layout):
    optimizer = optimizer_for(cfg)
    model_cfg, impl, loss_cfg = cfg.model, cfg.impl, cfg.loss
    sched = schedules.schedule_for(cfg)
    hooks = training_hooks(model_cfg, cfg.train.seed)  # the MLP sublayer's: its losses, metrics, state, key
    params_sh, update_sh = param_shardings(cfg, layout), update_shardings(cfg, layout)

    def head_loss(params, hidden, inputs, n_labels):  # a 1F1B schedule's loss of one pipeline micro-batch
        input_ids, instance_mask = inputs
        mask = label_mask(input_ids, cfg.data.pad_id, loss_cfg.mask_pad)
        ce, z = loss_sums(params, hidden, input_ids, mask, instance_mask, impl.loss_chunk, impl.logits_grad)
        return (ce + loss_cfg.z_loss * z) / n_labels, (ce, z)

    def micro_loss(params, input_ids, instance_mask, n_labels, key):
        if sched is not None and sched.loss_inside:
            tokens = input_ids.size // sched.microbatches  # of a pipeline micro-batch
            loss, (ce, z), aux = transformer.forward_loss(
                model_cfg, impl, params, input_ids, instance_mask, functools.partial(head_loss, n_labels=n_labels),
                layout, sched, lambda aux: hooks.loss(aux, tokens, n_labels)[0])
            return loss, (ce, z, per_microbatch_loss(hooks, aux, sched.microbatches, input_ids.size, n_labels)[1])
        hidden, aux = transformer.forward(model_cfg, impl, params, input_ids, layout, key, sched)
        mask = label_mask(input_ids, cfg.data.pad_id, loss_cfg.mask_pad)
        ce, z = loss_sums(params, hidden, input_ids, mask, instance_mask, impl.loss_chunk, impl.logits_grad)
        if sched is None:
            aux_loss, aux_metrics = hooks.loss(aux, input_ids.size, n_labels)
        else:
            aux_loss, aux_metrics = per_microbatch_loss(hooks, aux, sched.microbatches, input_ids.size, n_labels)
        return (ce + loss_cfg.z_loss * z) / n_labels + aux_loss, (ce, z, aux_metrics)

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def train_step(state: TrainState, batch: dict):
        input_ids, instance_mask = batch["input_ids"], batch["instance_mask"]
        n_labels = label_count(input_ids.reshape(-1, input_ids.shape[-1]), instance_mask.reshape(-1), cfg.data.pad_id,
                               loss_cfg.mask_pad)
        n_micro = input_ids.shape[0]

        def accumulate(carry, inputs):
            micro, index = inputs
            grads, ce, z = carry
            g, (micro_ce, micro_z, logged) = grad_fn(state.params, micro["input_ids"], micro["instance_mask"],
                                                     n_labels, hooks.key(state.step + 1, index))
            return (jax.tree.map(jnp.add, grads, g), ce + micro_ce, z + micro_z), logged

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (grads, ce, z), logged = jax.lax.scan(accumulate, (zeros, 0.0, 0.0), (batch, jnp.arange(n_micro)))
        logged = jax.tree.map(lambda a: a.sum(0), logged)  # over the global batch
        ce_loss, z_loss = ce / n_labels, loss_cfg.z_loss * z / n_labels

        lr = lr_at(cfg.schedule, cfg.optim.lr, cfg.train.steps, state.step + 1)
        opt_state = with_lr(state.opt_state, lr)
        # Reduced over the batch into the parameters' layout first, as without ZeRO-1 (a reduce-scatter straight
        # onto its shards would sum in another order), then sliced.
        grads = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(grads, params_sh))
        grad_norm = global_norm(grads, params_sh)
        grads, params = jax.lax.with_sharding_constraint((grads, state.params), (update_sh, update_sh))
        updates, opt_state = optimizer.update(grads, opt_state, params, loss=ce_loss, grad_norm=grad_norm)
        params = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), params_sh)
        params = hooks.after_update(params, state.params, logged)
        metrics = {
            "train/CE loss": ce_loss,
            "train/Z loss": z_loss,
            "optim/total grad norm": opt_state.grad_norm,
            "optim/LR (group 0)": lr,
            "optim/step skipped": opt_state.skipped.astype(jnp.float32),
            "optim/adam step": adam_count(opt_state),
            "train/masked instances (%)": 100.0 * (1.0 - instance_mask.mean()),
            **hooks.metrics(logged),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def jit_train_step(cfg: RunConfig, layout: Layout, micro_rows: int, compiler_options: dict | None = None):
    """The jitted train step; `compiler_options`: XLA flags for its compile (a run's target's flag profile)."""
    state_sh = state_shardings(cfg, layout)
    return jax.jit(
        make_train_step(cfg, layout),
        in_shardings=(state_sh, batch_shardings(layout, cfg.data.sequence_length, micro_rows)),
        out_shardings=(state_sh, None),
        donate_argnums=0,
        compiler_options=compiler_options or None,
    )
