"""Checkpoints with Orbax, the one reader and writer (training, evaluation and conversion use it): directory N holds the state after step N completed.

Each checkpoint has the items `params`, `opt_state` (with the skip-step
history) and `meta` (JSON: step, data loader position and fingerprint, seed,
the resolved config). A weights-only checkpoint (converted from HF) has no
`opt_state`. Orbax writes into a temporary directory
and renames it when complete, so an interrupted write never looks like a
checkpoint. Kept: the last `keep_last`, plus every step divisible by `keep_every`.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from olmax.config import CheckpointConfig, ModelConfig, RunConfig

# Model fields that change no parameter shape or value: a resume may change them.
_FREE_MODEL_FIELDS = {"compute_dtype", "remat_save", "attention_block"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message says why and what to do."""


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig, read_only: bool = False):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep_last, keep_period=cfg.keep_every, create=not read_only, read_only=read_only,
            enable_async_checkpointing=False,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("params", "opt_state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """A training checkpoint: params, optimizer state and meta (the step lives in meta)."""
        self._save(step, params=ocp.args.StandardSave(state.params),
                   opt_state=ocp.args.StandardSave(state.opt_state), meta=ocp.args.JsonSave(meta))

    def save_params(self, step: int, params, meta: dict) -> None:
        """A weights-only checkpoint (e.g. converted from HF), usable as `checkpoint.init_from`."""
        self._save(step, params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta))

    def _save(self, step: int, **items) -> None:
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, abstract_state):
        """(TrainState, meta), placed with the shardings of `abstract_state` (a tree of ShapeDtypeStructs)."""
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_state.params),
            opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
            meta=ocp.args.JsonRestore(),
        )
        restored = self.manager.restore(step, args=args)
        step_array = jax.device_put(jnp.int32(restored["meta"]["step"]), abstract_state.step.sharding)
        return type(abstract_state)(step_array, restored["params"], restored["opt_state"]), restored["meta"]

    def restore_params(self, step: int, abstract_params):
        """(params, meta) of any checkpoint, training or weights-only."""
        args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored["params"], restored["meta"]

    def set_aside(self, step: int) -> Path:
        """Rename an unreadable checkpoint out of the way (kept for inspection, never deleted)."""
        target = self.directory / f"{step}.unreadable-{int(time.time())}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        self.manager.reload()
        return target

    def close(self) -> None:
        self.manager.close()


def abstract_like(shardings_tree, shapes_tree):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes_tree, shardings_tree
    )


def check_model_compatible(saved: dict, current: ModelConfig, where: str) -> None:
    """A resume must not change the model's shape or math; name every field that differs."""
    now = current.model_dump(mode="json")
    changed = {k: (saved.get(k), v) for k, v in now.items() if k not in _FREE_MODEL_FIELDS and saved.get(k) != v}
    if changed:
        lines = "\n".join(f"  model.{k}: checkpoint {old!r}, config {new!r}" for k, (old, new) in changed.items())
        raise CheckpointError(
            f"{where} was written by a different model:\n{lines}\n"
            "resume with the checkpoint's model config, or start a new run (a new name/output_dir)"
        )


def run_meta(cfg: RunConfig, step: int, data_state: dict) -> dict:
    return {"step": step, "data": data_state, "seed": cfg.train.seed, "config": cfg.model_dump(mode="json")}
