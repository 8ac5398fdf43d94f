"""The device mesh and the one rules table mapping logical axis names onto it.

Parameters and activations carry logical names (`embed`, `mlp`, `batch`, ...);
RULES says which mesh axes shard each. A dimension that a mesh axis does not
divide stays replicated on that axis rather than failing, and a mesh axis
already used by an earlier dimension is skipped (activations: `batch` takes
`fsdp`, so their `embed` is not sharded).
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor", "expert")

RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": ("expert",),
    "layers": (),
    "length": (),
    "norm": (),
}

_active: list[Mesh] = []


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, ...]:
    sizes = [cfg.data, cfg.fsdp, cfg.tensor, cfg.expert]
    if sizes.count(-1) > 1:
        raise ConfigError("mesh: at most one of data/fsdp may be -1 (all devices left over)")
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % fixed:
            raise ConfigError(f"mesh: {n_devices} devices are not divisible by the fixed mesh axes ({fixed})")
        sizes[sizes.index(-1)] = n_devices // fixed
    if math.prod(sizes) > n_devices:
        raise ConfigError(
            f"mesh: data x fsdp x tensor x expert = {math.prod(sizes)} but there are only {n_devices} devices; "
            "shrink the mesh or set one of mesh.data/mesh.fsdp to -1"
        )
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The mesh over the first data x fsdp x tensor x expert of `devices` (default jax.devices(); all of them
    when an axis is -1). `olmax compile` passes the compile-only devices of a TPU slice or GPU host."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices[: math.prod(shape)]).reshape(shape), AXES)


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in RULES["batch"])


def logical_spec(names: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    spec, used = [], set()
    for name, dim in zip(names, shape):
        axes = tuple(a for a in RULES[name] if mesh.shape[a] > 1 and a not in used)
        if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0:
            spec.append(axes)
            used.update(axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def shardings(axes_tree, shape_tree, mesh: Mesh):
    """NamedShardings for a pytree of arrays (or shapes) given the matching pytree of logical names."""
    return jax.tree.map(
        lambda names, x: NamedSharding(mesh, logical_spec(names, getattr(x, "shape", x), mesh)),
        axes_tree, shape_tree, is_leaf=lambda t: isinstance(t, tuple),
    )


@contextlib.contextmanager
def activation_sharding(mesh: Mesh):
    """Inside, `constrain` pins activations to the mesh; outside it is a no-op."""
    _active.append(mesh)
    try:
        yield
    finally:
        _active.pop()


def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    if not _active:
        return x
    mesh = _active[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(names, x.shape, mesh)))
