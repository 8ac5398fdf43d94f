"""The train state and the one jitted train step: a pure function of (state, batch).

A batch is the global batch cut into micro-batches, `input_ids [A, M, T]` and
`instance_mask [A, M]`. Each micro-batch's summed loss is divided by the label
count of the whole global batch, so accumulating A micro-batches gives the
gradient of one big batch.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax.config import RunConfig
from olmax.model import olmo3
from olmax.parallel.mesh import activation_sharding, logical_spec, shardings
from olmax.train.loss import label_mask, loss_sums
from olmax.train.optimizer import adam_count, build_optimizer, lr_at, with_lr


class TrainState(NamedTuple):
    step: jax.Array  # steps completed: the state in checkpoint N has step == N
    params: dict
    opt_state: Any


def optimizer_for(cfg: RunConfig):
    shapes = jax.eval_shape(functools.partial(olmo3.init_params, cfg.model), jax.random.key(0))
    return build_optimizer(cfg.optim, shapes)


def init_state(cfg: RunConfig, key: jax.Array) -> TrainState:
    params = olmo3.init_params(cfg.model, key)
    return TrainState(jnp.int32(0), params, optimizer_for(cfg).init(params))


def state_shardings(cfg: RunConfig, mesh: Mesh) -> TrainState:
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(functools.partial(init_state, cfg), jax.random.key(0))
    params = shardings(olmo3.param_axes(cfg.model), abstract.params, mesh)
    opt_state = optax.tree_map_params(
        optimizer_for(cfg), lambda _, sharding: sharding, abstract.opt_state, params,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(replicated, params, opt_state)


def create_state(cfg: RunConfig, mesh: Mesh, key: jax.Array) -> TrainState:
    """The initial state, created already sharded (no full copy on one device)."""
    return jax.jit(functools.partial(init_state, cfg), out_shardings=state_shardings(cfg, mesh))(key)


def batch_shardings(mesh: Mesh, seq_len: int, micro_rows: int) -> dict:
    tokens = NamedSharding(mesh, logical_spec(("layers", "batch", "length"), (1, micro_rows, seq_len), mesh))
    rows = NamedSharding(mesh, logical_spec(("layers", "batch"), (1, micro_rows), mesh))
    return {"input_ids": tokens, "instance_mask": rows}


def make_train_step(cfg: RunConfig, mesh: Mesh):
    optimizer = optimizer_for(cfg)
    model_cfg, loss_cfg = cfg.model, cfg.loss

    def micro_loss(params, input_ids, instance_mask, n_labels):
        logits = olmo3.forward(model_cfg, params, input_ids)
        mask = label_mask(input_ids, cfg.data.pad_id, loss_cfg.mask_pad)
        ce, z = loss_sums(logits, input_ids, mask, instance_mask)
        return (ce + loss_cfg.z_loss * z) / n_labels, (ce, z)

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def train_step(state: TrainState, batch: dict):
        input_ids, instance_mask = batch["input_ids"], batch["instance_mask"]
        all_rows = input_ids.reshape(-1, input_ids.shape[-1])
        n_labels = jnp.maximum(label_mask(all_rows, cfg.data.pad_id, loss_cfg.mask_pad).sum(), 1).astype(jnp.float32)

        def accumulate(carry, micro):
            grads, ce, z = carry
            g, (micro_ce, micro_z) = grad_fn(state.params, micro["input_ids"], micro["instance_mask"], n_labels)
            return (jax.tree.map(jnp.add, grads, g), ce + micro_ce, z + micro_z), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        with activation_sharding(mesh):
            (grads, ce, z), _ = jax.lax.scan(accumulate, (zeros, 0.0, 0.0), batch)
        ce_loss, z_loss = ce / n_labels, loss_cfg.z_loss * z / n_labels

        lr = lr_at(cfg.schedule, cfg.optim.lr, cfg.train.steps, state.step + 1)
        opt_state = with_lr(state.opt_state, lr)
        updates, opt_state = optimizer.update(grads, opt_state, state.params, loss=ce_loss)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "train/CE loss": ce_loss,
            "train/Z loss": z_loss,
            "optim/total grad norm": opt_state.grad_norm,
            "optim/LR (group 0)": lr,
            "optim/step skipped": opt_state.skipped.astype(jnp.float32),
            "optim/adam step": adam_count(opt_state),
            "train/masked instances (%)": 100.0 * (1.0 - instance_mask.mean()),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def jit_train_step(cfg: RunConfig, mesh: Mesh, micro_rows: int):
    state_sh = state_shardings(cfg, mesh)
    return jax.jit(
        make_train_step(cfg, mesh),
        in_shardings=(state_sh, batch_shardings(mesh, cfg.data.sequence_length, micro_rows)),
        out_shardings=(state_sh, None),
        donate_argnums=0,
    )
