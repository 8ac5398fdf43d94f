"""Pipeline schedules over the `stage` mesh axis: when each stage runs which layer chunk on which micro-batch,
what it keeps for the backward pass, and what each schedule needs of the config (checked when a config is
validated). The arithmetic the config, the train step, the plan and the layout pages use; olmax.parallel.pipeline
runs a schedule inside the jitted step.

The layer stack [L, ...] is cut into S x R chunks of consecutive layers; chunk c runs on stage c mod S,
so each stage holds R chunks (R = 1: GPipe; R > 1: the circular, or interleaved, schedule). A batch is
cut into M micro-batches. Every iteration, all stages run their chunk at once on the micro-batch in
front of them, then the outputs move one stage on. Stage s works on micro-batch m, pass r at
iteration t = r M + m + s, so a step takes M R + S - 1 iterations of which each stage idles S - 1:

    bubble = (S - 1) / (M R + S - 1)

GPipe and the circular schedule leave the backward pass to autodiff, which keeps all M micro-batches'
activations; the 1F1B schedules (1f1b, interleaved_1f1b) schedule the backward by hand, with the loss inside the
pipeline, and keep a bounded number of chunk inputs per stage (`Ticks`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from olmax.config import ConfigError, RunConfig

@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule over S stages of M micro-batches per train micro-step, each stage holding R layer
    chunks. Each named schedule below says when a stage runs which chunk on which micro-batch (`ticks`), what
    a stage keeps for the backward pass (`in_flight`), what it needs of the config (`for_config`, run when a
    config is validated) and whether it computes each micro-batch's loss inside the pipeline (`loss_inside`:
    then the train step asks it for the loss and its gradient, olmax.parallel.pipeline.run_1f1b; else the
    layers' outputs come back, pipeline.run, and autodiff does the backward)."""

    stages: int  # S
    microbatches: int  # M, per train micro-step
    repeats: int = 1  # R, layer chunks per stage
    name: ClassVar[str]  # impl.pipeline.schedule
    loss_inside: ClassVar[bool] = False

    @property
    def iterations(self) -> int:
        """Forward iterations per stage (1F1B: as many backward ones again, see Ticks)."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of each stage's iterations spent idle."""
        return (self.stages - 1) / self.iterations

    @property
    def chunks(self) -> int:
        return self.stages * self.repeats

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations a stage keeps at once: all M of them when the backward pass is
        autodiff's."""
        return self.microbatches

    @property
    def title(self) -> str:
        return "GPipe"

    def kept(self) -> str:
        return f"all {self.microbatches} micro-batches' activations kept"

    def ticks(self) -> Ticks:
        """The tick table: stage s runs micro-batch m's pass r at tick r M + m + s; no backward ticks (autodiff's)."""
        return _forward_ticks(self.stages, self.microbatches, self.repeats)

    def describe(self) -> str:
        return (f"{self.stages} stages ({self.title}), {self.microbatches} micro-batches per micro-step: "
                f"bubble {self.bubble:.1%} ({self.stages - 1} of {self.iterations} iterations per stage); "
                f"{self.kept()}")

    @classmethod
    def repeats_for(cls, cfg: RunConfig, groups: int, microbatches: int) -> int:
        """R for the config (`groups` layer_pattern periods), after the schedule's own checks."""
        return 1

    @classmethod
    def for_config(cls, cfg: RunConfig) -> Schedule:
        """The config's schedule; ConfigError naming the field and the fix when the config cannot run it."""
        stages, microbatches = cfg.mesh.stage, cfg.impl.pipeline.microbatches or cfg.mesh.stage
        if cfg.model.dense_layers:
            raise ConfigError(f"model.dense_layers {cfg.model.dense_layers}: a pipeline runs one stack of like "
                              "layers over its stages; use dense_layers 0 with mesh.stage > 1")
        groups = cfg.model.n_layers // len(cfg.model.layer_pattern)
        repeats = cls.repeats_for(cfg, groups, microbatches)
        if groups % (stages * repeats):
            raise ConfigError(
                f"model.n_layers {cfg.model.n_layers} is {groups} layer_pattern periods, not divisible into mesh.stage "
                f"{stages} x {repeats} layer chunks per stage; change mesh.stage or impl.pipeline.repeats")
        return cls(stages, microbatches, repeats)


