"""Pipeline parallelism over the `stage` mesh axis: an SPMD pipeline inside the one jitted step, running a
schedule of olmax.parallel.schedules.

Every iteration, all stages run their chunk at once on the micro-batch in front of them (one vmap over a stage
dimension that the layout places on the `stage` mesh axis), then the outputs move one stage on (a collective
permute). Stage 0 takes micro-batch m from a buffer that starts as the inputs; the last stage writes its output
back over it, where stage 0 reads it for the next pass (M >= S keeps the write before that read) and
where the final outputs are left. Iterations in the bubble compute on whatever is in front of the stage,
and nothing reads their results: their activations never reach the buffer, and the per-layer auxiliary
values (losses, load counts) are gathered afterwards from the real (iteration, stage) pairs only.

Parameters stay in the model's own layout, stacked over layers with `layers` on the `stage` mesh axis,
so checkpoints do not depend on the stage count. GPipe's chunks are then already on their stages; the
circular schedule's chunk c = r S + s lives on stage c // R in that layout and is moved to stage
s = c mod S inside the step (R collective permutes of one chunk per stage each micro-step, the same for
their gradients back).

`run` leaves the backward pass to autodiff of its scan, which keeps every iteration's saved activations
until the backward: all M micro-batches'. `run_1f1b` (the 1f1b and interleaved_1f1b schedules) runs the same
chunks on the same stages with the backward scheduled by hand, the loss inside the pipeline, and keeps only
a bounded number of chunk inputs per stage (see schedules.Ticks).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from olmax.config import RunConfig
from olmax.parallel.mesh import Layout, spec_axes
from olmax.parallel.schedules import Schedule, schedule_for

def eval_schedule(cfg: RunConfig, layout: Layout | None) -> Schedule | None:
    """The schedule an evaluation's forward pass runs on `layout`: the config's where the layout has the stages
    (the forward through the pipeline, each stage running its own layers), None on a layout without them."""
    return schedule_for(cfg) if _stage_axes(layout) else None


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
           jax.lax.convert_element_type_p, jax.lax.select_n_p, jax.lax.slice_p, jax.lax.broadcast_in_dim_p)


def run(stage_fn: Callable, weights, x: jax.Array, names: tuple[str, ...], sched: Schedule,
        layout: Layout | None, kept=jax.checkpoint_policies.everything_saveable):
    """Run M micro-batches x [M, b, ...] (logical axes `names` after M) through all chunks in order.

    stage_fn(chunk_weights, x [b, ...]) -> (y [b, ...], aux) runs one chunk: chunk_weights are leaves of
    `weights` [R, S, C, ...] (see `by_stage`) at one (r, s); aux leaves are [C, ...] (one per layer).
    `kept` is the remat policy of stage_fn seen from outside (what its backward pass needs kept).
    Returns (y [M, b, ...], aux [M, R S C, ...] in layer order) from real iterations only.
    """
    S, M, R = sched.stages, sched.microbatches, sched.repeats
    act_spec, stage_ids, vmap, at_stage = _stage_tools(x, names, S, layout)

    # Each stage's chunk of the circular schedule changes with the iteration: left to autodiff, that chunk (and
    # its compute-dtype copy) would be kept for the backward pass of every iteration, the stage's weights
    # (M R + S - 1) / R times over. Copies are recomputed instead (a gather, a transpose, a cast); the rest is
    # kept as the layers' own remat policy says.
    @functools.partial(jax.checkpoint, policy=lambda prim, *a, **p: prim not in _COPIES and kept(prim, *a, **p))
    def circular_stages(weights, repeat, inputs):
        # Each stage's chunk by a select over the R chunks, not a gather: the gather's transpose (a scatter over
        # the stage axis) is a program XLA's GPU compiler refuses ("Bounds of the window dimensions of updates
        # must not exceed the bounds of the corresponding dimensions of operand").
        def pick(w):  # [R, S, C, ...] -> [S, C, ...]
            chunk = w[0]
            for r in range(1, R):
                chunk = jnp.where((repeat == r).reshape(S, *[1] * (chunk.ndim - 1)), w[r], chunk)
            return chunk
        return vmap(stage_fn)(jax.tree.map(pick, weights), inputs)

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
    return y, _by_microbatch(aux, sched)


def run_1f1b(stage_fn: Callable, head_fn: Callable, weights, x: jax.Array, head_params, head_inputs,
             names: tuple[str, ...], sched: Schedule, layout: Layout | None, chunk_loss: Callable | None = None):
    """The loss of M micro-batches x [M, b, ...] through all chunks in order and then head_fn, with the
    backward scheduled by hand (see Ticks): (loss, metrics, aux), loss and metrics summed over the
    micro-batches, aux [M, R S C, ...] as `run` returns it.

    stage_fn(chunk_weights, x [b, ...]) -> (y [b, ...], aux) as for `run`; chunk_loss(aux) is what one chunk
    of one micro-batch adds to the loss (a mixture of experts' router losses of its layers), differentiated
    with the chunk. head_fn(head_params, y [b, ...], inputs) -> (loss, metrics) runs on the last chunk's
    output of each micro-batch, with that micro-batch's leaves of head_inputs [M, ...]. The gradients of loss
    with respect to weights, x and head_params are computed with the loss, in the same scan; differentiating
    the result scales them by the loss's cotangent (metrics and aux get none)."""
    args = (stage_fn, head_fn, chunk_loss, names, sched, layout)

    @jax.custom_vjp
    def loss(weights, x, head_params, head_inputs):
        return _run_1f1b(weights, x, head_params, head_inputs, *args)[0]

    def forward(weights, x, head_params, head_inputs):
        return _run_1f1b(weights, x, head_params, head_inputs, *args)

    def backward(grads, cotangents):
        scale = cotangents[0]  # metrics and aux: no gradient
        return (*jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), None)

    loss.defvjp(forward, backward)
    return loss(weights, x, head_params, head_inputs)


