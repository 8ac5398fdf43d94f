"""The train loop: data -> jitted step -> metrics -> checkpoints, resuming from the latest checkpoint.

Checkpoint N holds the state after step N and the loader's position after N
batches, so the resumed run trains step N + 1 on batch N + 1, exactly as the
continuous run would.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from olmax import progress, run_lock, storage
from olmax.checkpoint import Checkpointer, run_meta
from olmax.checkpoint.async_save import AsyncSaver
from olmax.config import ConfigError, RunConfig, writable_dir
from olmax.errors import Diverged, ExitCode, Preempted
from olmax.data import build_loader
from olmax.model import flops
from olmax.model.moe import selfcheck, sublayer
from olmax.model.transformer import compute_dtype
from olmax.parallel import schedules
from olmax.parallel.mesh import Layout, make_layout
from olmax.run_dir import RunDir
from olmax.runtime import StopSignals, preemption_signals
from olmax.train.bucket_run import BucketRun
from olmax.train.goodput import COMPILED, Goodput
from olmax.train.metrics import MetricsWriter, console_line, device_peak_flops
from olmax.train.resume import restore_or_init, resume_data, schedule_change
from olmax.train.step_clock import StepClock
from olmax.train.step import batch_shardings, jit_train_step, micro_batch_rows
from olmax.train.wandb_log import WandbLog
from olmax.train.watchdog import watching

log = logging.getLogger(__name__)


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))


def check_finite(params, when: str, checkpointer: Checkpointer) -> None:
    """Raise Diverged unless every parameter is finite: one reduction over the params, run before each
    checkpoint is written and after a step whose loss is not finite (`when` says which)."""
    if not bool(_all_finite(params)):
        latest = checkpointer.latest_step()
        raise Diverged(
            f"the run diverged: the parameters are NaN or infinite ({when}); no checkpoint of them was written "
            f"({f'the latest is {latest}' if latest else 'there is none'}). Lower optim.lr or raise "
            "schedule.warmup_steps, then run again"
        )


def stop_requested(stop: StopSignals) -> bool:
    """Whether any process was signalled. The processes of a run get the signal at different steps, but
    must all stop (and checkpoint) after the same one, or their collectives wait on each other for ever."""
    if jax.process_count() == 1:
        return stop.came
    return bool(multihost_utils.process_allgather(np.int32(stop.came)).any())


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


def train(cfg: RunConfig, *, quiet: bool = False, make_eval=None, on_start=None, started: float | None = None,
          compiler_options: dict | None = None) -> list[dict]:
    """Train to cfg.train.steps; returns the metrics of the steps this call ran. `compiler_options`: XLA flags for
    the train step's compile (`olmax train` gives the flag profile of the target its devices make).

    `make_eval(cfg, layout)` builds the in-loop evaluator (`due(step)`, `(step, params) -> metrics`) when the
    config asks for evaluations (olmax.eval.in_loop.make_in_loop_eval). `on_start(run_dir)` is called once the
    run directory is checked and held, before the model is built, with the local run directory, or None for a
    run in a bucket (`olmax train` starts its host log in a local one). `started`: when the process started, for
    the goodput record's start-up time (default: now)."""
    if (cfg.eval.every or cfg.eval.harness_every) and make_eval is None:
        raise ConfigError("the config asks for in-loop evals (eval.every / eval.harness_every) but train() was "
                          "given no make_eval; pass olmax.eval.in_loop.make_in_loop_eval")
    storage.configure(cfg.storage.retry_seconds)
    # The config against these devices, before the run directory is made: the mesh, and the experts' matmuls.
    layout = make_layout(cfg.mesh)
    micro_batch_rows(cfg, layout.data_parallel_size)  # the rows split into the pipeline's and batch_split's parts
    if cfg.model.mlp == "moe":
        sublayer.dispatch_for_layout(cfg.model, cfg.impl, layout)
    remote = storage.is_remote(cfg.run_location)
    if not remote:
        check_outputs(cfg.run_dir)
    # One process of a multi-process run holds the run directory for all (they share it); a bucket's is a lease,
    # taken before anything is copied down from it.
    with run_lock.hold(cfg.run_location if remote else cfg.run_dir) if jax.process_index() == 0 \
            else contextlib.nullcontext():
        if remote and jax.process_count() > 1:  # every process copies the run down once process 0 holds it
            multihost_utils.sync_global_devices("olmax: bucket run directory held")
        bucket = BucketRun(cfg.run_location, cfg.checkpoint) if remote else None
        run_dir = bucket.local if bucket else cfg.run_dir
        if bucket:
            check_outputs(run_dir)
        if on_start is not None:
            on_start(None if bucket else run_dir)
        doing = ["restoring the run's state or initializing it"]  # what the run waits for, said in its silences
        with progress.ticking(lambda seconds: f"olmax: [{seconds:.0f} s] {doing[0]}", "stdout") \
                if not quiet and jax.process_index() == 0 else contextlib.nullcontext():
            return _train(cfg, layout, quiet, make_eval, bucket, run_dir, started, doing, compiler_options)


