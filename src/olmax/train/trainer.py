"""The train loop: data -> jitted step -> metrics -> checkpoints, resuming from the latest checkpoint.

Checkpoint N holds the state after step N and the loader's position after N
batches, so the resumed run trains step N + 1 on batch N + 1, exactly as the
continuous run would.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from olmax import storage
from olmax.checkpoint import (
    Checkpointer, CheckpointError, UnreadableCheckpoint, abstract_like, check_model_compatible, locate, run_meta,
)
from olmax.config import ConfigError, ModelConfig, RunConfig, upgrade, writable_dir
from olmax.data import build_loader
from olmax.model import families, flops
from olmax.model.transformer import compute_dtype
from olmax.parallel import pipeline
from olmax.parallel.mesh import Layout, make_layout
from olmax.runtime import received_signal
from olmax.train.bucket_run import BucketRun, fetch_checkpoints
from olmax.train.metrics import MetricsWriter, console_line, device_peak_flops
from olmax.train.step import (
    TrainState, batch_shardings, create_state, jit_train_step, micro_batch_rows, state_shardings,
)

log = logging.getLogger(__name__)

RESUMABLE_EXIT_CODE = 75  # EX_TEMPFAIL: preempted after a checkpoint; run again to resume


class Preempted(Exception):
    """SIGTERM/SIGINT arrived; the step in flight finished and a checkpoint was written (or nothing needed one)."""


@contextlib.contextmanager
def preemption_signals():
    """An Event set by SIGTERM/SIGINT while inside, or already before when they arrived during start-up (signal
    handlers only exist on the main thread)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    if received_signal() is not None:
        stop.set()
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_requested(stop: threading.Event) -> bool:
    """Whether any process was signalled. The processes of a run get the signal at different steps, but
    must all stop (and checkpoint) after the same one, or their collectives wait on each other for ever."""
    if jax.process_count() == 1:
        return stop.is_set()
    return bool(multihost_utils.process_allgather(np.int32(stop.is_set())).any())


def _abstract_state(cfg: RunConfig, layout: Layout):
    shapes = jax.eval_shape(lambda: create_state(cfg, layout, jax.random.key(0)))
    return abstract_like(state_shardings(cfg, layout), shapes)


def _restore(cfg: RunConfig, layout: Layout, checkpointer: Checkpointer, step: int):
    where = f"checkpoint {checkpointer.where(step)}"
    meta = checkpointer.read_meta(step)
    check_model_compatible(meta["config"], cfg.model, where)
    state, meta = checkpointer.restore(step, _abstract_state(cfg, layout))
    if meta["step"] != step:
        raise CheckpointError(f"{where} holds step {meta['step']}; the directory is misnamed or corrupt")
    return state, meta


def restore_or_init(cfg: RunConfig, layout: Layout, checkpointer: Checkpointer):
    """(state, step, meta or None): the latest readable checkpoint when resuming, else a fresh state.

    An unreadable checkpoint (a torn or corrupted write, files that do not match their checksums) falls
    back to the one before it with a warning; a checkpoint of a different model is an error, not a fallback.
    """
    steps = checkpointer.all_steps() if cfg.checkpoint.resume else []
    unreadable = []
    for step in reversed(steps):
        try:
            state, meta = _restore(cfg, layout, checkpointer, step)
        except UnreadableCheckpoint as err:
            log.warning("%s; trying the one before it", err)
            unreadable.append(step)
            continue
        for bad in unreadable:  # the run will write these steps again
            log.warning("set unreadable checkpoint aside as %s", checkpointer.set_aside(bad))
        return state, step, meta
    if steps:
        raise CheckpointError(
            f"no readable checkpoint in {checkpointer.directory} (tried steps {steps}); nothing was overwritten. "
            "Move the directory away to start over, or restore it from a copy"
        )
    if cfg.checkpoint.init_from and storage.is_remote(cfg.checkpoint.init_from):
        with tempfile.TemporaryDirectory(prefix="olmax-init-") as local:
            return warm_start(cfg, layout, str(fetch_checkpoints(cfg.checkpoint.init_from, Path(local)))), 0, None
    if cfg.checkpoint.init_from:
        return warm_start(cfg, layout, cfg.checkpoint.init_from), 0, None
    return create_state(cfg, layout, jax.random.key(cfg.train.seed)), 0, None


