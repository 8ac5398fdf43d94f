"""The weights of an olmax checkpoint, in the model's parameter tree as numpy arrays on the host: what
conversion, logit parity and evaluation read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from olmax.checkpoint import read_params
from olmax.config import RunConfig
from olmax.model import families


@dataclass
class Model:
    """Weights with their config (olmax.interop.hf.load_model reads one from an olmax checkpoint or HF directory)."""

    name: str  # what was loaded, for reports: a path, with the step of an olmax checkpoint
    cfg: RunConfig
    params: dict


def load_olmax(ckpt: str | Path, step: int | None = None) -> tuple[RunConfig, dict, int]:
    """(config, params as numpy arrays, step) of an olmax checkpoint (a run directory, its checkpoints/ or one
    step of it), training or weights-only."""
    def host_arrays(cfg: RunConfig) -> dict:
        return jax.tree.map(lambda shape: np.empty(shape, cfg.model.param_dtype), families.param_shapes(cfg.model),
                            is_leaf=lambda s: isinstance(s, tuple))
    return read_params(ckpt, host_arrays, step)
