"""Compiled train-step memory of a preset on a fake CPU mesh, from XLA's own buffer assignment.

    python benchmarks/step_memory.py olmo3_7b [--devices 8] [key=value ...]

Compiles the real train step (the function `olmax train` runs) for `--devices` fake CPU devices with
`mesh.fsdp` over all of them and `train.micro_batch_per_device` instances per device in one micro-step,
from abstract inputs (nothing is allocated), and prints `memory_analysis()` per device: arguments (params,
optimizer state, batch), outputs and temporaries (activations, logits, gradients).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    from olmax.config import load_config
    from olmax.parallel.mesh import make_layout
    from olmax.train.step import batch_shardings, create_state, jit_train_step

    probe = load_config(args.config, args.overrides)
    rows = probe.train.micro_batch_per_device * args.devices
    cfg = load_config(args.config, [f"mesh.fsdp={args.devices}", f"train.global_batch_instances={rows}",
                                    *args.overrides])
    layout = make_layout(cfg.mesh)
    seq = cfg.data.sequence_length
    state = jax.eval_shape(lambda: create_state(cfg, layout, jax.random.key(0)))
    sharding = batch_shardings(layout, seq, rows)
    batch = {"input_ids": jax.ShapeDtypeStruct((1, rows, seq), jnp.int32, sharding=sharding["input_ids"]),
             "instance_mask": jax.ShapeDtypeStruct((1, rows), jnp.bool_, sharding=sharding["instance_mask"])}
    started = time.perf_counter()
    compiled = jit_train_step(cfg, layout, rows).lower(state, batch).compile()
    m = compiled.memory_analysis()
    gib = 2**30
    print(f"{args.config} {' '.join(args.overrides)}: {cfg.train.micro_batch_per_device} x {seq} tokens per device, "
          f"{args.devices} devices, impl.loss_chunk {cfg.impl.loss_chunk}, compute {cfg.impl.compute_dtype}; "
          f"compiled in {time.perf_counter() - started:.0f} s")
    print(f"per device: arguments {m.argument_size_in_bytes / gib:.2f} GiB, outputs {m.output_size_in_bytes / gib:.2f}"
          f" GiB, temporaries {m.temp_size_in_bytes / gib:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