def check_same_parameters(saved: dict, current: ModelConfig, where: str) -> list[str]:
    """A warm start keeps the parameters, so their shapes must match; other model fields may change between
    stages (OLMo 3's long-context stage adds YaRN to the global layers). Returns those changes, one line each."""
    before = ModelConfig.model_validate(upgrade(saved)["model"])
    if families.param_shapes(before) != families.param_shapes(current):
        check_model_compatible(saved, current, where)  # names the fields that changed the shapes
    old, new = before.model_dump(mode="json"), current.model_dump(mode="json")
    return [f"model.{k}: {old[k]!r} -> {new[k]!r}" for k in new if old[k] != new[k]]


def warm_start(cfg: RunConfig, layout: Layout, source: str) -> TrainState:
    """Step 0 of a new run from another run's checkpoint (stage 2 from stage 1, or a converted HF model).

    Params are kept, and Adam's moments and count too when the source has them and
    `checkpoint.init_optimizer`; the step (so the LR schedule), the skip-step history
    (the old run's losses say nothing about the new mix) and the data position start fresh.
    The model may change where its parameters do not (RoPE scaling for the long-context stage).
    """
    try:
        directory, step = locate(source)
    except CheckpointError as err:
        raise CheckpointError(f"checkpoint.init_from: {err}") from None
    checkpointer = Checkpointer(directory, cfg.checkpoint, read_only=True)
    try:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"checkpoint.init_from {source}: holds no checkpoint")
        where = f"checkpoint.init_from {checkpointer.where(step)}"
        for change in check_same_parameters(checkpointer.read_meta(step)["config"], cfg.model, where):
            log.warning("%s: the model changes, its parameters stay: %s", where, change)
        fresh = create_state(cfg, layout, jax.random.key(cfg.train.seed))
        if cfg.checkpoint.init_optimizer and (directory / str(step) / "opt_state").exists():
            state, _ = checkpointer.restore(step, _abstract_state(cfg, layout))
            return TrainState(fresh.step, state.params, fresh.opt_state._replace(inner=state.opt_state.inner))
        params, _ = checkpointer.restore_params(step, _abstract_state(cfg, layout).params)
        return fresh._replace(params=params)
    except UnreadableCheckpoint as err:
        raise UnreadableCheckpoint(f"checkpoint.init_from: {err}; set it to another step ({directory}/N) or restore "
                                   "it from a copy") from err
    finally:
        checkpointer.close()


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


