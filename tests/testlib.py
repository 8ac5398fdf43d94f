"""Helpers that tests import (`from testlib import ...`; tests/ is on the path through its conftest)."""

import os
from pathlib import Path


def child_env(cache_dir: Path, devices: int, **extra) -> dict:
    """The environment of training children: `devices` CPU devices (not the 8 of conftest) and a shared
    compilation cache, so the restarted attempt does not compile again."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **extra}


def moe_layer_params(cfg, d_model: int, key, std: float = 0.02) -> dict:
    """One MoE layer's parameters for tests of the layer alone, from the
    families' MoE rows: every matrix ~ N(0, std) truncated at +-3 std, the selection bias 0."""
    import jax
    import jax.numpy as jnp

    from olmax.model.families.base import moe_shapes

    shapes = {name: shape for name, (shape, _) in moe_shapes(cfg, d_model).items()}
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    return {name: jnp.zeros(shape) if name == "score_bias"
            else std * jax.random.truncated_normal(keys[name], -3.0, 3.0, shape, jnp.float32)
            for name, shape in shapes.items()}


def event_histograms(directory) -> dict:
    """{(tag, step): HistogramProto} of the TensorBoard event files in `directory`."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in directory.glob("events*"):
        data, offset = path.read_bytes(), 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 12 + length + 4
            out.update({(v.tag, event.step): v.histo for v in event.summary.value if v.HasField("histo")})
    return out