class GPipe(Schedule):
    """One chunk of consecutive layers per stage."""

    name = "gpipe"


class Circular(Schedule):
    """R chunks per stage, the micro-batches going round the stages R times: a bubble R times smaller."""

    name = "circular"
    single_chunk: ClassVar[str] = "gpipe"  # the schedule of one chunk per stage with the same backward

    @property
    def title(self) -> str:
        return f"circular, {self.repeats} layer chunks per stage"

    @classmethod
    def repeats_for(cls, cfg: RunConfig, groups: int, microbatches: int) -> int:
        stages, repeats = cfg.mesh.stage, cfg.impl.pipeline.repeats or groups // cfg.mesh.stage
        if repeats < 2:
            raise ConfigError(
                f"the {cls.name} schedule needs 2 or more layer chunks per stage, but model.n_layers "
                f"{cfg.model.n_layers} is {groups} layer_pattern periods for mesh.stage {stages}; use schedule "
                f"{cls.single_chunk}")
        if microbatches < stages:
            raise ConfigError(f"impl.pipeline.microbatches {microbatches} < mesh.stage {stages}: the {cls.name} "
                              "schedule needs at least one micro-batch per stage; raise it")
        return repeats


class OneFOneB(Schedule):
    """GPipe's chunks with each micro-batch's backward run as soon as its loss is known: a stage keeps a bounded
    number of stage inputs, not M micro-batches' activations, and recomputes its chunk in the backward."""

    name = "1f1b"
    loss_inside = True

    @property
    def title(self) -> str:
        return "1F1B"

    @property
    def in_flight(self) -> int:
        """The most stage inputs a stage holds (see Ticks)."""
        return self.ticks().slots

    def kept(self) -> str:
        return f"up to {self.in_flight} stage inputs kept per stage (the backward recomputes its chunk)"

    def ticks(self) -> Ticks:
        return _ticks(self.stages, self.microbatches, self.repeats)

    @classmethod
    def repeats_for(cls, cfg: RunConfig, groups: int, microbatches: int) -> int:
        if cfg.model.moe is not None and cfg.model.moe.routing == "random":
            raise ConfigError(f"impl.pipeline.schedule {cls.name} runs learned routing (model.moe.routing=random's "
                              "per-layer keys are not in its hand-scheduled backward); use gpipe or circular")
        return super().repeats_for(cfg, groups, microbatches)


class InterleavedOneFOneB(OneFOneB, Circular):
    """The circular schedule's chunks with 1F1B's backward, the micro-batches in groups of one per stage."""

    name = "interleaved_1f1b"
    single_chunk = "1f1b"

    @property
    def title(self) -> str:
        return f"interleaved 1F1B, {self.repeats} layer chunks per stage"

    @classmethod
    def repeats_for(cls, cfg: RunConfig, groups: int, microbatches: int) -> int:
        repeats = super().repeats_for(cfg, groups, microbatches)  # 1F1B's checks, then the circular schedule's
        if microbatches % cfg.mesh.stage:
            raise ConfigError(f"impl.pipeline.microbatches {microbatches} is not a multiple of mesh.stage "
                              f"{cfg.mesh.stage}: interleaved 1F1B runs the micro-batches in groups of one per "
                              "stage; change it")
        return repeats


SCHEDULES = {kind.name: kind for kind in (GPipe, Circular, OneFOneB, InterleavedOneFOneB)}  # impl.pipeline.schedule


def schedule_for(cfg: RunConfig) -> Schedule | None:
    """The config's pipeline schedule; None without pipeline stages (mesh.stage 1). Run when a config is
    validated too, so a config its schedule cannot run is refused at load."""
    if cfg.mesh.stage == 1:
        return None
    return SCHEDULES[cfg.impl.pipeline.schedule].for_config(cfg)


