"""Checkpoints with Orbax: the one reader and writer (training, evaluation and conversion use it).

Directory N holds the state after step N completed: the items `params`,
`opt_state` (with the skip-step history) and `meta` (JSON: step, tokens
trained, data loader position and fingerprint, seed, the resolved config, and
the checksums). A weights-only checkpoint (converted from HF) has no
`opt_state`. Orbax writes into a temporary directory and renames it when
complete, so an interrupted write never looks like a checkpoint. Kept: the
last `keep_last`, plus every step divisible by `keep_every`.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from olmax.errors import BadInput
from olmax.config import CheckpointConfig, ConfigError, ModelConfig, RunConfig, upgrade, validate
from olmax.runtime import GLIBC

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter
HASH_SEED = 0x9E3779B9
CHECKSUM = "fmix32-sum-and-position-sum"  # what `checksums` computes; recorded, so that a future one can differ


class CheckpointError(BadInput):
    """A checkpoint that cannot be used for this run; the message says why and what to do."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read or do not match their checksums (a torn or corrupted write)."""


class DiskFull(Exception):
    """The disk filled up while a checkpoint was written; its partial write was removed."""

    exit_code = 74  # EX_IOERR; `olmax launch` does not retry it: only freeing space helps


def _disk_full(err: BaseException | None) -> bool:
    """Whether `err` or what caused it is ENOSPC (TensorStore reports it inside a ValueError's text)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


# --- checksums -------------------------------------------------------------------------------------


def _fmix32(h):
    """MurmurHash3's finalizer: a bijection of uint32 under which each input bit flips each output bit with
    probability about 1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _digest(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two uint32 sums (wrapping): of a hash of each element's bits, and of the same times 2 x its flat index + 1.
    A changed element changes the first (the hash is a bijection), moved ones the second. One variadic reduce
    makes it one pass over memory (two sums were two, and 7 to 14x slower on XLA's CPU backend)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize not in (1, 2, 4):
        raise TypeError(f"no checksum for {x.dtype} arrays")
    words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    hashed = _fmix32(words ^ jnp.uint32(HASH_SEED))
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for axis in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    zero = jnp.uint32(0)
    return jax.lax.reduce((hashed, hashed * (index * jnp.uint32(2) + jnp.uint32(1))), (zero, zero),
                          lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(x.ndim)))


_digests = jax.jit(lambda arrays: [_digest(x) for x in arrays])


def checksums(tree) -> dict[str, str]:
    """Tree path -> checksum of each array of `tree` (jax arrays, sharded anyhow, or host numpy arrays)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    paths, arrays = [path for path, _ in leaves], [x for _, x in leaves]
    if all(isinstance(x, jax.Array) for x in arrays):
        digests = _digests(arrays)
    else:  # host arrays one at a time: at most one of them is copied to the device at once
        digests = [_digests([x])[0] for x in arrays]
    # The lanes are scalars, the same on every device and process.
    return {jax.tree_util.keystr(path): "".join(f"{int(lane.addressable_data(0)):08x}" for lane in digest)
            for path, digest in zip(paths, digests)}


def _meta_digest(meta: dict) -> str:
    rest = {k: v for k, v in meta.items() if k != "checksums"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


# --- reading Orbax quietly, one host array at a time ---------------------------------------------------


def _ignore_abandoned_io() -> None:
    """After a failed read or write, Orbax closes its event loop while TensorStore's other reads or writes are
    still in flight; their coroutines, tasks and callbacks then fail whenever they are collected (at exit too,
    when imports fail), each printing a traceback (up to hundreds of lines, long after the error was reported):
    through sys.unraisablehook, as asyncio's "exception was never retrieved" errors and as "coroutine ... was
    never awaited" warnings (olmax runs no asyncio code of its own). Those are dropped."""
    previous = sys.unraisablehook
    if getattr(previous, "olmax_ignores_abandoned_reads", False):
        return

    def hook(unraisable) -> None:
        err = unraisable.exc_value
        closed_loop = isinstance(err, RuntimeError) and str(err) == "Event loop is closed"
        abandoned = asyncio.iscoroutine(unraisable.object) and (
            "while reading array index" in str(err) or _disk_full(err) or "Python is likely shutting down" in str(err))
        if not (closed_loop or abandoned):
            previous(unraisable)

    hook.olmax_ignores_abandoned_reads = True
    sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    if _never_retrieved not in asyncio_log.filters:
        asyncio_log.addFilter(_never_retrieved)
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)


