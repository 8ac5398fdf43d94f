"""Where a run's state comes from: the latest readable checkpoint of the run (resume), another run's
checkpoint (a warm start: stage 2 from stage 1, or a converted HF model), or a fresh init; and the checks
that a checkpoint fits the model being trained.
"""

from __future__ import annotations

import logging

import jax

from olmax import storage
from olmax.checkpoint import remote
from olmax.checkpoint import Checkpointer, CheckpointError, UnreadableCheckpoint, check_model_compatible, locate
from olmax.config import ModelConfig, RunConfig, ScheduleConfig, upgrade
from olmax.model import families
from olmax.parallel.mesh import Layout
from olmax.train.optimizer import lr_at
from olmax.train.step import TrainState, abstract_state, create_state

log = logging.getLogger(__name__)


def _restore(cfg: RunConfig, layout: Layout, checkpointer: Checkpointer, step: int):
    where = f"checkpoint {checkpointer.where(step)}"
    meta = checkpointer.read_meta(step)
    check_model_compatible(meta["config"], cfg.model, where)
    state, meta = checkpointer.restore(step, abstract_state(cfg, layout))
    if meta["step"] != step:
        raise CheckpointError(f"{where} holds step {meta['step']}; the directory is misnamed or corrupt")
    return state, meta


def restore_or_init(cfg: RunConfig, layout: Layout, checkpointer: Checkpointer, bucket=None):
    """(state, step, meta or None): the latest readable checkpoint when resuming, else a fresh state.

    An unreadable checkpoint (a torn or corrupted write, files that do not match their checksums) falls
    back to the one before it with a warning; a checkpoint of a different model is an error, not a fallback.
    A run in a bucket (`bucket`, olmax.train.bucket_run.BucketRun) has copied down only its newest step: an
    older one is copied down when the fallback comes to it.
    """
    steps = (bucket.steps if bucket else checkpointer.all_steps()) if cfg.checkpoint.resume else []
    unreadable = []
    for step in reversed(steps):
        if bucket and step not in checkpointer.all_steps():
            bucket.fetch(step)
            checkpointer.reload()
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
        with remote.local_step(cfg.checkpoint.init_from) as local:
            return warm_start(cfg, layout, str(local)), 0, None
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
            state, _ = checkpointer.restore(step, abstract_state(cfg, layout))
            return TrainState(fresh.step, state.params, fresh.opt_state._replace(inner=state.opt_state.inner))
        params, _ = checkpointer.restore_params(step, abstract_state(cfg, layout).params)
        return fresh._replace(params=params)
    except UnreadableCheckpoint as err:
        raise UnreadableCheckpoint(f"checkpoint.init_from: {err}; set it to another step ({directory}/N) or restore "
                                   "it from a copy") from err
    finally:
        checkpointer.close()


def resume_data(cfg: RunConfig, loader, meta: dict | None, step: int, where: str) -> tuple[int, int]:
    """Set the loader to the data position of the checkpoint of `step` (meta None: a fresh run); (tokens trained
    up to `step`, loader position - step). The offset is constant while the global batch size is (a new size
    rescales the position by tokens, as OLMo-core): a checkpoint whose position disagrees is refused."""
    if meta is None:
        return 0, 0
    data = meta["data"]
    loader.load_state_dict(data)
    tokens = meta.get("tokens", step * data["global_batch_instances"] * data["sequence_length"])
    data_offset = loader.step - step
    if data["global_batch_instances"] == cfg.train.global_batch_instances and data_offset != meta.get("data_offset", 0):
        raise CheckpointError(
            f"{where}: data position {loader.step} batches is not step {step} + the offset "
            f"{meta.get('data_offset', 0)} written with it, so the next step would not train on the next batch; "
            "restore the checkpoint from a copy, or move it away to resume from the one before"
        )
    return tokens, data_offset


def schedule_change(saved: dict, cfg: RunConfig, step: int) -> str | None:
    """What changed in the LR schedule since the checkpoint's config, with the LR of the next step under both
    (a longer train.steps stretches the decay's horizon: the LR jumps); None when nothing did."""
    try:
        before = ScheduleConfig.model_validate(saved["schedule"])
        peak_before, steps_before = saved["optim"]["lr"], saved["train"]["steps"]
    except (KeyError, ValueError):  # a config of an older olmax, schedule keys since changed: nothing to compare
        return None
    horizon_before = before.horizon_steps or steps_before
    horizon = cfg.schedule.horizon_steps or cfg.train.steps
    changes = [f"schedule.{k} {v!r} -> {getattr(cfg.schedule, k)!r}" for k, v in before if k != "horizon_steps"
               and v != getattr(cfg.schedule, k)]
    if peak_before != cfg.optim.lr:
        changes.append(f"optim.lr {peak_before!r} -> {cfg.optim.lr!r}")
    if horizon_before != horizon:
        changes.append(f"horizon {horizon_before} -> {horizon} steps")
    if not changes:
        return None
    lr_before = float(lr_at(before, peak_before, steps_before, step + 1))
    lr_now = float(lr_at(cfg.schedule, cfg.optim.lr, cfg.train.steps, step + 1))
    return (f"the LR schedule changed since the checkpoint ({', '.join(changes)}): the LR of step {step + 1} is "
            f"{lr_now:.4e}, {lr_before:.4e} under the checkpoint's schedule")