@dataclass(frozen=True)
class Ticks:
    """A schedule as tables [ticks, S] (-1: nothing): in tick t stage s first runs the forward of micro-batch
    f_mb[t, s] through its chunk f_rep[t, s], then the backward of micro-batch b_mb[t, s] through chunk
    b_rep[t, s]. GPipe's and the circular schedule's tables have forward ticks only (autodiff runs their
    backward, keeping all `slots` = M micro-batches' activations); the 1F1B schedules' as follows. Micro-batches go in groups of S (m = g S + j); the forward of (g, j) on pass r reaches
    stage s at tick g R S + r S + j + s, as in the circular schedule with M = S per group, and its backward
    retraces the same path the other way from the tick its last chunk ran:

        forward  (g, r, j) at stage s: tick g R S + r S + j + s
        backward (g, r, j) at stage s: tick g R S + (R - 1 - r) S + j + (R + 1) S - 2 - s

    so every handoff is to the next tick (never a buffer) and the last chunk's backward is in the same tick
    as its forward. Forward work fills ticks 0 .. M R + S - 2 and backward work ticks R S - 1 .. M R + R S
    + S - 3, each M R + S - 1 ticks with S - 1 idle per stage: GPipe's (circular's) bubble. A stage keeps
    the input of each chunk it ran forward until that chunk's backward (which recomputes it) in one of
    `slots` buffer slots: 2 S - 1 with R = 1 (a backward reaches stage 0 2 (S - 1) ticks after its
    forward), (R + 1) S - 1 chunk inputs interleaved; fewer when M R is smaller."""

    f_mb: np.ndarray
    f_rep: np.ndarray
    f_slot: np.ndarray  # where the forward's input is kept (slots: the spare slot taking idle writes)
    b_mb: np.ndarray
    b_rep: np.ndarray
    b_slot: np.ndarray
    slots: int


@functools.cache
def _ticks(stages: int, microbatches: int, repeats: int) -> Ticks:
    S, M, R = stages, microbatches, repeats
    n = M * R + R * S + S - 2
    tables = {name: np.full((n, S), -1, np.int32) for name in ("f_mb", "f_rep", "f_slot", "b_mb", "b_rep", "b_slot")}
    for s in range(S):
        for u in range(M * R):
            g, r, j = u // (R * S), u % (R * S) // S, u % S
            tables["f_mb"][u + s, s], tables["f_rep"][u + s, s] = g * S + j, r
            t = g * R * S + (R - 1 - r) * S + j + (R + 1) * S - 2 - s
            tables["b_mb"][t, s], tables["b_rep"][t, s] = g * S + j, r
    slots = 0
    for s in range(S):  # each stage's kept inputs, a slot each from their forward to their backward tick
        free, held = [], {}
        for t in range(n):
            key = (tables["f_mb"][t, s], tables["f_rep"][t, s])
            if key[0] >= 0:
                slot = free.pop() if free else len(held)
                held[key], tables["f_slot"][t, s] = slot, slot
            key = (tables["b_mb"][t, s], tables["b_rep"][t, s])
            if key[0] >= 0:
                tables["b_slot"][t, s] = held.pop(key)
                free.append(tables["b_slot"][t, s])
            slots = max(slots, len(held) + len(free))
    tables["f_slot"][tables["f_slot"] < 0] = slots
    tables["b_slot"][tables["b_slot"] < 0] = 0
    return Ticks(**tables, slots=slots)


@functools.cache
def _forward_ticks(stages: int, microbatches: int, repeats: int) -> Ticks:
    """GPipe's and the circular schedule's table: micro-batch m's pass r at stage s in tick r M + m + s."""
    S, M, R = stages, microbatches, repeats
    f_mb, f_rep, none = (np.full((M * R + S - 1, S), -1, np.int32) for _ in range(3))
    for s in range(S):
        for u in range(M * R):
            f_mb[u + s, s], f_rep[u + s, s] = u % M, u // M
    return Ticks(f_mb, f_rep, none, none, none, none, slots=M)


def check_rows(cfg: RunConfig, rows_per_device: int) -> None:
    """A device's rows of a micro-step divide into the pipeline's micro-batches and each of those into
    impl.batch_split's parts; ConfigError naming the fix when not."""
    sched = schedule_for(cfg)
    if sched is not None and rows_per_device % sched.microbatches:
        raise ConfigError(
            f"{rows_per_device} instances per device per micro-step do not split into impl.pipeline.microbatches "
            f"{sched.microbatches}; make train.micro_batch_per_device (or the global batch per device) a multiple "
            "of it")
    rows = rows_per_device // (sched.microbatches if sched is not None else 1)
    if rows % cfg.impl.batch_split:
        where = " per pipeline micro-batch" if sched is not None else ""
        raise ConfigError(
            f"{rows} instances per device{where} do not split into impl.batch_split {cfg.impl.batch_split} parts; "
            "make train.micro_batch_per_device a multiple of it or lower impl.batch_split")
