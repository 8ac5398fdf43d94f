"""The train loop: data -> jitted step -> metrics -> checkpoints, resuming from the latest checkpoint.

Checkpoint N holds the state after step N and the loader's position after N
batches, so the resumed run trains step N + 1 on batch N + 1, exactly as the
continuous run would.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from olmax.config import ConfigError, RunConfig
from olmax.data import build_loader
from olmax.model import flops
from olmax.model.olmo3 import compute_dtype
from olmax.parallel.mesh import data_parallel_size, make_mesh
from olmax.train.checkpoint import Checkpointer, CheckpointError, abstract_like, check_model_compatible, run_meta
from olmax.train.metrics import MetricsWriter, console_line, device_peak_flops
from olmax.train.step import batch_shardings, create_state, jit_train_step, state_shardings


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


def restore_or_init(cfg: RunConfig, mesh, checkpointer: Checkpointer):
    """(state, step, data_state or None): the latest checkpoint when resuming, else a fresh state."""
    step = checkpointer.latest_step() if cfg.checkpoint.resume else None
    if step is None:
        return create_state(cfg, mesh, jax.random.key(cfg.train.seed)), 0, None
    where = f"checkpoint {checkpointer.directory / str(step)}"
    meta = checkpointer.read_meta(step)
    check_model_compatible(meta["config"]["model"], cfg.model, where)
    shapes = jax.eval_shape(lambda: create_state(cfg, mesh, jax.random.key(0)))
    state, meta = checkpointer.restore(step, abstract_like(state_shardings(cfg, mesh), shapes))
    if meta["step"] != step:
        raise CheckpointError(f"{where} holds step {meta['step']}; the directory is misnamed or corrupt")
    return state, step, meta["data"]


def place_batch(batch: dict, sharding: dict, micro_rows: int) -> dict:
    """Local rows [G / P, T] -> global arrays [A, M, T] sharded over the batch axes."""
    process_count = jax.process_count()
    out = {}
    for name, local in batch.items():
        n_micro = local.shape[0] * process_count // micro_rows
        local = local.reshape(n_micro, micro_rows // process_count, *local.shape[1:])
        global_shape = (n_micro, micro_rows, *local.shape[2:])
        out[name] = jax.make_array_from_process_local_data(sharding[name], local, global_shape)
    return out


def train(cfg: RunConfig, *, quiet: bool = False) -> list[dict]:
    """Train to cfg.train.steps; returns the metrics of the steps this call ran."""
    mesh = make_mesh(cfg.mesh)
    micro_rows = micro_batch_rows(cfg, data_parallel_size(mesh))
    checkpointer = Checkpointer(cfg.run_dir / "checkpoints", cfg.checkpoint)
    state, start, data_state = restore_or_init(cfg, mesh, checkpointer)
    loader = build_loader(cfg.data, global_batch_instances=cfg.train.global_batch_instances,
                          vocab_size=cfg.model.vocab_size, process_index=jax.process_index(),
                          process_count=jax.process_count())
    if data_state is not None:
        loader.load_state_dict(data_state)
    same_batch = data_state is None or data_state["global_batch_instances"] == cfg.train.global_batch_instances
    if same_batch and loader.step != start:  # a new global batch size rescales the position by tokens instead
        raise CheckpointError(
            f"data position {loader.step} batches != model step {start}: the next step must train on the next batch"
        )
    step_fn = jit_train_step(cfg, mesh, micro_rows)
    sharding = batch_shardings(mesh, cfg.data.sequence_length, micro_rows)
    writer = MetricsWriter(cfg.run_dir, start, enabled=jax.process_index() == 0)
    tokens_per_step = cfg.train.global_batch_instances * cfg.data.sequence_length
    flops_per_token = flops.count(cfg.model, cfg.data.sequence_length).per_token
    peak = device_peak_flops(np.dtype(compute_dtype(cfg.model)).name)
    history, pending = [], None
    last_done = time.perf_counter()

    def finish(step: int, metrics) -> None:
        nonlocal last_done
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        tps = tokens_per_step / (now - last_done) / jax.device_count()
        last_done = now
        values.update({
            "throughput/total tokens": step * tokens_per_step,
            "throughput/device/TPS": tps,
            "throughput/device/MFU": 100.0 * tps * flops_per_token / peak,
        })
        writer.write(step, values)
        history.append({"step": step, **values})
        if not quiet and (step % cfg.train.log_every == 0 or step == cfg.train.steps):
            print(console_line(step, cfg.train.steps, values), flush=True)

    try:
        for step in range(start + 1, cfg.train.steps + 1):
            batch = place_batch(next(loader), sharding, micro_rows)
            state, metrics = step_fn(state, batch)
            if pending:
                finish(*pending)
            pending = (step, metrics)
            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
                checkpointer.save(step, state, run_meta(cfg, step, loader.state_dict()))
        if pending:
            finish(*pending)
    finally:
        loader.close()
        writer.close()
        checkpointer.close()
    return history
