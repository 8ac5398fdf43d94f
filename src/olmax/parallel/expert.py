"""Expert parallelism: experts stay resident on the `expert` mesh axis and tokens travel to them.

Each device holds a shard of the batch's tokens and E / P of the experts (P = size of the expert
axis; the tokens are sharded over it too). Inside shard_map the devices of an expert group exchange
their tokens, with the ids and gates of the experts each device owns, in one all_to_all over the
expert axis; each runs its own experts on its assignments (only those: the grouped matmul skips
the rest) and sends back its share of each token's output, which the token's device sums. Expert
weights are never gathered, unlike FSDP, which would re-gather every expert for every micro-batch;
OLMo-core's expert-parallel MoE (olmo_core/nn/moe/v2) keeps its experts resident the same way.

all_to_all needs static shapes, and without dropping a device may receive every token of its
group, so by default (dropless) every token travels to every device of the group once (not once per
assignment): the traffic, and the receive buffer, of an all-gather of the group's tokens, P times a
device's tokens. `ragged_all_to_all` would send only the routed rows, but it does not compile on
XLA:CPU. With a capacity per peer (`impl.moe.ep_capacity`), each device sends each peer only the
assignments routed there, up to `capacity` rows (assignments beyond it are dropped before the
exchange, by `drop_over_peer_capacity`, and counted): buffers of P x capacity rows, about
factor x k x a device's tokens, whatever P.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

EXPERT_AXIS = "expert"


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


def rank_within(ids: jax.Array, num_ids: int) -> tuple[jax.Array, jax.Array]:
    """For int ids [R] in [0, num_ids): each element's rank among equal ids in order, and the counts [num_ids]."""
    order = jnp.argsort(ids, stable=True)
    counts = jnp.zeros(num_ids, jnp.int32).at[ids].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(ids.size, dtype=jnp.int32) - starts[ids[order]]
    return jnp.zeros_like(rank_sorted).at[order].set(rank_sorted), counts


def peer_capacity(local_tokens: int, top_k: int, ep: int, factor: float) -> int:
    """Rows a device sends each peer of its expert group: factor x its mean share of the assignments."""
    return max(1, math.ceil(factor * local_tokens * top_k / ep))


def drop_over_peer_capacity(experts: jax.Array, n_experts: int, ep: int, ranks: int, capacity: int) -> jax.Array:
    """experts [N, k] with the assignments beyond `capacity` per (batch shard, destination device) set to
    n_experts (dropped): each of the `ranks` contiguous shards keeps, for each device of the expert axis,
    its first `capacity` assignments there in (token, slot) order."""
    per_rank = experts.reshape(ranks, -1)
    device = jnp.minimum(per_rank // (n_experts // ep), ep)  # dropped ids (n_experts) -> ep: none
    rank, _ = jax.vmap(rank_within, in_axes=(0, None))(device, ep + 1)
    return jnp.where(rank < capacity, per_rank, n_experts).reshape(experts.shape)


def routed_experts(
    run_experts: Callable,
    tokens: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    weights: tuple[jax.Array, ...],
    mesh: Mesh,
    batch_axes: tuple[str, ...],
    capacity: int | None = None,
) -> jax.Array:
    """The routed output [N, D] of tokens [N, D] for expert ids [N, k] (E = dropped) and gates [N, k].

    `weights` have a leading expert dimension [E, ...], sharded over the expert axis.
    `run_experts(x [M, D], groups [M, k] ids in [0, G] (G = none), gates [M, k], *local_weights,
    expected_rows)` computes sum_k gates * expert_k(x) [M, D] on one device's G local experts.
    `capacity` (rows per peer; see `drop_over_peer_capacity`, which must have been applied with it): send
    only the routed rows; None: every token to every device of the group (dropless).
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
    expert_spec = PartitionSpec(EXPERT_AXIS if ep > 1 else None)

    def local(x, experts, gates, *local_weights):
        n, k = experts.shape
        if ep == 1:
            return run_experts(x, experts, gates, *local_weights, n * k)
        per_device = n_experts // ep
        # Every token goes once to every device of the expert group, with the ids (local to that
        # device) of its experts there, or `per_device` (none). A static buffer that could hold fewer
        # rows per device would drop tokens whenever routing concentrates on one device.
        if capacity is not None:
            return capacity_exchange(x, experts, gates, local_weights, per_device)
        device = jnp.arange(ep)[:, None, None]
        groups = jnp.where(experts // per_device == device, experts % per_device, per_device)

        def exchange(a):
            return jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True)

        received = exchange(jnp.broadcast_to(x, (ep, *x.shape))).reshape(ep * n, -1)
        received_groups = exchange(groups).reshape(ep * n, k)
        received_gates = exchange(jnp.broadcast_to(gates, (ep, *gates.shape))).reshape(ep * n, k)
        y = run_experts(received, received_groups, received_gates, *local_weights, n * k)
        # Each device returns its experts' share of every token's output; the shares add up.
        return jnp.sum(exchange(y.reshape(ep, n, -1)), axis=0)

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

        received = exchange(send).reshape(ep * capacity, -1)
        received_ids = exchange(local_ids).reshape(ep * capacity, 1)
        ones = jnp.ones((ep * capacity, 1), jnp.float32)
        y = run_experts(received, received_ids, ones, *local_weights, ep * capacity)
        back = exchange(y).reshape(ep * capacity, -1)  # row slot: the output of this device's assignment
        out = jnp.take(back, slot, axis=0, mode="fill", fill_value=0).reshape(n, k, -1)
        return jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), gates).astype(x.dtype)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows) + (expert_spec,) * len(weights),
        out_specs=rows,
        # Under the pipeline's vmap over stages (spmd_axis_name), JAX 0.10's scan batching gives a loop carry
        # the stage's variation in its output but not its input and refuses the loop; unchecked, the values
        # and gradients equal the unpipelined model's (tests/parallel/test_pipeline.py).
        check_vma=False,
    )(tokens, experts, gates, *weights)
