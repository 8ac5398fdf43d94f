"""The device mesh and the layout: the rules table mapping logical axis names onto mesh axes.

Parameters and activations carry logical names (`embed`, `mlp`, `batch`, ...);
`mesh.rules` in the config says which mesh axes shard each. A dimension that
its mesh axes do not divide stays replicated on them rather than failing, and a
mesh axis already used by an earlier dimension is skipped (activations: `batch`
takes `fsdp`, so their `embed` is not sharded). The layout is passed to the
model explicitly, so code inside `shard_map` can take the mesh from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax.config import MESH_AXES, ConfigError, MeshConfig


def mesh_shape(cfg: MeshConfig, n_devices: int, cpu: bool = False) -> tuple[int, ...]:
    """Sizes of MESH_AXES for n_devices, the one -1 axis (data or fsdp) taking what is left; `cpu`: the devices are
    a CPU's, which XLA can be told to split into more."""
    sizes = [getattr(cfg, axis) for axis in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ConfigError("mesh: at most one of data/fsdp may be -1 (all devices left over)")
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % fixed:
            raise ConfigError(f"mesh: {n_devices} devices are not divisible by the fixed mesh axes ({fixed})")
        sizes[sizes.index(-1)] = n_devices // fixed
    if math.prod(sizes) > n_devices:
        named = " x ".join(MESH_AXES)
        raise ConfigError(
            f"mesh: {named} = {math.prod(sizes)} but there are only {n_devices} devices; "
            "shrink the mesh or set one of mesh.data/mesh.fsdp to -1"
            + (f"; or, to try this layout on this CPU, give it {math.prod(sizes)} devices: run with "
               f"XLA_FLAGS=--xla_force_host_platform_device_count={math.prod(sizes)}" if cpu else "")
        )
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The mesh over the first devices it needs (all of them when an axis is -1); `devices` defaults to
    jax.devices() and may be any list, e.g. the compile-only devices of a TPU topology."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices), cpu=devices[0].platform == "cpu")
    return Mesh(np.asarray(devices[: math.prod(shape)]).reshape(shape), MESH_AXES)


@dataclass(frozen=True)
class Layout:
    """A mesh and the rules placing logical axes on it."""

    mesh: Mesh
    rules: dict[str, tuple[str, ...]]

    def spec(self, names: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
        spec, used = [], set()
        for name, dim in zip(names, shape):
            if name not in self.rules:
                raise ConfigError(f"mesh.rules has no entry for the logical axis {name!r}")
            axes = tuple(a for a in self.rules[name] if self.mesh.shape[a] > 1 and a not in used)
            if axes and dim % math.prod(self.mesh.shape[a] for a in axes) == 0:
                spec.append(axes)
                used.update(axes)
            else:
                spec.append(None)
        return PartitionSpec(*spec)

    def sharding(self, names: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names, shape))

    def shardings(self, axes_tree, shape_tree):
        """NamedShardings for a pytree of arrays (or shapes) given the matching pytree of logical names."""
        return jax.tree.map(lambda names, x: self.sharding(names, getattr(x, "shape", x)),
                            axes_tree, shape_tree, is_leaf=lambda t: isinstance(t, tuple))

    def constrain(self, x: jax.Array, names: tuple[str, ...]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.sharding(names, x.shape))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(self.rules["batch"])

    @property
    def data_parallel_size(self) -> int:
        """Devices a batch is split over."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def make_layout(cfg: MeshConfig, devices=None) -> Layout:
    return Layout(make_mesh(cfg, devices), {name: tuple(axes) for name, axes in cfg.rules.items()})


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def constrain(layout: Layout | None, x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Pin an activation to the layout; a no-op without one (single-device code)."""
    return x if layout is None else layout.constrain(x, names)


def platform(layout: Layout | None) -> str:
    """'cpu', 'gpu' or 'tpu': where the layout's devices are, which need not be where JAX runs (an ahead-of-time
    compile for a TPU slice runs on a CPU); without a layout, JAX's default backend."""
    if layout is None:
        return jax.default_backend()
    name = layout.mesh.devices.flat[0].platform
    return "gpu" if name in ("cuda", "rocm") else name
