"""Expert parallelism: experts stay resident on the `expert` mesh axis and tokens travel to them.

Each device holds a shard of the batch's tokens and E / P of the experts (P = size of the expert
axis; the tokens are sharded over it too). Inside shard_map each device sends every peer exactly
the tokens routed there, once per peer however many of that peer's experts a token chose, with those
experts' ids (local to the peer) and gates; each runs its own experts on what it received (only
those rows: the grouped matmul's work follows the rows routed to each expert), weighs each row's
outputs by its gates and sends the row back, and the token's device sums what its peers returned.
Expert weights are never gathered, unlike FSDP, which would re-gather every expert for every
micro-batch; OLMo-core's expert-parallel MoE (olmo_core/nn/moe/v2) keeps its experts resident the
same way, and is dropless like this default.

The exchange is `jax.lax.ragged_all_to_all` (counts first, in a small all_to_all, then the rows): it
sends only the routed rows, and its buffers are static, so a device's receive buffer holds the worst
case, every token of its group (P times a device's tokens; the compile page shows what that costs).
XLA:CPU has no ragged-all-to-all, so on CPU devices `emulated_ragged_all_to_all` stands in for the
primitive alone, with its exact semantics (every offset and size as the primitive takes them), made of
all_to_all over padded blocks.

With a capacity per peer (`impl.moe.ep_capacity`), each device sends each peer only the assignments
routed there, up to `capacity` rows (assignments beyond it are dropped before the exchange, by
`drop_over_peer_capacity`, and counted): buffers of P x capacity rows, about factor x k x a device's
tokens, whatever P; it changes the training math wherever it drops. How many rows each of these is:
olmax.parallel.moe_sizing.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

from olmax.parallel.permute import sum_rows, take_rows

from olmax.parallel.moe_sizing import receive_slots

EXPERT_AXIS = "expert"
# What an exchange received (a device's rows, their expert ids and gates) and the routed output it summed: named so
# that `impl.remat=none` keeps them (olmax.model.transformer) and the backward pass never runs an exchange again.
EXCHANGED = "expert_exchange"


def _sharded_batch_axes(mesh: Mesh, batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)


def batch_shards(mesh: Mesh, batch_axes: tuple[str, ...]) -> int:
    """How many contiguous shards the batch is cut into (the data-parallel ranks)."""
    return math.prod(mesh.shape[a] for a in _sharded_batch_axes(mesh, batch_axes))


def per_shard(fn: Callable, mesh: Mesh, batch_axes: tuple[str, ...], *arrays: jax.Array):
    """fn on each batch shard of row-wise arrays [N, ...], for ops the SPMD partitioner would otherwise
    run on the whole gathered batch on every device (XLA's TopK custom call)."""
    rows = PartitionSpec(_sharded_batch_axes(mesh, batch_axes) or None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(rows,) * len(arrays), out_specs=rows, check_vma=False)(*arrays)


def own_full(shape: tuple[int, ...], fill, dtype, routing: jax.Array) -> jax.Array:
    """jnp.full(shape, fill, dtype) that XLA cannot share with another layer's: its fill depends on `routing` (ints
    of this call's routing, never negative). XLA merges equal constant buffers, and a merged buffer is copied
    (read and written) for each op that updates it in place (a scatter's or a ragged all-to-all's output); one
    of its own is only written: 0.5 s of the 47B's 8-B300 step."""
    return jnp.full(shape, jnp.where(routing.reshape(-1)[0] < 0, fill + 1, fill), dtype)


def rank_within(ids: jax.Array, num_ids: int) -> tuple[jax.Array, jax.Array]:
    """For int ids [R] in [0, num_ids): each element's rank among equal ids in order, and the counts [num_ids]."""
    order = jnp.argsort(ids, stable=True)
    counts = jnp.zeros(num_ids, jnp.int32).at[ids].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(ids.size, dtype=jnp.int32) - starts[ids[order]]
    return jnp.zeros_like(rank_sorted).at[order].set(rank_sorted), counts


def drop_over_peer_capacity(experts: jax.Array, n_experts: int, ep: int, ranks: int, capacity: int) -> jax.Array:
    """experts [N, k] with the assignments beyond `capacity` per (batch shard, destination device) set to
    n_experts (dropped): each of the `ranks` contiguous shards keeps, for each device of the expert axis,
    its first `capacity` assignments there in (token, slot) order."""
    per_rank = experts.reshape(ranks, -1)
    device = jnp.minimum(per_rank // (n_experts // ep), ep)  # dropped ids (n_experts) -> ep: none
    rank, _ = jax.vmap(rank_within, in_axes=(0, None))(device, ep + 1)
    return jnp.where(rank < capacity, per_rank, n_experts).reshape(experts.shape)


def send_plan(experts: jax.Array, per_device: int, ep: int
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Which rows a device sends, for expert ids [n, k] (ids past the last expert: dropped) of its n tokens with
    `per_device` experts on each of `ep` devices: each token once to each device holding any of its experts.

    Returns the send buffer's rows grouped by destination, as (token [S] (n: an empty row), destination [S]
    (ep: empty), send_sizes [ep], and where each token's row to each device is [n, ep] (S: not sent)); S = n x
    min(k, ep) holds the worst case, every token's experts on min(k, ep) devices."""
    n, k = experts.shape
    holds = jnp.any(experts[:, :, None] // per_device == jnp.arange(ep), axis=1)  # [n, ep]
    send_sizes = jnp.sum(holds, axis=0, dtype=jnp.int32)
    starts = jnp.cumsum(send_sizes) - send_sizes
    rows = n * min(k, ep)
    slot = jnp.where(holds, starts + jnp.cumsum(holds, axis=0, dtype=jnp.int32) - 1, rows).reshape(-1)
    token = jnp.full(rows, n, jnp.int32).at[slot].set(jnp.repeat(jnp.arange(n, dtype=jnp.int32), ep), mode="drop")
    destination = jnp.full(rows, ep, jnp.int32).at[slot].set(jnp.tile(jnp.arange(ep, dtype=jnp.int32), n),
                                                             mode="drop")
    return token, destination, send_sizes, slot.reshape(n, ep)


def exclusive_cumsum(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` made of all_to_all, for devices whose compiler has no ragged-all-to-all
    (XLA:CPU): operand[input_offsets[j]:][:send_sizes[j]] is written to peer j's output at output_offsets[j];
    rows of `output` nothing was written to keep their values. Each device sends each peer a block the size of
    its whole operand (padding past send_sizes), so it moves P times the primitive's data; `recv_sizes` must
    equal what the peers send, as for the primitive, and is not needed to place the rows."""
    del recv_sizes
    rows = operand.shape[0]
    within = jnp.arange(rows, dtype=jnp.int32)
    sent = within < send_sizes[:, None]  # [P, rows]
    blocks = jnp.take(operand, jnp.where(sent, input_offsets[:, None] + within, rows), axis=0, mode="fill",
                      fill_value=0)
    landing = jnp.where(sent, output_offsets[:, None] + within, output.shape[0])  # in the receiver's output

    def exchange(a):
        return jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)

    received, landing = exchange(blocks), checkpoint_name(exchange(landing), EXCHANGED)  # as the primitive's offsets
    return output.at[landing.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


OVERFLOW_SCOPE = "expert_exchange_overflow"  # the rounds past the first of a bounded exchange (olmax.scale.simulator)


def ragged_exchange(run_experts: Callable, x, experts, gates, local_weights, per_device: int, ep: int,
                    ragged_all_to_all: Callable, buffer: int | None = None) -> tuple[jax.Array, jax.Array]:
    """One device's routed output [n, D] (inside shard_map over the expert axis), dropless: its tokens sent to the
    peers holding their experts (`send_plan`), run there, returned and summed; and the rounds past the first.

    The assignments a device receives form a stream, its peers' rows in peer order, each row carrying its
    assignments to that device's experts (1 to min(k, experts a device)). A buffer of `buffer` assignments (None:
    the worst case, every token of the group with all its experts here) takes the stream in rounds: round r
    carries the rows whose first assignment lies in [r x buffer, (r + 1) x buffer) of every device's stream, at
    most `buffer` rows and buffer + min(k, per_device) - 1 assignments. The first round always runs; the rest
    (`rounds`) only while some device of the group has rows left, so the result is exact whatever the routing,
    and a buffer sized for what the routing sends on average costs one round when it fits."""
    n, k = experts.shape
    width = min(k, per_device)  # the most assignments a row carries to one device
    token, destination, send_sizes, sent_at = send_plan(experts, per_device, ep)
    input_offsets = exclusive_cumsum(send_sizes)
    sent_experts = jnp.take(experts, token, axis=0, mode="fill", fill_value=ep * per_device)
    local = jnp.where(sent_experts // per_device == destination[:, None], sent_experts % per_device, per_device)
    carried = jnp.sum(local < per_device, axis=1, dtype=jnp.int32)  # assignments a send row carries
    assigned = jnp.zeros(ep, jnp.int32).at[destination].add(carried, mode="drop")

    def exchange(a):
        return checkpoint_name(jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True), EXCHANGED)

    # Counts first: the assignments each peer sends this device, then where this device's start in each peer's
    # stream; a row's first assignment's place there decides its round.
    received = exchange(assigned)
    stream_offsets = exchange(exclusive_cumsum(received))
    within = exclusive_cumsum(carried) - jnp.take(exclusive_cumsum(assigned), destination, mode="fill", fill_value=0)
    start = jnp.take(stream_offsets, destination, mode="fill", fill_value=0) + within
    worst = ep * n * width
    slots = min(buffer or worst, worst)
    round_of = jnp.where(destination < ep, start // slots, jnp.iinfo(jnp.int32).max)
    rows = min(slots, ep * n)
    sent_x, sent_gates = (take_rows(a, token, sent_at) for a in (x, gates))

    def one_round(r, plan, local, sent_x, sent_gates, weights):
        """The rows of round r back from the peers, in this device's send buffer [S, D] (zeros elsewhere)."""
        round_of, destination, input_offsets = plan
        sizes = jnp.zeros(ep, jnp.int32).at[destination].add((round_of == r).astype(jnp.int32), mode="drop")
        at = input_offsets + jnp.zeros(ep, jnp.int32).at[destination].add((round_of < r).astype(jnp.int32),
                                                                           mode="drop")
        peer_sizes, peer_at = exchange(jnp.stack([sizes, at], axis=1)).T
        peer_offsets = exclusive_cumsum(peer_sizes)  # the peers' rows packed in peer order
        offsets = exchange(peer_offsets)

        there, back = (at, sizes, offsets, peer_sizes), (peer_offsets, peer_sizes, peer_at, sizes)

        def send(a, fill):
            out = own_full((rows, *a.shape[1:]), fill, a.dtype, sizes)
            return checkpoint_name(exchange_rows(ragged_all_to_all, a, out, there, back, sizes), EXCHANGED)

        y = run_experts(send(sent_x, 0), send(local, per_device), send(sent_gates, 0), *weights, n * k,
                        min(slots + width - 1, rows * width))
        out = own_full((local.shape[0], y.shape[1]), 0, y.dtype, sizes)
        return checkpoint_name(exchange_rows(ragged_all_to_all, y, out, back, there, sizes), EXCHANGED)

    plan = (round_of, destination, input_offsets)
    extra = jnp.zeros((), jnp.int32)
    if slots < worst:
        most = jax.lax.pmax(jnp.sum(received), EXPERT_AXIS)
        extra = jnp.maximum((most + slots - 1) // slots - 1, 0)
        back = rounds(one_round, extra, plan, local, sent_x, sent_gates, local_weights)
    else:  # the worst case in one round
        back = one_round(0, plan, local, sent_x, sent_gates, local_weights)
    out = sum_rows(back, sent_at, token * ep + destination)  # each token's rows back from its peers, summed
    return checkpoint_name(out.astype(x.dtype), EXCHANGED), extra


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def exchange_rows(ragged_all_to_all: Callable, a, out, there: tuple, back: tuple, routing) -> jax.Array:
    """`ragged_all_to_all` of a's rows into `out` as `there` says (input offsets, send sizes, output offsets,
    receive sizes); its backward sends the cotangent's rows back as `back` says (the same rows the other way,
    the reverse exchange's plan, which the caller has) into a buffer of a's rows of its own (`own_full` of
    `routing`). Autodiff's transpose of the primitive would exchange the offsets again and send into a buffer of
    zeros that XLA shares between layers (a copy before each exchange)."""
    return ragged_all_to_all(a, out, *there, axis_name=EXPERT_AXIS)


def _exchange_rows_fwd(ragged_all_to_all, a, out, there, back, routing):
    # a's shape kept as an empty array of a's rows: a residual must be an array
    return ragged_all_to_all(a, out, *there, axis_name=EXPERT_AXIS), (back, routing, jnp.zeros((a.shape[0], 0)))


def _exchange_rows_bwd(ragged_all_to_all, saved, g):
    back, routing, rows = saved
    da = ragged_all_to_all(g, own_full((rows.shape[0], *g.shape[1:]), 0, g.dtype, routing), *back,
                           axis_name=EXPERT_AXIS)
    return da, None, None, None, None


exchange_rows.defvjp(_exchange_rows_fwd, _exchange_rows_bwd)


def rounds(one_round: Callable, extra, plan, local, sent_x, sent_gates, weights) -> jax.Array:
    """`one_round` summed over rounds 0 .. extra (a count the routing decides, the same on every device of the
    group), differentiable in sent_x, sent_gates and weights. Forward, the first round as it is and a loop over the
    rest adding into it; backward, the first round's gradient from what its forward kept, then a loop that runs
    each further round again to add its gradient (none is kept across rounds: the buffers stay one round's). With
    no round past the first nothing more is moved or zeroed."""

    def forward(extra, plan, local, *differentiable):
        first, pull = jax.vjp(lambda *a: one_round(0, plan, local, *a), *differentiable)

        def body(r, total):
            return total + one_round(r, plan, local, *differentiable)

        with jax.named_scope(OVERFLOW_SCOPE):
            total = jax.lax.fori_loop(1, extra + 1, body, first)
        return total, (pull, extra, plan, local, *differentiable)

    def backward(saved, g):
        pull, extra, plan, local, *differentiable = saved

        def body(r, total):
            _, pull_r = jax.vjp(lambda *a: one_round(r, plan, local, *a), *differentiable)
            return jax.tree.map(jnp.add, total, pull_r(g))

        first = pull(g)  # the first round's gradient, outside the loop's scope: it is not an overflow's
        with jax.named_scope(OVERFLOW_SCOPE):
            grads = jax.lax.fori_loop(1, extra + 1, body, first)
        return (None, jax.tree.map(lambda _: None, plan), None, *grads)

    run = jax.custom_vjp(lambda *args: forward(*args)[0])
    run.defvjp(forward, backward)
    return run(extra, plan, local, sent_x, sent_gates, weights)


def routed_experts(
    run_experts: Callable,
    tokens: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    weights: tuple[jax.Array, ...],
    mesh: Mesh,
    batch_axes: tuple[str, ...],
    capacity: int | None = None,
    chunks: int = 1,
    buffer: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The routed output [N, D] of tokens [N, D] for expert ids [N, k] (E = dropped) and gates [N, k].

    `weights` have a leading expert dimension [E, ...], sharded over the expert axis.
    `run_experts(x [M, D], groups [M, k] ids in [0, G] (G = none), gates [M, k], *local_weights,
    expected_rows, assignments=None)` computes sum_k gates * expert_k(x) [M, D] on one device's G local experts;
    `assignments` bounds the ids below G (None: M x min(k, G)).
    `capacity` (rows per peer; see `drop_over_peer_capacity`, which must have been applied with it): at most
    that many assignments to each peer; None: dropless, each token to each peer holding any of its experts, a
    device's tokens in `chunks` parts, each exchanged and run on its own: no part depends on another, so XLA's
    scheduler can run one part's exchange while the experts compute another's. `buffer` (dropless): a receive
    buffer of that factor x the assignments a device is expected to receive (moe_sizing.receive_slots), in rounds
    while a device has more (`ragged_exchange`); None: the worst case, one round.

    Returns the output and the most rounds past the first any expert group's exchange took [] (summed over the
    parts; 0 with a capacity or a worst-case buffer).
    """
    n_experts = weights[0].shape[0]
    ep = mesh.shape.get(EXPERT_AXIS, 1)
    batch = _sharded_batch_axes(mesh, batch_axes)
    if ep > 1 and EXPERT_AXIS not in batch:
        raise ValueError(f"expert parallelism needs the batch sharded over '{EXPERT_AXIS}' too; got {batch_axes}")
    if n_experts % ep:
        raise ValueError(f"{n_experts} experts do not divide over an expert axis of {ep}")
    if tokens.shape[0] % batch_shards(mesh, batch_axes):
        raise ValueError(f"{tokens.shape[0]} tokens do not divide over {batch} ({batch_shards(mesh, batch_axes)})")
    rows = PartitionSpec(batch or None)
    exchange = emulated_ragged_all_to_all if mesh.devices.flat[0].platform == "cpu" else jax.lax.ragged_all_to_all
    expert_spec = PartitionSpec(EXPERT_AXIS if ep > 1 else None)

    def local(x, experts, gates, *local_weights):
        n, k = experts.shape
        none = jnp.zeros((1,), jnp.int32)
        if ep == 1:
            return run_experts(x, experts, gates, *local_weights, n * k), none
        per_device = n_experts // ep
        if capacity is not None:
            return capacity_exchange(x, experts, gates, local_weights, per_device), none
        if n % chunks:
            raise ValueError(f"{n} tokens a device do not divide into impl.moe.exchange_chunks={chunks} parts")
        slots = None if buffer is None else receive_slots(n // chunks, n_experts, k, ep, buffer)
        parts = [ragged_exchange(run_experts, *(a[i * n // chunks:(i + 1) * n // chunks] for a in (x, experts, gates)),
                                 local_weights, per_device, ep, exchange, slots) for i in range(chunks)]
        out = jnp.concatenate([y for y, _ in parts]) if chunks > 1 else parts[0][0]
        return out, sum(extra for _, extra in parts).reshape(1)

    def capacity_exchange(x, experts, gates, local_weights, per_device):
        n, k = experts.shape
        flat = experts.reshape(-1)
        device = jnp.minimum(flat // per_device, ep)  # ep: dropped
        rank, _ = rank_within(device, ep + 1)
        # Slot of each assignment in the send buffer [ep, capacity]; past the end when dropped.
        slot = jnp.where(device < ep, device * capacity + rank, ep * capacity)
        assignment = jnp.arange(n * k, dtype=jnp.int32)
        source = jnp.full(ep * capacity, n * k, jnp.int32).at[slot].set(assignment, mode="drop")
        local_ids = jnp.where(source < n * k, jnp.take(flat, source, mode="fill", fill_value=0) % per_device,
                              per_device)  # per_device: an empty slot, no expert
        send = jnp.take(x, source // k, axis=0, mode="fill", fill_value=0)

        def exchange(a):
            return jax.lax.all_to_all(a.reshape(ep, capacity, *a.shape[1:]), EXPERT_AXIS, 0, 0, tiled=True)

        received = checkpoint_name(exchange(send).reshape(ep * capacity, -1), EXCHANGED)
        received_ids = checkpoint_name(exchange(local_ids).reshape(ep * capacity, 1), EXCHANGED)
        ones = jnp.ones((ep * capacity, 1), jnp.float32)
        y = run_experts(received, received_ids, ones, *local_weights, ep * capacity)
        # row slot: the output of this device's assignment
        back = checkpoint_name(exchange(y).reshape(ep * capacity, -1), EXCHANGED)
        out = jnp.take(back, slot, axis=0, mode="fill", fill_value=0).reshape(n, k, -1)
        return checkpoint_name(jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), gates).astype(x.dtype), EXCHANGED)

    out, extra = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows) + (expert_spec,) * len(weights),
        out_specs=(rows, rows),
        # Under the pipeline's vmap over stages (spmd_axis_name), JAX 0.10's scan batching gives a loop carry
        # the stage's variation in its output but not its input and refuses the loop; unchecked, the values
        # and gradients equal the unpipelined model's (tests/parallel/test_pipeline.py).
        check_vma=False,
    )(tokens, experts, gates, *weights)
    return out, jnp.max(extra)