def check_outputs(run_dir) -> None:
    """Refuse, before anything is written, a run directory whose outputs cannot be written where they go (or
    where a symbolic link waits for one)."""
    writable_dir(run_dir, "output_dir")
    run = RunDir(run_dir)
    run.refuse_links()
    for path, directory in ((run.checkpoints, True), (run.tensorboard, True), (run.metrics, False)):
        if path.exists() and path.is_dir() != directory:
            raise ConfigError(f"{path} is a {'file' if directory else 'directory'}; the run writes a "
                              f"{'directory' if directory else 'file'} there: move it away or set another output_dir")


def _train(cfg: RunConfig, layout: Layout, quiet: bool, make_eval, bucket: BucketRun | None, run_dir: Path, started,
           doing: list[str], compiler_options: dict | None) -> list[dict]:
    goodput = Goodput(run_dir, started, enabled=jax.process_index() == 0)
    micro_rows = micro_batch_rows(cfg, layout.data_parallel_size)
    # Bad data fails first, before the model is built.
    loader = build_loader(cfg.data, global_batch_instances=cfg.train.global_batch_instances,
                          vocab_size=cfg.model.vocab_size, process_index=jax.process_index(),
                          process_count=jax.process_count())
    own_copy = bucket is not None and jax.process_count() > 1
    # Each process of a multi-process run in a bucket writes and uploads its own copy synchronously: Orbax's
    # asynchronous write of such copies lost its own temporary meta directory under load (FileNotFoundError, then
    # the upload barrier timed out; 2026-12-03).
    checkpointer = Checkpointer(RunDir(run_dir).checkpoints, cfg.checkpoint,
                                asynchronous=cfg.checkpoint.asynchronous and not own_copy, own_copy=own_copy)
    saver = AsyncSaver(checkpointer, bucket.push_checkpoint if bucket else None)
    if jax.process_index() == 0:  # it holds the run directory
        for partial in checkpointer.remove_partial_writes():
            log.warning("removed %s: a checkpoint write that did not finish", partial)
    try:
        state, start, restored = restore_or_init(cfg, layout, checkpointer, bucket)
    except BaseException:
        loader.close()
        raise
    tokens_per_step = cfg.train.global_batch_instances * cfg.data.sequence_length
    # tokens trained up to step `start`; loader position - step
    where = bucket.remote_step(start) if bucket else checkpointer.where(start)  # not the local staging copy
    tokens_before, data_offset = resume_data(cfg, loader, restored, start, f"checkpoint {where}")
    if restored is not None and not quiet and jax.process_index() == 0:
        print(f"resuming from step {start} (checkpoint {where})", flush=True)
        if change := schedule_change(restored["config"], cfg, start):
            print(change, flush=True)
    step_fn = jit_train_step(cfg, layout, micro_rows, compiler_options)
    if (sched := schedules.schedule_for(cfg)) and not quiet and jax.process_index() == 0:
        print(f"pipeline: {sched.describe()}", flush=True)
    if (cfg.impl.logits_grad == "compute" and compute_dtype(cfg.impl, layout) == jnp.float32 and not quiet
            and jax.process_index() == 0):
        log.warning("impl.logits_grad=compute takes the LM head's gradient in the compute dtype, float32 on these "
                    "devices (impl.compute_dtype auto): it changes nothing here")
    evaluate = make_eval(cfg, layout) if make_eval else None
    sharding = batch_shardings(layout, cfg.data.sequence_length, micro_rows)
    writer = MetricsWriter(run_dir, start, enabled=jax.process_index() == 0)
    wandb = WandbLog(cfg, run_dir, start, enabled=jax.process_index() == 0)
    flops_per_token = flops.count(cfg.model, cfg.data.sequence_length).per_token
    peak = device_peak_flops(np.dtype(compute_dtype(cfg.impl, layout)).name)
    history, pending = [], None
    clock = StepClock()
    mfu_bug_said = False

    def tokens_after(step: int) -> int:
        return tokens_before + (step - start) * tokens_per_step

    def finish(step: int, metrics, eval_metrics: dict, in_flight=None) -> None:
        """Log step `step`; `in_flight` is (step, metrics) of the step dispatched after it, if any."""
        nonlocal mfu_bug_said
        values = {k: v.tolist() if np.ndim(v) else float(v) for k, v in jax.device_get(metrics).items()} | eval_metrics
        seconds = clock.seconds(step)  # asked of every step, the compiled one too: the clock then forgets it
        values.update({
            "throughput/total tokens": tokens_after(step),
            "io/retries": storage.retries(),  # transient bucket faults retried so far (0 on local disk)
        } | goodput.metrics())
        if step == start + 1:  # its time is mostly the compile's: no throughput, a mark instead
            values[COMPILED] = 1.0
            if selfcheck.failed():  # the experts fell back to the block loop (the line on stderr says why)
                values[selfcheck.FAILED] = 1.0
        else:
            values["throughput/device/TPS"] = tps = tokens_per_step / seconds / jax.device_count()
            mfu = None if peak is None else 100.0 * tps * flops_per_token / peak
            if mfu is not None and mfu <= 100.0:
                values["throughput/device/MFU"] = mfu
            elif mfu is not None and not mfu_bug_said:  # a bug, said once; never a figure
                mfu_bug_said = True
                line = (f"olmax: bug: step {step}'s MFU came out at {mfu:.1f}% ({tps:,.0f} tokens/s a device x "
                        f"{flops_per_token / 1e9:.3g} GFLOP a token, against a peak of {peak / 1e9:,.1f} GFLOP/s a "
                        "device): the step's time or the device's peak is wrong; MFU above 100% is left out of the "
                        "metrics. Please report this line")
                log.warning(line)
                if not quiet and jax.process_index() == 0:
                    print(line, file=sys.stderr, flush=True)
        wandb.add(writer.write(step, values))
        wandb.send(saver.committed)
        history.append({"step": step, **values})
        if not np.isfinite(values["train/CE loss"]):  # a skipped spike, or parameters gone for good
            check_finite(state.params, f"train/CE loss {values['train/CE loss']} at step {step}", checkpointer)
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            if not quiet and jax.process_index() == 0:
                print(console_line(step, cfg.train.steps, values), flush=True)
            if bucket:  # uploaded once the step in flight is done, so that the upload is in no step's time
                if in_flight:
                    jax.block_until_ready(in_flight[1])
                writer.flush()
                bucket.push_metrics()

    def acknowledge(signum: int) -> None:  # at once, from a thread: a compile holds the main thread for long
        if not quiet and jax.process_index() == 0:
            print(f"olmax: {signal.Signals(signum).name} received while {doing[0]}: the run stops when that ends, "
                  "after a checkpoint of its last step", file=sys.stderr, flush=True)

    try:
        with preemption_signals(acknowledge) as stop, watching(cfg.train.hang_timeout, ExitCode.PREEMPTED) as watchdog:
            last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
            if start >= last and not quiet and jax.process_index() == 0:
                target = "train.steps" if last == cfg.train.steps else "train.stop_after"
                print(f"nothing to train: the run is at step {start}, at or past {target}={last}; "
                      "raise train.steps to train further", flush=True)
            if start < last and stop_requested(stop):
                raise Preempted(f"stopped by a signal before step {start + 1}; nothing needed writing")
            doing[0] = f"compiling the train step (step {start + 1})"
            if start < last and not quiet and jax.process_index() == 0:
                print("compiling the train step...", flush=True)  # the first step compiles: tens of seconds
            goodput.resumed(start)
            for step in range(start + 1, last + 1):
                rows = next(loader)
                goodput.mark("data wait")
                batch = place_batch(rows, sharding, micro_rows)
                if pending:  # the step before ends before this one is dispatched: each is timed from its own start
                    jax.block_until_ready(pending[1])
                clock.dispatching(step)
                doing[0] = (f"compiling the train step (step {step})" if step == start + 1
                            else f"training: step {step} of {last} running ({cfg.train.log_every} steps a line)")
                state, metrics = step_fn(state, batch)
                clock.dispatched(step, metrics)
                goodput.mark("compilation" if step == start + 1 else "productive")
                if pending:
                    finish(*pending, in_flight=(step, metrics))
                pending = (step, metrics, {})
                stopping = stop_requested(stop)
                watchdog.beat(step)  # every process got here: a collective returned
                save = step % cfg.checkpoint.every == 0 or step == last or stopping
                eval_due = evaluate is not None and evaluate.due(step)
                if eval_due or save:
                    jax.block_until_ready(metrics)
                    if eval_due:
                        goodput.mark("productive")
                        doing[0] = f"evaluating at step {step}"
                        pending[2].update(evaluate(step, state.params))
                        goodput.mark("evaluation")
                    if save:
                        # Step N is logged and on disk before checkpoint N exists: a resume at N keeps steps <= N.
                        finish(*pending)
                        pending = None
                        writer.flush()
                        if bucket:  # the metrics up to step N are in the bucket before checkpoint N is
                            bucket.push_metrics()
                        goodput.mark("productive")
                        check_finite(state.params, f"checked before writing checkpoint {step}", checkpointer)
                        doing[0] = f"writing checkpoint {step} (or waiting for the save before it)"
                        saver.save(step, state, run_meta(cfg, step, loader.state_dict(), tokens_after(step),
                                                         data_offset))
                        goodput.saved(step)
                if stopping:
                    saver.finish()
                    raise Preempted(f"stopped by a signal after step {step}; checkpoint {step} written")
                goodput.step_done(step)
            if pending:
                finish(*pending)
            doing[0] = "finishing the last checkpoint's write"
            saver.finish()
            if last == cfg.train.steps:
                goodput.finished()
    finally:
        clock.close()
        loader.close()
        writer.close()
        try:
            saver.finish()  # the save in flight when an error stopped the run
        finally:
            goodput.mark("checkpoint")  # the last save's write
            wandb.close(saver.committed, failed=sys.exc_info()[0] not in (None, Preempted))
            checkpointer.close()
            goodput.close()
        if bucket:
            bucket.close()
    return history
