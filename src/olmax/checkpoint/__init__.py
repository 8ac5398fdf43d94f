"""Checkpoints with Orbax: the one reader and writer (training, evaluation and conversion use it).

Directory N holds the state after step N completed: the items `params`,
`opt_state` (with the skip-step history) and `meta` (JSON: step, tokens
trained, data loader position and fingerprint, seed, the resolved config, and
the checksums). A weights-only checkpoint (converted from HF) has no
`opt_state`. Orbax writes into a temporary directory and renames it when
complete, so an interrupted write never looks like a checkpoint. Kept: the
last `keep_last`, plus every step divisible by `keep_every` (`retained`).

Every array (params, optimizer state) gets a checksum when it is written, and
so does the rest of the meta (the loader state among it); every read verifies
them. A checkpoint whose files changed after they were written (a flipped bit,
a truncated file) is an `UnreadableCheckpoint`, as one that Orbax cannot read:
training sets it aside and falls back to the one before it. An array's
checksum is two sums modulo 2**32 over its elements, of a hash of each one's
bits, unweighted and weighted by its position. Integer sums do not depend on
the order of the additions, so it is computed where the array lives, sharded
over any devices and hosts, in one pass over its memory, and has the same
value on any number of devices (a resume on another topology verifies the same
numbers).

Its parts: `checksums.py` (the checksums), `orbax_io.py` (Orbax quiet and one host array at a time, disk-full
detection), `remote.py` (the committed steps of a checkpoint in a bucket), `async_save.py` (a save written
beside the training); here the `Checkpointer`, which steps are kept (`retained`), and the run helpers (`locate`,
`read_params`, `check_model_compatible`, `run_meta`). The errors are olmax.errors'.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from olmax import storage
from olmax.errors import CheckpointError, DiskFull, UnreadableCheckpoint
from olmax.config import CheckpointConfig, ConfigError, ModelConfig, RunConfig, upgrade, validate
from olmax.run_dir import RunDir, committed_steps
from olmax.checkpoint.checksums import CHECKSUM, checksums, meta_digest
from olmax.checkpoint.orbax_io import (
    disk_full, ignore_abandoned_io, numpy_one_array_at_a_time, on_host, quiet_absl, quiet_absl_from_now, reason,
)
from olmax.checkpoint.remote import local_step

log = logging.getLogger(__name__)


def retained(steps, cfg: CheckpointConfig) -> set[int]:
    """Which of `steps` the retention rule keeps: the last `keep_last`, and every one divisible by `keep_every`
    (Orbax's max_to_keep and keep_period, as the Checkpointer asks for them)."""
    steps = sorted(steps)
    return set(steps[-cfg.keep_last:]) | {s for s in steps if cfg.keep_every and s % cfg.keep_every == 0}


class Checkpointer:
    """The checkpoints of one directory. Nothing is created on disk before the first save.

    `own_copy`: each process of a multi-process run writes and reads a directory of its own, not one they
    share (a run in a bucket stages on each host's disk): Orbax's steps across processes are off, and arrays
    are zarr chunk files, one per shard, written by the process that holds the shard, so that the copies
    uploaded side by side make the whole checkpoint (OCDBT's per-process files would need one process to
    read all of them to merge them).


    `asynchronous`: `save` returns once the state is copied to host memory and Orbax writes it in the
    background; `finish` waits for that write (olmax.checkpoint.async_save drives it)."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, read_only: bool = False, own_copy: bool = False,
                 asynchronous: bool = False):
        self.directory = Path(directory).absolute()
        self.own_copy, self.asynchronous = own_copy, asynchronous
        self._writing, self._failed = None, False  # the step of the last save; whether a save failed
        processes = ocp.options.MultiprocessingOptions(
            **({"primary_host": None, "active_processes": {jax.process_index()}} if own_copy else {}))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else cfg.keep_last, keep_period=cfg.keep_every,
            save_interval_steps=0 if read_only else 1, create=False, read_only=read_only,
            enable_async_checkpointing=asynchronous, multiprocessing_options=processes,
        )
        items = {"item_names": ("params", "opt_state", "meta")}
        if own_copy:
            registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
            for name in ("params", "opt_state"):
                arrays = ocp.StandardCheckpointHandler(use_ocdbt=False, multiprocessing_options=processes)
                registry.add(name, ocp.args.StandardSave, arrays)
                registry.add(name, ocp.args.StandardRestore, arrays)
            meta = ocp.JsonCheckpointHandler(multiprocessing_options=processes)
            registry.add("meta", ocp.args.JsonSave, meta)
            registry.add("meta", ocp.args.JsonRestore, meta)
            items = {"handler_registry": registry}
        with quiet_absl():
            self.manager = ocp.CheckpointManager(self.directory, options=options, **items)

    def where(self, step: int) -> Path:
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)

    def all_steps(self) -> list[int]:
        return committed_steps(self.directory)

    def save(self, step: int, state, meta: dict) -> None:
        """A training checkpoint: params, optimizer state and meta (the step lives in meta). Asynchronous: it
        returns once the arrays are on the host; `finish` waits for the write."""
        self._save(step, meta, params=state.params, opt_state=state.opt_state)
        if not self.asynchronous:
            self.finish()

    def save_params(self, step: int, params, meta: dict) -> None:
        """A weights-only checkpoint (e.g. converted from HF), usable as `checkpoint.init_from`."""
        self._save(step, meta, params=params)
        self.finish()

    def _save(self, step: int, meta: dict, **arrays) -> None:
        sums = {name: checksums(tree) for name, tree in arrays.items()}
        meta = {**meta, "checksums": {"kind": CHECKSUM, **sums, "meta": meta_digest(meta)}}
        items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        host = numpy_one_array_at_a_time() if on_host(arrays) else contextlib.nullcontext()
        ignore_abandoned_io()
        self._writing = step
        with self._disk_full_named():
            # Orbax's threads log each failed write as an absl ERROR; the exception below says it once.
            with host, quiet_absl(logging.CRITICAL):
                self.manager.save(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)), force=True)

    def finish(self) -> None:
        """Wait until the last save is written and committed (at once for a synchronous one); its error if
        it failed (DiskFull, its partial write removed, for a full disk)."""
        with self._disk_full_named(), quiet_absl(logging.CRITICAL):
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _disk_full_named(self):
        try:
            yield
        except Exception as err:
            self._failed = True
            quiet_absl_from_now()
            if not disk_full(err):
                raise
            self.remove_partial_writes()
            raise DiskFull(f"disk full writing checkpoint {self._writing} in {self.directory}: free space and run "
                           "again") from None

    def remove_partial_writes(self) -> list[Path]:
        """Remove the temporary directories of checkpoint writes that did not finish (a crash, a full disk);
        the ones removed. Only for the one process that writes this directory (the run directory's holder)."""
        partial = sorted(self.directory.glob("*.orbax-checkpoint-tmp*"))
        for path in partial:
            shutil.rmtree(path, ignore_errors=True)
        return partial

    def read_meta(self, step: int) -> dict:
        meta = self._restore(step, meta=ocp.args.JsonRestore())["meta"]
        if not isinstance(meta, dict) or not {"step", "config"} <= set(meta):
            raise UnreadableCheckpoint(f"checkpoint {self.where(step)}: its meta lacks the step or the config")
        saved = meta.get("checksums", {}).get("meta")
        if saved is not None and saved != meta_digest(meta):
            raise UnreadableCheckpoint(f"checkpoint {self.where(step)}: the checksum of its meta differs from the "
                                       "one written with it (the file changed since)")
        return meta

    def restore(self, step: int, abstract_state):
        """(TrainState, meta), placed with the shardings of `abstract_state` (a tree of ShapeDtypeStructs)."""
        meta = self.read_meta(step)
        restored = self._restore(step, params=ocp.args.StandardRestore(abstract_state.params),
                                 opt_state=ocp.args.StandardRestore(abstract_state.opt_state))
        self._verify(step, meta, params=restored["params"], opt_state=restored["opt_state"])
        step_array = jax.device_put(jnp.int32(meta["step"]), abstract_state.step.sharding)
        return type(abstract_state)(step_array, restored["params"], restored["opt_state"]), meta

    def restore_params(self, step: int, abstract_params):
        """(params, meta) of any checkpoint, training or weights-only; numpy targets are read one at a time."""
        meta = self.read_meta(step)
        host = numpy_one_array_at_a_time() if on_host(abstract_params) else contextlib.nullcontext()
        with host:
            params = self._restore(step, params=ocp.args.StandardRestore(abstract_params))["params"]
        self._verify(step, meta, params=params)
        return params, meta

    def _restore(self, step: int, **items):
        ignore_abandoned_io()  # before the read: a failed one's leftovers may be collected before it returns
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:  # Orbax, TensorStore and JSON errors alike: the files are not what was written
            raise UnreadableCheckpoint(f"checkpoint {self.where(step)} is unreadable ({reason(err)})") from err

    def _verify(self, step: int, meta: dict, **arrays) -> None:
        saved = meta.get("checksums", {})
        if saved.get("kind") != CHECKSUM:
            log.warning("checkpoint %s has no checksums olmax computes (written by an older olmax); not verified",
                        self.where(step))
            return
        for name, tree in arrays.items():
            now, then = checksums(tree), saved.get(name, {})
            bad = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
            if bad:
                more = f" (and of {len(bad) - 1} more arrays)" if len(bad) > 1 else ""
                raise UnreadableCheckpoint(f"checkpoint {self.where(step)}: the checksum of {name}{bad[0]}{more} "
                                           "differs from the one written with it (its files changed since)")

    def reload(self) -> None:
        """See steps put into the directory from outside (a step copied down from a bucket)."""
        self.manager.reload()

    def set_aside(self, step: int) -> Path:
        """Rename an unreadable checkpoint out of the way (kept for inspection, never deleted)."""
        target = self.directory / f"{step}.unreadable-{int(time.time())}"
        if jax.process_index() == 0 or self.own_copy:
            self.where(step).rename(target)
        self.manager.reload()
        return target

    def close(self) -> None:
        with quiet_absl(logging.CRITICAL):
            try:
                self.manager.close()
            except Exception:
                if not self._failed:  # else Orbax repeats the failed save's error, which was raised already
                    raise


def locate(path: str | Path) -> tuple[Path, int | None]:
    """(checkpoints directory, step or None for its latest) of a run directory (its `checkpoints/`), a
    checkpoints directory, or one step of it (`.../checkpoints/N`)."""
    path = Path(path)
    kinds = "a run directory, its checkpoints/ or one step of it (checkpoints/N)"
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give {kinds}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not an olmax checkpoint; give {kinds}")
    if RunDir(path).checkpoints.is_dir():
        return RunDir(path).checkpoints, None
    if path.name.isdigit():
        return path.parent, int(path.name)
    return path, None


def read_params(path: str | Path, params_like, step: int | None = None) -> tuple[RunConfig, dict, int]:
    """(config, params, step) of a checkpoint (see `locate`), training or weights-only, its latest step by
    default. `params_like(cfg)` gives the tree to restore into: numpy arrays (np.empty touches no memory)
    are filled on the host one at a time, whatever the sharding the checkpoint was written with. In a bucket,
    only the step read is copied down (olmax.checkpoint.remote)."""
    if storage.is_remote(path):
        with local_step(str(path), step) as local:
            return read_params(local, params_like)
    directory, located = locate(path)
    checkpointer = Checkpointer(directory, CheckpointConfig(), read_only=True)
    try:
        step = step if step is not None else located if located is not None else checkpointer.latest_step()
        if step is None or step not in checkpointer.all_steps():
            raise CheckpointError(f"{directory} holds no olmax checkpoint" +
                                  (" (no step directory)" if step is None else f" of step {step}"))
        meta = checkpointer.read_meta(step)
        try:
            cfg = validate(upgrade(meta["config"]), source=f"{checkpointer.where(step)} meta config")
        except ConfigError as err:
            raise CheckpointError(str(err)) from None
        params, _ = checkpointer.restore_params(step, params_like(cfg))
    except UnreadableCheckpoint as err:
        raise UnreadableCheckpoint(f"{err}; read another step ({directory}/N) or restore it from a copy") from err
    finally:
        checkpointer.close()
    return cfg, params, step


def check_model_compatible(saved: dict, current: ModelConfig, where: str) -> None:
    """A resume must not change the model (the architecture: every field of `model`; `impl` may change);
    name every field that differs. `saved` is the checkpoint's config."""
    saved = ModelConfig.model_validate(upgrade(saved)["model"]).model_dump(mode="json")
    now = current.model_dump(mode="json")
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if changed:
        lines = "\n".join(f"  model.{k}: checkpoint {old!r}, config {new!r}" for k, (old, new) in changed.items())
        raise CheckpointError(
            f"{where} was written by a different model:\n{lines}\n"
            "resume with the checkpoint's model config, or start a new run (a new name/output_dir)"
        )


def run_meta(cfg: RunConfig, step: int, data_state: dict, tokens: int = 0, data_offset: int = 0) -> dict:
    """`tokens`: trained up to this step; `data_offset`: the loader's position minus the step, constant while
    the global batch size is (a new size rescales the position by tokens processed)."""
    return {"step": step, "tokens": tokens, "data": data_state, "data_offset": data_offset, "seed": cfg.train.seed,
            "config": cfg.model_dump(mode="json")}
