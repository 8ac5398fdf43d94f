"""The models an evaluation reads (olmax checkpoints or HF directories: `olmax.eval.cli.load_model`), placed on
a mesh."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from olmax.config import MeshConfig, RunConfig
from olmax.model import families
from olmax.parallel.mesh import Layout, make_layout


@dataclass
class Model:
    name: str  # what was loaded, for reports: a path, with the step of an olmax checkpoint
    cfg: RunConfig
    params: dict


def eval_layout() -> Layout:
    """All devices on the fsdp axis: any checkpoint evaluates on any machine."""
    return make_layout(MeshConfig())


def place(cfg: RunConfig, params: dict, layout: Layout) -> dict:
    return jax.device_put(params, layout.shardings(families.param_axes(cfg.model), params))


def batch_rows(requested: int, layout: Layout, microbatches: int = 1) -> int:
    """Rows per batch: `requested` rounded up to a multiple of the data-parallel size (times the pipeline's
    micro-batches, on a stage mesh)."""
    multiple = layout.data_parallel_size * microbatches
    return -(-requested // multiple) * multiple


def put_batch(arrays: tuple, layout: Layout) -> tuple:
    """Host arrays [B, ...] (the same on every process) -> global arrays sharded over the batch axes."""
    def one(x):
        sharding = layout.sharding(("batch",) + ("length",) * (x.ndim - 1), x.shape)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return tuple(one(x) for x in arrays)
