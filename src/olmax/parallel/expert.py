"""Expert parallelism: experts stay resident on the `expert` mesh axis and tokens travel to them.

Each device holds a shard of the batch's tokens and E / P of the experts (P = size of the expert
axis; the tokens are sharded over it too). Inside shard_map the devices of an expert group exchange
their tokens, with the ids and gates of the experts each device owns, in one all_to_all over the
expert axis; each runs its own experts on its assignments (only those: the grouped matmul skips
the rest) and sends back its share of each token's output, which the token's device sums. Expert
weights are never gathered, unlike FSDP, which would re-gather every expert for every micro-batch;
OLMo-core's expert-parallel MoE (olmo_core/nn/moe/v2) keeps its experts resident the same way.

all_to_all needs static shapes, and without dropping a device may receive every token of its
group, so every token travels to every device of the group once (not once per assignment):
the traffic of an all-gather of the group's tokens. `ragged_all_to_all` would send only the
routed rows, but it does not compile on XLA:CPU.
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


def routed_experts(
    run_experts: Callable,
    tokens: jax.Array,
    experts: jax.Array,
    gates: jax.Array,
    weights: tuple[jax.Array, ...],
    mesh: Mesh,
    batch_axes: tuple[str, ...],
) -> jax.Array:
    """The routed output [N, D] of tokens [N, D] for expert ids [N, k] (E = dropped) and gates [N, k].

    `weights` have a leading expert dimension [E, ...], sharded over the expert axis.
    `run_experts(x [M, D], groups [M, k] ids in [0, G] (G = none), gates [M, k], *local_weights,
    expected_rows)` computes sum_k gates * expert_k(x) [M, D] on one device's G local experts.
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

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows) + (expert_spec,) * len(weights),
        out_specs=rows,
        # Under the pipeline's vmap over stages (spmd_axis_name), JAX 0.10's scan batching gives a loop carry
        # the stage's variation in its output but not its input and refuses the loop; unchecked, the values
        # and gradients equal the unpipelined model's (tests/test_pipeline.py).
        check_vma=False,
    )(tokens, experts, gates, *weights)