def train(cfg: RunConfig, *, quiet: bool = False, make_eval=None) -> list[dict]:
    """Train to cfg.train.steps; returns the metrics of the steps this call ran.

    `make_eval(cfg, layout)` builds the in-loop evaluator (`due(step)`, `(step, params) -> metrics`) when the
    config asks for evaluations (olmax.eval.in_loop.make_in_loop_eval)."""
    if (cfg.eval.every or cfg.eval.harness_every) and make_eval is None:
        raise ConfigError("the config asks for in-loop evals (eval.every / eval.harness_every) but train() was "
                          "given no make_eval; pass olmax.eval.in_loop.make_in_loop_eval")
    storage.configure(cfg.storage.retry_seconds)
    if storage.is_remote(cfg.run_location) and jax.process_count() > 1:
        raise ConfigError("output_dir in a bucket is written by one process; run a single process, or write to a "
                          "shared filesystem")
    bucket = BucketRun(cfg.run_location) if storage.is_remote(cfg.run_location) else None
    run_dir = bucket.local if bucket else cfg.run_dir
    writable_dir(run_dir, "output_dir")
    layout = make_layout(cfg.mesh)
    micro_rows = micro_batch_rows(cfg, layout.data_parallel_size)
    # Bad data fails first, before the model is built.
    loader = build_loader(cfg.data, global_batch_instances=cfg.train.global_batch_instances,
                          vocab_size=cfg.model.vocab_size, process_index=jax.process_index(),
                          process_count=jax.process_count())
    checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    try:
        state, start, restored = restore_or_init(cfg, layout, checkpointer)
    except BaseException:
        loader.close()
        raise
    tokens_per_step = cfg.train.global_batch_instances * cfg.data.sequence_length
    tokens_before, data_offset = 0, 0  # tokens trained up to step `start`; loader position - step
    if restored is not None:
        data = restored["data"]
        loader.load_state_dict(data)
        tokens_before = restored.get("tokens", start * data["global_batch_instances"] * data["sequence_length"])
        # Constant while the global batch size is; a new size rescales the position by tokens (as OLMo-core).
        data_offset = loader.step - start
        if data["global_batch_instances"] == cfg.train.global_batch_instances and \
                data_offset != restored.get("data_offset", 0):
            raise CheckpointError(
                f"checkpoint {checkpointer.where(start)}: data position {loader.step} batches is not step {start} "
                f"+ the offset {restored.get('data_offset', 0)} written with it, so the next step would not train on "
                "the next batch; restore the checkpoint from a copy, or move it away to resume from the one before"
            )
    step_fn = jit_train_step(cfg, layout, micro_rows)
    if (sched := pipeline.schedule_for(cfg)) and not quiet and jax.process_index() == 0:
        print(f"pipeline: {sched.describe()}", flush=True)
    evaluate = make_eval(cfg, layout) if make_eval else None
    sharding = batch_shardings(layout, cfg.data.sequence_length, micro_rows)
    writer = MetricsWriter(run_dir, start, enabled=jax.process_index() == 0)
    flops_per_token = flops.count(cfg.model, cfg.data.sequence_length).per_token
    peak = device_peak_flops(np.dtype(compute_dtype(cfg.impl, layout)).name)
    history, pending = [], None
    last_done = time.perf_counter()

    paused = 0.0  # seconds of evals and checkpoint writes since the last step was logged: not step time

    def tokens_after(step: int) -> int:
        return tokens_before + (step - start) * tokens_per_step

    def finish(step: int, metrics, eval_metrics: dict) -> None:
        nonlocal last_done, paused
        values = {k: v.tolist() if np.ndim(v) else float(v) for k, v in jax.device_get(metrics).items()} | eval_metrics
        now = time.perf_counter()
        tps = tokens_per_step / (now - last_done - paused) / jax.device_count()
        last_done, paused = now, 0.0
        values.update({
            "throughput/total tokens": tokens_after(step),
            "throughput/device/TPS": tps,
            "throughput/device/MFU": 100.0 * tps * flops_per_token / peak,
            "io/retries": storage.retries(),  # transient bucket faults retried so far (0 on local disk)
        })
        writer.write(step, values)
        history.append({"step": step, **values})
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            if not quiet and jax.process_index() == 0:
                print(console_line(step, cfg.train.steps, values), flush=True)
            if bucket:  # upload time is not step time
                writer.flush()
                bucket.push_metrics()
                paused += time.perf_counter() - now

    try:
        with preemption_signals() as stop:
            last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
            if start >= last and not quiet and jax.process_index() == 0:
                target = "train.steps" if last == cfg.train.steps else "train.stop_after"
                print(f"nothing to train: the run is at step {start}, at or past {target}={last}; "
                      "raise train.steps to train further", flush=True)
            if start < last and stop_requested(stop):
                raise Preempted(f"stopped by a signal before step {start + 1}; nothing needed writing")
            for step in range(start + 1, last + 1):
                batch = place_batch(next(loader), sharding, micro_rows)
                state, metrics = step_fn(state, batch)
                if pending:
                    finish(*pending)
                pending = (step, metrics, {})
                stopping = stop_requested(stop)
                save = step % cfg.checkpoint.every == 0 or step == last or stopping
                eval_due = evaluate is not None and evaluate.due(step)
                if eval_due or save:
                    jax.block_until_ready(metrics)
                    side_work_start = time.perf_counter()
                    if eval_due:
                        pending[2].update(evaluate(step, state.params))
                    if save:
                        # Step N is logged and on disk before checkpoint N exists: a resume at N keeps steps <= N.
                        paused += time.perf_counter() - side_work_start
                        finish(*pending)
                        pending = None
                        writer.flush()
                        side_work_start = time.perf_counter()
                        checkpointer.save(step, state, run_meta(cfg, step, loader.state_dict(), tokens_after(step),
                                                                data_offset))
                        if bucket:
                            bucket.push_metrics()
                            bucket.push_checkpoint(step, checkpointer.all_steps())
                    paused += time.perf_counter() - side_work_start
                if stopping:
                    raise Preempted(f"stopped by a signal after step {step}; checkpoint {step} written")
            if pending:
                finish(*pending)
    finally:
        loader.close()
        writer.close()
        checkpointer.close()
        if bucket:
            bucket.close()
    return history
