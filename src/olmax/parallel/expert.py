"""Expert parallelism: experts stay resident on the `expert` mesh axis and tokens travel to them.

Each device holds a shard of the batch's tokens and E / P of the experts (P = size of the expert
axis; the tokens are sharded over it too). Inside shard_map a device sorts its assignments by the
device owning their expert, exchanges them with one all_to_all over the expert axis, runs its own
experts on what it received, and sends the results back the same way. Expert weights are never
gathered, unlike FSDP, which would re-gather every expert for every micro-batch; OLMo-core's
expert-parallel MoE (olmo_core/nn/moe/v2) keeps its experts resident the same way.

all_to_all needs static shapes, so each device reserves room for the worst case (every assignment
of its tokens to one device: n tokens x min(k, E / P) rows per destination) and sends padding
rows; only the used blocks are computed. `ragged_all_to_all` would send only the real rows, but it
does not compile on XLA:CPU.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

EXPERT_AXIS = "expert"


def rank_within(ids: jax.Array, num_ids: int) -> tuple[jax.Array, jax.Array]:
    """For int ids [R] in [0, num_ids): each element's rank among equal ids in order, and the counts [num_ids]."""
    order = jnp.argsort(ids, stable=True)
    counts = jnp.zeros(num_ids, jnp.int32).at[ids].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(ids.size, dtype=jnp.int32) - starts[ids[order]]
    return jnp.zeros_like(rank_sorted).at[order].set(rank_sorted), counts


def _sharded_batch_axes(mesh: Mesh, batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)


def batch_shards(mesh: Mesh, batch_axes: tuple[str, ...]) -> int:
    """How many contiguous shards the batch is cut into (the data-parallel ranks)."""
    return math.prod(mesh.shape[a] for a in _sharded_batch_axes(mesh, batch_axes))


def per_shard(fn: Callable, mesh: Mesh, batch_axes: tuple[str, ...], *arrays: jax.Array):
    """fn on each batch shard of row-wise arrays [N, ...], for ops the SPMD partitioner would otherwise
    run on the whole gathered batch on every device (XLA's TopK custom call)."""
    rows = PartitionSpec(_sharded_batch_axes(mesh, batch_axes) or None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(rows,) * len(arrays), out_specs=rows)(*arrays)


def routed_experts(
    run_experts: Callable,
    tokens: jax.Array,
    experts: jax.Array,
    weights: tuple[jax.Array, ...],
    mesh: Mesh,
    batch_axes: tuple[str, ...],
) -> jax.Array:
    """Each assignment's expert output [N, k, D] for tokens [N, D] and expert ids [N, k] (E = dropped).

    `weights` have a leading expert dimension [E, ...], sharded over the expert axis.
    `run_experts(x [M, D], groups [M, k'] ids in [0, G] (G = none), *local_weights, expected_rows)`
    computes [M, k', D] on one device's G local experts.
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

    def local(x, experts, *local_weights):
        n, k = experts.shape
        if ep == 1:
            return run_experts(x, experts, *local_weights, n * k)
        per_device = n_experts // ep
        chunk = n * min(k, per_device)  # the most rows one device can send to another
        flat = experts.reshape(-1)
        dest = flat // per_device  # dropped assignments (id E) get dest = ep: sent nowhere
        rank, _ = rank_within(dest, ep + 1)
        slot = jnp.where(dest < ep, dest * chunk + rank, ep * chunk)
        source = jnp.full(ep * chunk, flat.size, jnp.int32).at[slot].set(jnp.arange(flat.size), mode="drop")
        send_x = jnp.take(x, source // k, axis=0, mode="fill", fill_value=0)
        send_group = jnp.where(source < flat.size, flat[jnp.minimum(source, flat.size - 1)] % per_device, per_device)

        def exchange(a):
            return jax.lax.all_to_all(a.reshape(ep, chunk, *a.shape[1:]), EXPERT_AXIS, 0, 0, tiled=True)

        received = exchange(send_x).reshape(ep * chunk, -1)
        groups = exchange(send_group).reshape(ep * chunk, 1)
        y = run_experts(received, groups, *local_weights, n * k)[:, 0]
        back = exchange(y).reshape(ep * chunk, -1)
        return jnp.take(back, slot, axis=0, mode="fill", fill_value=0).reshape(n, k, -1)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows) + (expert_spec,) * len(weights),
        out_specs=rows,
    )(tokens, experts, *weights)