def _never_retrieved(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in record.getMessage()


def _reason(err: BaseException) -> str:
    """The first line of the innermost cause: what actually failed (Orbax wraps it in pages of TensorStore spec)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


class _SequentialNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler, writing and reading arrays one after another instead of all at once:
    TensorStore holds an encoded copy of every array in flight, which for all of them is a second model."""

    async def serialize(self, values, infos, args=None):
        self._one_at_a_time = asyncio.Lock()
        return await super().serialize(values, infos, args)

    async def _open_and_write(self, value, tspec, ts_context):
        async with self._one_at_a_time:
            await super()._open_and_write(value, tspec, ts_context)
            if GLIBC:
                GLIBC.malloc_trim(0)  # hand TensorStore's freed encode buffers back before the next array

    async def deserialize(self, infos, args=None):
        args = args or [ocp.RestoreArgs()] * len(infos)
        arrays = []
        for info, arg in zip(infos, args):
            arrays += await super().deserialize([info], [arg])
            if GLIBC:
                GLIBC.malloc_trim(0)
        return arrays


@contextlib.contextmanager
def _quiet_absl(level: int = logging.ERROR):
    """Orbax logs absl WARNINGs about settings it was asked for (read-only options, handler overrides): inside,
    only `level` and above pass."""
    absl = logging.getLogger("absl")
    previous = absl.level
    absl.setLevel(level)
    try:
        yield
    finally:
        absl.setLevel(previous)


@contextlib.contextmanager
def _numpy_one_array_at_a_time():
    """For one synchronous save or restore of numpy arrays: one array at a time, and saved in place (Orbax
    deep-copies them by default, against concurrent mutation; nothing touches them here). With glibc, the
    threads TensorStore starts share one malloc arena meanwhile: with one each, the buffers they free stay
    in their arenas and the peak grows with the model (measured: +1.6x of it for 6 GB instead of +0.2x)."""
    default = ocp.type_handlers.get_type_handler(np.ndarray)
    if GLIBC:
        GLIBC.mallopt(M_ARENA_MAX, 1)
    with _quiet_absl():
        ocp.type_handlers.register_type_handler(np.ndarray, _SequentialNumpyHandler(deepcopy_host_arrays=False),
                                                override=True)
        try:
            yield
        finally:
            ocp.type_handlers.register_type_handler(np.ndarray, default, override=True)
            if GLIBC:
                GLIBC.mallopt(M_ARENA_MAX, 0)  # glibc's default: up to 8 arenas per core


def _on_host(tree) -> bool:
    return any(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree))


# --- the checkpointer ------------------------------------------------------------------------------


class Checkpointer:
    """The checkpoints of one directory. Nothing is created on disk before the first save."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, read_only: bool = False):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else cfg.keep_last, keep_period=cfg.keep_every,
            save_interval_steps=0 if read_only else 1, create=False, read_only=read_only,
            enable_async_checkpointing=False,
        )
        with _quiet_absl():
            self.manager = ocp.CheckpointManager(self.directory, options=options,
                                                 item_names=("params", "opt_state", "meta"))

    def where(self, step: int) -> Path:
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """A training checkpoint: params, optimizer state and meta (the step lives in meta)."""
        self._save(step, meta, params=state.params, opt_state=state.opt_state)

    def save_params(self, step: int, params, meta: dict) -> None:
        """A weights-only checkpoint (e.g. converted from HF), usable as `checkpoint.init_from`."""
        self._save(step, meta, params=params)

    def _save(self, step: int, meta: dict, **arrays) -> None:
        sums = {name: checksums(tree) for name, tree in arrays.items()}
        meta = {**meta, "checksums": {"kind": CHECKSUM, **sums, "meta": _meta_digest(meta)}}
        items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        host = _numpy_one_array_at_a_time() if _on_host(arrays) else contextlib.nullcontext()
        _ignore_abandoned_io()
        try:
            # Orbax's threads log each failed write as an absl ERROR; the exception below says it once.
            with host, _quiet_absl(logging.CRITICAL):
                self.manager.save(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)), force=True)
                self.manager.wait_until_finished()
        except Exception as err:
            if not _disk_full(err):
                raise
            self.remove_partial_writes()
            raise DiskFull(f"disk full writing checkpoint {step} in {self.directory}: free space and run "
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
        if saved is not None and saved != _meta_digest(meta):
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
        host = _numpy_one_array_at_a_time() if _on_host(abstract_params) else contextlib.nullcontext()
        with host:
            params = self._restore(step, params=ocp.args.StandardRestore(abstract_params))["params"]
        self._verify(step, meta, params=params)
        return params, meta

    def _restore(self, step: int, **items):
        _ignore_abandoned_io()  # before the read: a failed one's leftovers may be collected before it returns
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:  # Orbax, TensorStore and JSON errors alike: the files are not what was written
            raise UnreadableCheckpoint(f"checkpoint {self.where(step)} is unreadable ({_reason(err)})") from err

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

    def set_aside(self, step: int) -> Path:
        """Rename an unreadable checkpoint out of the way (kept for inspection, never deleted)."""
        target = self.directory / f"{step}.unreadable-{int(time.time())}"
        if jax.process_index() == 0:
            self.where(step).rename(target)
        self.manager.reload()
        return target

    def close(self) -> None:
        self.manager.close()


def locate(path: str | Path) -> tuple[Path, int | None]:
    """(checkpoints directory, step or None for its latest) of a run directory (its `checkpoints/`), a
    checkpoints directory, or one step of it (`.../checkpoints/N`)."""
    path = Path(path)
    kinds = "a run directory, its checkpoints/ or one step of it (checkpoints/N)"
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give {kinds}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not an olmax checkpoint; give {kinds}")
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if path.name.isdigit():
        return path.parent, int(path.name)
    return path, None


def read_params(path: str | Path, params_like, step: int | None = None) -> tuple[RunConfig, dict, int]:
    """(config, params, step) of a checkpoint (see `locate`), training or weights-only, its latest step by
    default. `params_like(cfg)` gives the tree to restore into: numpy arrays (np.empty touches no memory)
    are filled on the host one at a time, whatever the sharding the checkpoint was written with."""
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
