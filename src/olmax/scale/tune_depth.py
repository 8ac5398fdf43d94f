"""Depth-reduced compiles: a layout's peak memory and step time from compiles at two depths of its repeated
layers, on the line through them (a step is its layers repeated: what the layers add grows with their number,
what is outside them stays), so that `olmax tune` can try a deep model's layouts for the price of shallow
compiles; it confirms the best by a full compile, and relies on the extrapolation while that misses by at most
TRUSTED."""

from __future__ import annotations

from olmax.config import RunConfig
from olmax.parallel import schedules

TRUSTED = 0.05  # the most an extrapolation may miss a full compile's peak or step by for the search to rely on it


def depths(cfg: RunConfig) -> tuple[int, int] | None:
    """The two depths a depth-reduced compile of `cfg` runs at: the dense layers and one, then two, units of the
    repeated stack (a layer_pattern period in each pipeline stage's each chunk, so the schedule is the same), or
    None where that saves little (the stack is under four units deep)."""
    schedule = schedules.schedule_for(cfg)
    unit = len(cfg.model.layer_pattern) * (schedule.stages * schedule.repeats if schedule else 1)
    base = cfg.model.dense_layers
    return None if cfg.model.n_layers - base < 4 * unit else (base + unit, base + 2 * unit)


def at_depth(cfg: RunConfig, layers: int) -> RunConfig:
    """`cfg` with `layers` layers, its pipeline's chunks a stage kept (the schedule's repeats fixed)."""
    schedule = schedules.schedule_for(cfg)
    update = {"model": cfg.model.model_copy(update={"n_layers": layers})}
    if schedule and schedule.repeats > 1:
        update["impl"] = cfg.impl.model_copy(update={"pipeline": cfg.impl.pipeline.model_copy(
            update={"repeats": schedule.repeats})})
    return cfg.model_copy(update=update)


def extrapolated(layers: int, at: tuple[int, int] | None, figures: list[float]) -> float:
    """A figure at `layers` from the same figure at the two depths `at`, on the line through them (a step is its
    layers repeated: what the layers add grows with their number, what is outside them stays); the figure
    itself where there was one compile at full depth."""
    if at is None:
        return figures[0]
    (a, b), (fa, fb) = at, figures
    return fa + (fb - fa) * (layers - a) / (b - a)


def trusted(error: dict) -> bool:
    return all(e is not None and abs(e) <= TRUSTED for e in error.values())
