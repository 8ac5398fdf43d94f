"""XLA's temporaries per device of the compiled train step, unpipelined and with pipeline schedules, on
8 fake CPU devices: what a schedule costs in memory at a shape where the block parameters are a large
share of it (16 layers, d 256, batch 8 x 32 tokens, bf16 compute). Figures compare with each other only.

    .venv/bin/python benchmarks/pipeline_memory.py [--remat none|full|NAME,NAME...]
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from olmax.config import load_config  # noqa: E402
from olmax.parallel.mesh import make_layout  # noqa: E402
from olmax.scale.compile import abstract_inputs, device_bytes  # noqa: E402
from olmax.train.step import jit_train_step  # noqa: E402

SHAPE = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4", "model.mlp_hidden=1024", "model.n_layers=16",
         "model.layer_pattern=[global]", "train.global_batch_instances=8", "data.sequence_length=32",
         "impl.compute_dtype=bfloat16", "mesh.fsdp=1"]
LAYOUTS = {
    "unpipelined, 1 device": [],
    "4 stages, GPipe, 8 micro-batches": ["mesh.stage=4", "impl.pipeline.microbatches=8"],
    "4 stages, circular x4, 8 micro-batches": ["mesh.stage=4", "impl.pipeline.microbatches=8",
                                               "impl.pipeline.schedule=circular", "impl.pipeline.repeats=4"],
    "4 stages, 1F1B, 8 micro-batches": ["mesh.stage=4", "impl.pipeline.microbatches=8", "impl.pipeline.schedule=1f1b"],
    "4 stages, interleaved 1F1B x4, 8 micro-batches": ["mesh.stage=4", "impl.pipeline.microbatches=8",
                                                       "impl.pipeline.schedule=interleaved_1f1b",
                                                       "impl.pipeline.repeats=4"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remat", default="qkv_proj,out_proj,mlpwi_0,mlpwo,context")
    args = parser.parse_args()
    remat = args.remat if args.remat in ("none", "full") else f"[{args.remat}]"
    print(f"| layout (remat {args.remat}) | parameters per device (MiB) | temporaries per device (MiB) |")
    print("| --- | ---: | ---: |")
    for label, overrides in LAYOUTS.items():
        cfg = load_config("tiny", [*SHAPE, f"impl.remat={remat}", *overrides])
        layout = make_layout(cfg.mesh)
        state, batch = abstract_inputs(cfg, layout, cfg.train.global_batch_instances)
        compiled = jit_train_step(cfg, layout, cfg.train.global_batch_instances).lower(state, batch).compile()
        memory = compiled.memory_analysis()
        print(f"| {label} | {device_bytes(state.params) / 2**20:.1f} | {memory.temp_size_in_bytes / 2**20:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
