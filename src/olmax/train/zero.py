"""ZeRO-1, the distributed optimizer: optimizer state sharded over the mesh axes its parameter is replicated on.

A parameter the layout replicates over some mesh axes (all of them over mesh.data; norm gains over fsdp too;
expert weights, resident on the expert axis, over the other batch axes) gets Adam moments replicated there as
well. With
`impl.shard_optimizer` each moment is split over those axes instead, on the dimensions they divide. The
train step then hands the optimizer the gradients and parameters on these shards (slices of replicated
arrays: no communication beyond the gradient reduction), the update is computed per shard, and the new
parameters are all-gathered back to their own layout.

Adam, weight decay, clipping and the skip-step are elementwise once the global gradient norm is known,
so shards give the same bits as whole arrays. The norm is a sum over all elements, whose rounding depends
on how the elements are split: the train step computes it once, from the gradients in the parameters'
layout, and passes it in, so the sharded and unsharded optimizers see the same value up to the order XLA
sums in within each compiled program (the same here; 1 ulp apart at one step of 20 on an AVX-512 CPU).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

from olmax.parallel.mesh import spec_axes


def sharded_spec(mesh, spec: PartitionSpec, shape: tuple[int, ...]) -> PartitionSpec:
    """`spec` plus every mesh axis (of size > 1) it does not use, each on the dimension with the most
    elements per device that it divides; an axis no dimension takes stays replicated."""
    dims = [list(spec_axes(spec[i] if i < len(spec) else None)) for i in range(len(shape))]
    used = {a for d in dims for a in d}
    for axis in mesh.axis_names:
        size = mesh.shape[axis]
        if size == 1 or axis in used:
            continue
        local = [n // math.prod(mesh.shape[a] for a in d) for n, d in zip(shape, dims)]
        fits = [i for i, n in enumerate(local) if n % size == 0]
        if fits:
            dims[max(fits, key=lambda i: local[i])].append(axis)
            used.add(axis)
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


def shardings(param_shardings, shapes):
    """The ZeRO-1 sharding of each parameter's optimizer state (and of the update computed on it), from the
    parameters' shardings and shapes (tuples or arrays)."""
    def one(sharding, x):
        return NamedSharding(sharding.mesh, sharded_spec(sharding.mesh, sharding.spec, getattr(x, "shape", x)))

    return jax.tree.map(one, param_shardings, shapes)
