"""Pipeline parallelism over the `stage` mesh axis: an SPMD pipeline inside the one jitted step.

The layer stack [L, ...] is cut into S x R chunks of consecutive layers; chunk c runs on stage c mod S,
so each stage holds R chunks (R = 1: GPipe; R > 1: the circular, or interleaved, schedule). A batch is
cut into M micro-batches. Every iteration, all stages run their chunk at once on the micro-batch in
front of them (one vmap over a stage dimension that the layout places on the `stage` mesh axis), then
the outputs move one stage on (a collective permute). Stage s works on micro-batch m, pass r at
iteration t = r M + m + s, so a step takes M R + S - 1 iterations of which each stage idles S - 1:

    bubble = (S - 1) / (M R + S - 1)

Stage 0 takes micro-batch m from a buffer that starts as the inputs; the last stage writes its output
back over it, where stage 0 reads it for the next pass (M >= S keeps the write before that read) and
where the final outputs are left. Iterations in the bubble compute on whatever is in front of the stage,
and nothing reads their results: their activations never reach the buffer, and the per-layer auxiliary
values (losses, load counts) are gathered afterwards from the real (iteration, stage) pairs only.

Parameters stay in the model's own layout, stacked over layers with `layers` on the `stage` mesh axis,
so checkpoints do not depend on the stage count. GPipe's chunks are then already on their stages; the
circular schedule's chunk c = r S + s lives on stage c // R in that layout and is moved to stage
s = c mod S inside the step (R collective permutes of one chunk per stage each micro-step, the same for
their gradients back).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from olmax.config import ConfigError, RunConfig
from olmax.parallel.mesh import Layout, spec_axes


@dataclass(frozen=True)
class Schedule:
    stages: int  # S
    microbatches: int  # M, per train micro-step
    repeats: int  # R, layer chunks per stage (1: GPipe)

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of each stage's iterations spent idle."""
        return (self.stages - 1) / self.iterations

    @property
    def chunks(self) -> int:
        return self.stages * self.repeats

    def describe(self) -> str:
        kind = "GPipe" if self.repeats == 1 else f"circular, {self.repeats} layer chunks per stage"
        return (f"{self.stages} stages ({kind}), {self.microbatches} micro-batches per micro-step: "
                f"bubble {self.bubble:.1%} ({self.stages - 1} of {self.iterations} iterations per stage)")


def schedule_for(cfg: RunConfig) -> Schedule | None:
    """The config's pipeline schedule; None without pipeline stages (mesh.stage 1)."""
    stages, p = cfg.mesh.stage, cfg.impl.pipeline
    if stages == 1:
        return None
    if cfg.model.dense_layers:
        raise ConfigError(f"model.dense_layers {cfg.model.dense_layers}: a pipeline runs one stack of like layers "
                          "over its stages; use dense_layers 0 with mesh.stage > 1")
    microbatches = p.microbatches or stages
    groups = cfg.model.n_layers // len(cfg.model.layer_pattern)
    if p.schedule == "gpipe":
        repeats = 1
    else:
        repeats = p.repeats or groups // stages
        if repeats < 2:
            raise ConfigError(
                f"the circular schedule needs 2 or more layer chunks per stage, but model.n_layers "
                f"{cfg.model.n_layers} is {groups} layer_pattern periods for mesh.stage {stages}; use schedule gpipe")
        if microbatches < stages:
            raise ConfigError(f"impl.pipeline.microbatches {microbatches} < mesh.stage {stages}: the circular "
                              "schedule needs at least one micro-batch per stage; raise it")
    if groups % (stages * repeats):
        raise ConfigError(
            f"model.n_layers {cfg.model.n_layers} is {groups} layer_pattern periods, not divisible into mesh.stage "
            f"{stages} x {repeats} layer chunks per stage; change mesh.stage or impl.pipeline.repeats")
    return Schedule(stages, microbatches, repeats)


def _stage_axes(layout: Layout | None) -> tuple[str, ...]:
    if layout is None:
        return ()
    return tuple(a for a in layout.rules["layers"] if layout.mesh.shape[a] > 1)


def _constrain(layout: Layout | None, x: jax.Array, spec: PartitionSpec) -> jax.Array:
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))