def _stage_tools(x, names, S: int, layout):
    """What every schedule's loop uses: the [S, b, ...] activations' spec, the stage ids, a vmap over the stages
    (on the stage mesh axes where there are some) and `at_stage` ([S] -> broadcastable against [S, b, ...])."""
    stage_axes = _stage_axes(layout)
    act_spec = PartitionSpec(stage_axes or None, *(layout.spec(names, x.shape[1:]) if layout else ()))
    vmap = jax.vmap if not stage_axes else lambda f, **kw: jax.vmap(f, spmd_axis_name=stage_axes, **kw)
    return act_spec, jnp.arange(S), vmap, lambda a: a.reshape(S, *[1] * (x.ndim - 1))


def _run_1f1b(weights, x, head_params, head_inputs, stage_fn, head_fn, chunk_loss, names, sched, layout):
    S, R = sched.stages, sched.repeats
    table = sched.ticks()
    act_spec, stage_ids, vmap, at_stage = _stage_tools(x, names, S, layout)

    def one_stage(a, stage):  # stage `stage`'s [b, ...] as a value every stage holds (one all-reduce)
        return jnp.sum(jnp.where(at_stage(stage_ids == stage), a, jnp.zeros_like(a)), axis=0)

    def chunks(rep):  # each stage's chunk on pass rep [S]
        return jax.tree.map(lambda w: vmap(lambda w, r: w[r], in_axes=(1, 0))(w, rep), weights)

    def chunk_forward(w, x):  # ((y, what the chunk adds to the loss), aux)
        y, aux = stage_fn(w, x)
        return (y, jnp.float32(0.0) if chunk_loss is None else chunk_loss(aux)), aux

    def chunk_backward(w, x, cotangent):
        return jax.vjp(chunk_forward, w, x, has_aux=True)[1]((cotangent, jnp.float32(1.0)))

    def head(y, m):
        inputs = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, keepdims=False), head_inputs)
        (value, metrics), pullback = jax.vjp(lambda p, y: head_fn(p, y, inputs), head_params, y)
        return value, metrics, pullback((jnp.ones_like(value), jax.tree.map(jnp.zeros_like, metrics)))

    y0 = jnp.zeros(x.shape[1:], x.dtype)
    value0, metrics0, _ = jax.eval_shape(head, y0, 0)

    def forward_part(carry, f_mb, f_rep, f_slot):
        fwd, bwd, kept, grads, value, metrics = carry
        # Stage s takes stage s - 1's last output (stage 0: stage S - 1's, or a new micro-batch).
        first = jax.lax.dynamic_index_in_dim(x, jnp.maximum(f_mb[0], 0), keepdims=False)
        shifted = jnp.concatenate([fwd[-1:], fwd[:-1]])
        inputs = _constrain(layout, jnp.where(at_stage((stage_ids == 0) & (f_rep == 0)), first, shifted), act_spec)
        (fwd, added), aux = vmap(chunk_forward)(chunks(jnp.maximum(f_rep, 0)), inputs)
        fwd = _constrain(layout, fwd, act_spec)
        kept = vmap(lambda k, i, slot: jax.lax.dynamic_update_index_in_dim(k, i, slot, 0))(kept, inputs, f_slot)
        value = value + jnp.sum(jnp.where(f_mb >= 0, added, 0.0))
        return (fwd, bwd, kept, grads, value, metrics), aux

    def head_part(carry, m):  # the loss of micro-batch m, whose last chunk just ran, and its gradient
        fwd, bwd, kept, (d_weights, d_x, d_head), value, metrics = carry
        v, mt, (d_params, dy) = head(over_stages(layout, one_stage(fwd, S - 1), names), m)
        d_head = jax.tree.map(jnp.add, d_head, d_params)
        # parked in stage S - 1's input gradient slot, where the backward part takes it from
        bwd = jnp.where(at_stage(stage_ids == 0), dy[None].astype(bwd.dtype), bwd)
        return fwd, bwd, kept, (d_weights, d_x, d_head), value + v, jax.tree.map(jnp.add, metrics, mt)

    def backward_part(carry, b_mb, b_rep, b_slot):
        fwd, bwd, kept, (d_weights, d_x, d_head), value, metrics = carry
        # Stage s takes stage s + 1's last input gradient (stage S - 1: stage 0's, or the loss's gradient).
        cotangent = _constrain(layout, jnp.concatenate([bwd[1:], bwd[:1]]), act_spec)
        saved = vmap(lambda k, slot: jax.lax.dynamic_index_in_dim(k, slot, keepdims=False))(kept, b_slot)
        d_chunk, bwd = vmap(chunk_backward)(chunks(jnp.maximum(b_rep, 0)), _constrain(layout, saved, act_spec),
                                            cotangent)
        bwd = _constrain(layout, bwd, act_spec)

        def add(g, d, rep, on):
            return g.at[rep].add(jnp.where(on, d, jnp.zeros_like(d)))

        d_weights = jax.tree.map(lambda g, d: vmap(add, in_axes=(1, 0, 0, 0), out_axes=1)(
            g, d, jnp.maximum(b_rep, 0), b_mb >= 0), d_weights, d_chunk)
        first_mb = jnp.where(b_rep[0] == 0, b_mb[0], -1)  # stage 0's first chunk: x's gradient is done
        done = jax.lax.dynamic_index_in_dim(d_x, jnp.maximum(first_mb, 0), keepdims=False)
        d_x = jax.lax.dynamic_update_index_in_dim(
            d_x, jnp.where(first_mb >= 0, one_stage(bwd, 0), done), jnp.maximum(first_mb, 0), 0)
        return fwd, bwd, kept, (d_weights, d_x, d_head), value, metrics

    rows = tuple(jnp.asarray(getattr(table, name)) for name in ("f_mb", "f_rep", "f_slot", "b_mb", "b_rep", "b_slot"))
    state = _constrain(layout, jnp.zeros((S, *x.shape[1:]), x.dtype), act_spec)
    no_aux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(  # what an idle tick gives
        lambda: vmap(chunk_forward)(chunks(jnp.zeros(S, jnp.int32)), state)[1]))

    def tick(carry, row):
        f_mb, f_rep, f_slot, b_mb, b_rep, b_slot = row
        carry, aux = jax.lax.cond(jnp.any(f_mb >= 0), functools.partial(forward_part, f_mb=f_mb, f_rep=f_rep,
                                                                        f_slot=f_slot), lambda c: (c, no_aux), carry)
        last_mb = jnp.where(f_rep[-1] == R - 1, f_mb[-1], -1)
        carry = jax.lax.cond(last_mb >= 0, functools.partial(head_part, m=jnp.maximum(last_mb, 0)), lambda c: c,
                             carry)
        carry = jax.lax.cond(jnp.any(b_mb >= 0), functools.partial(backward_part, b_mb=b_mb, b_rep=b_rep,
                                                                   b_slot=b_slot), lambda c: c, carry)
        return carry, aux

    kept = jnp.zeros((S, table.slots + 1, *x.shape[1:]), x.dtype)
    grads = jax.tree.map(jnp.zeros_like, (weights, x, head_params))
    zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (value0, metrics0))
    (_, _, _, grads, value, metrics), aux = jax.lax.scan(tick, (state, state, kept, grads, *zero), rows)
    return (value, metrics, _by_microbatch(aux, sched)), grads


def _by_microbatch(aux, sched: Schedule):
    """Per-tick aux leaves [ticks, S, C, ...] -> [M, R S C, ...] in layer order, from the ticks that ran a chunk
    forward: micro-batch m's chunk r S + s ran in tick tick_of[m, r, s] of the schedule's table."""
    table, S = sched.ticks(), sched.stages
    tick_of = np.zeros((sched.microbatches, sched.repeats, S), np.int32)
    for t, s in zip(*np.nonzero(table.f_mb >= 0)):
        tick_of[table.f_mb[t, s], table.f_rep[t, s], s] = t
    return jax.tree.map(lambda a: a[tick_of, np.arange(S)].reshape(sched.microbatches, -1, *a.shape[3:]), aux)


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
