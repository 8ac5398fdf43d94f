"""The models an evaluation reads: olmax checkpoints or HF directories, placed on a mesh."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax.config import MeshConfig, RunConfig
from olmax.model import olmo3
from olmax.parallel.mesh import data_parallel_size, logical_spec, make_mesh, shardings


class EvalError(ValueError):
    """An evaluation that cannot run as asked; the message says why and what to do."""


@dataclass
class Model:
    name: str  # what was loaded, for reports: a path, with the step of an olmax checkpoint
    cfg: RunConfig
    params: dict


def load_model(path: str | Path) -> Model:
    """An HF Olmo3 directory (config.json + safetensors), an olmax checkpoint directory (its latest
    step), one step of it (`.../checkpoints/STEP`), or a run directory (its `checkpoints/`)."""
    from olmax.interop.hf import load_hf_params, load_olmax, read_hf_config, run_config_from_hf

    path = Path(path)
    if not path.exists():
        raise EvalError(f"{path} does not exist; give an olmax checkpoint or run directory, or an HF model directory")
    if (path / "config.json").is_file():
        cfg = run_config_from_hf(read_hf_config(path), name=path.absolute().name, where=str(path / "config.json"))
        return Model(str(path), cfg, load_hf_params(path, cfg))
    step = None
    if path.name.isdigit() and (path / "meta").exists():
        path, step = path.parent, int(path.name)
    elif (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    cfg, params, step = load_olmax(path, step)
    return Model(f"{path}/{step}", cfg, params)


def eval_mesh() -> Mesh:
    """All devices on the fsdp axis: any checkpoint evaluates on any machine."""
    return make_mesh(MeshConfig())


def place(cfg: RunConfig, params: dict, mesh: Mesh) -> dict:
    return jax.device_put(params, shardings(olmo3.param_axes(cfg.model), params, mesh))


def batch_rows(requested: int, mesh: Mesh) -> int:
    """Rows per batch: `requested` rounded up to a multiple of the data-parallel size."""
    dp = data_parallel_size(mesh)
    return -(-requested // dp) * dp


def put_batch(arrays: tuple, mesh: Mesh) -> tuple:
    """Host arrays [B, ...] (the same on every process) -> global arrays sharded over the batch axes."""
    def one(x):
        sharding = NamedSharding(mesh, logical_spec(("batch",) + ("length",) * (x.ndim - 1), x.shape, mesh))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return tuple(one(x) for x in arrays)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