def by_stage(layout: Layout | None, w: jax.Array, axes: tuple[str, ...], sched: Schedule) -> jax.Array:
    """A stacked parameter [L, ...] (logical axes `axes`, `layers` first) as [R, S, C, ...]: [r, s] holds
    chunk r S + s, the C = L / (R S) layers stage s runs on its pass r, on the devices of stage s."""
    L = w.shape[0]
    shape = (sched.repeats, sched.stages, L // sched.chunks, *w.shape[1:])
    if layout is None or sched.repeats == 1 or not _stage_axes(layout):
        return w.reshape(shape)  # GPipe: each stage's chunk is already its slice of the layers
    own = layout.spec(axes, w.shape)
    move = functools.partial(_to_circular, stage_axis=_stage_axes(layout)[0], sched=sched)
    out_spec = PartitionSpec(None, own[0], None, *own[1:])
    return jax.shard_map(move, mesh=layout.mesh, in_specs=own, out_specs=out_spec)(w)


def _circular_rounds(stages: int, repeats: int) -> list[list[tuple[int, int, int, int]]]:
    """The moves taking chunk c from stage c // R (slot c % R) to stage c % S (slot c // S), as R rounds in
    which every stage sends one chunk and receives one: (source, source slot, destination, destination slot).
    Chunk c goes in round (c + c // lcm(R, S)) mod R, a perfect matching for every S and R."""
    period = math.lcm(repeats, stages)
    rounds = [[] for _ in range(repeats)]
    for c in range(stages * repeats):
        rounds[(c % repeats + c // period) % repeats].append((c // repeats, c % repeats, c % stages, c // stages))
    return rounds


def _to_circular(local: jax.Array, *, stage_axis: str, sched: Schedule) -> jax.Array:
    """Inside shard_map: this stage's R consecutive chunks [R C, ...] -> the chunks it runs [R, 1, C, ...],
    by R collective permutes of one chunk each (no stage holds more than its own R chunks at any time)."""
    R = sched.repeats
    chunks = local.reshape(R, local.shape[0] // R, *local.shape[1:])
    stage = jax.lax.axis_index(stage_axis)
    out = jnp.zeros_like(chunks)
    for moves in _circular_rounds(sched.stages, R):
        send_slot, recv_slot = np.zeros(sched.stages, np.int32), np.zeros(sched.stages, np.int32)
        for source, slot, dest, dest_slot in moves:
            send_slot[source], recv_slot[dest] = slot, dest_slot
        piece = jax.lax.dynamic_index_in_dim(chunks, jnp.asarray(send_slot)[stage], keepdims=False)
        piece = jax.lax.ppermute(piece, stage_axis, [(source, dest) for source, _, dest, _ in moves])
        out = jax.lax.dynamic_update_index_in_dim(out, piece, jnp.asarray(recv_slot)[stage], 0)
    return out[:, None]


# Copies that move or cast data: cheaper to redo in the backward pass than to keep for every iteration.
_COPIES = (jax.lax.gather_p, jax.lax.dynamic_slice_p, jax.lax.squeeze_p, jax.lax.reshape_p, jax.lax.transpose_p,
           jax.lax.convert_element_type_p)


def run(stage_fn: Callable, weights, x: jax.Array, names: tuple[str, ...], sched: Schedule,
        layout: Layout | None, kept=jax.checkpoint_policies.everything_saveable):
    """Run M micro-batches x [M, b, ...] (logical axes `names` after M) through all chunks in order.

    stage_fn(chunk_weights, x [b, ...]) -> (y [b, ...], aux) runs one chunk: chunk_weights are leaves of
    `weights` [R, S, C, ...] (see `by_stage`) at one (r, s); aux leaves are [C, ...] (one per layer).
    `kept` is the remat policy of stage_fn seen from outside (what its backward pass needs kept).
    Returns (y [M, b, ...], aux [M, R S C, ...] in layer order) from real iterations only.
    """
    S, M, R = sched.stages, sched.microbatches, sched.repeats
    stage_axes = _stage_axes(layout)
    act_spec = PartitionSpec(stage_axes or None, *(layout.spec(names, x.shape[1:]) if layout else ()))
    stage_ids = jnp.arange(S)
    vmap = jax.vmap if not stage_axes else lambda f, **kw: jax.vmap(f, spmd_axis_name=stage_axes, **kw)

    def at_stage(a):  # [S] -> broadcastable against [S, b, ...]
        return a.reshape(S, *[1] * (x.ndim - 1))

    # Each stage's chunk of the circular schedule changes with the iteration: left to autodiff, that chunk (and
    # its compute-dtype copy) would be kept for the backward pass of every iteration, the stage's weights
    # (M R + S - 1) / R times over. Copies are recomputed instead (a gather, a transpose, a cast); the rest is
    # kept as the layers' own remat policy says.
    @functools.partial(jax.checkpoint, policy=lambda prim, *a, **p: prim not in _COPIES and kept(prim, *a, **p))
    def circular_stages(weights, repeat, inputs):
        chunk = jax.tree.map(lambda w: vmap(lambda w, r: w[r], in_axes=(1, 0))(w, repeat), weights)
        return vmap(stage_fn)(chunk, inputs)

    def iteration(carry, t):
        state, buffer = carry  # state: each stage's previous output [S, b, ...]; buffer [M, b, ...]
        shifted = jnp.concatenate([state[-1:], state[:-1]])  # stage s receives stage s - 1's output
        first = jax.lax.dynamic_index_in_dim(buffer, t % M, keepdims=True)
        inputs = _constrain(layout, jnp.where(at_stage(stage_ids == 0), first, shifted), act_spec)
        if R == 1:
            out, aux = vmap(stage_fn)(jax.tree.map(lambda w: w[0], weights), inputs)
        else:
            out, aux = circular_stages(weights, jnp.clip((t - stage_ids) // M, 0, R - 1), inputs)
        out = _constrain(layout, out, act_spec)
        # The last stage's output as a value every stage holds (a sum over the stage axis: one all-reduce).
        last = jnp.sum(jnp.where(at_stage(stage_ids == S - 1), out, jnp.zeros_like(out)), axis=0)
        done = (t - (S - 1)) % M  # the micro-batch the last stage just finished
        kept = jax.lax.dynamic_index_in_dim(buffer, done, keepdims=False)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(t >= S - 1, last, kept), done, 0)
        return (out, buffer), aux

    state = _constrain(layout, jnp.zeros((S, *x.shape[1:]), x.dtype), act_spec)
    (_, y), aux = jax.lax.scan(iteration, (state, x), jnp.arange(sched.iterations))
    # aux leaves [iterations, S, C, ...]: micro-batch m's pass r on stage s ran at iteration r M + m + s.
    m, r, s = np.meshgrid(np.arange(M), np.arange(R), np.arange(S), indexing="ij")
    aux = jax.tree.map(lambda a: a[r * M + m + s, s].reshape(M, -1, *a.shape[3:]), aux)
    return y, aux


def over_stages(layout: Layout | None, x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """x [B, ...] (logical axes `names`) with its rows split over the stages too. Every stage holds all the
    pipeline's outputs; what runs after the layers (final norm, LM head, loss) then does 1/S of the rows on
    each stage instead of all of them on every stage."""
    stage_axes = _stage_axes(layout)
    if not stage_axes:
        return x
    spec = layout.spec(names, x.shape)
    rows = (*spec_axes(spec[0]), *stage_axes)
    if x.shape[0] % math.prod(layout.mesh.shape[a] for a in rows):
        return x
    return _constrain(layout, x, PartitionSpec(rows, *spec[1:]))


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...], micro-batch m = rows m, m + M, m + 2M, ...: each data-parallel shard of
    the rows keeps its own rows (no communication) when B / M is a multiple of the shard count."""
    return jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of split_microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def check_rows(sched: Schedule | None, rows_per_device: int) -> None:
    if sched is not None and rows_per_device % sched.microbatches:
        raise ConfigError(
            f"{rows_per_device} instances per device per micro-step do not split into impl.pipeline.microbatches "
            f"{sched.microbatches}; make train.micro_batch_per_device (or the global batch per device) a multiple "
            "of it")

