"""Train-step throughput of a mixture of experts as the expert count grows at fixed active parameters.

The model (default): d_model 256, 2 layers of global attention (4 heads), in each an MoE of E experts of
SwiGLU hidden 256 with a top-4 router, vocab 512; a step is 16 x 256 tokens, the whole olmax train step
(forward, backward, clip, AdamW, skip-step, load metrics). The active parameters and the useful FLOPs per
token do not depend on E; the expert parameters do (8, 32, 128 experts: 3.1M, 12.6M, 50.3M). Routing is
"random" (keys drawn from the step), so every row sees the same tokens and an even load in expectation
whatever the router learned. Each row runs in a fresh process; a row is one dispatch (`impl.moe.dispatch`:
the block-padded grouped matmul or jax.lax.ragged_dot) on one device, or with the experts spread over N
fake CPU devices (expert parallelism, `mesh.expert=N`, all_to_all). Rows run as `olmax train` runs: glibc's
malloc on transparent huge pages (olmax.runtime).

    python benchmarks/moe_scaling.py [--experts 8 32 128] [--dispatch blocks ragged_dot] [--devices 1 8]
                                     [--steps 5] [--batch 16] [--seq 256] [--d-model 256] [--expert-hidden 256]

On XLA:CPU ragged_dot is expanded densely (every expert on every row): expect its time to grow
linearly with E. Run it alone on an idle machine: on 2 cores anything beside it moves the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from olmax.runtime import huge_pages_env


def run_row(args, experts: int, dispatch: str, devices: int) -> dict:
    """One row, in this process (a fresh one, with `devices` fake devices: see main)."""
    import jax
    import numpy as np

    from olmax.config import load_config
    from olmax.parallel.mesh import make_layout
    from olmax.train.step import batch_shardings, create_state, jit_train_step

    mesh = ["mesh.fsdp=1"] + ([f"mesh.expert={devices}"] if devices > 1 else [])
    cfg = load_config("tiny_moe", [
        f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", "model.n_heads=4", "model.n_kv_heads=null",
        "model.layer_pattern=[global]", f"model.moe.num_experts={experts}", f"model.moe.top_k={args.top_k}",
        f"model.moe.expert_hidden={args.expert_hidden}", "model.moe.routing=random", f"impl.moe.dispatch={dispatch}",
        f"data.sequence_length={args.seq}", f"train.global_batch_instances={args.batch}", "data.paths=[unused]",
        *mesh])
    layout = make_layout(cfg.mesh)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (1, args.batch, args.seq), dtype=np.int32)
    sharding = batch_shardings(layout, args.seq, args.batch)
    batch = {"input_ids": jax.device_put(tokens, sharding["input_ids"]),
             "instance_mask": jax.device_put(np.ones((1, args.batch), bool), sharding["instance_mask"])}
    state = create_state(cfg, layout, jax.random.key(0))
    step = jit_train_step(cfg, layout, args.batch)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return {"times": times, "compile_s": compile_s, "loss": float(metrics["train/CE loss"]),
            "load_imbalance": float(metrics["train/load imbalance"]),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--dispatch", nargs="+", default=["blocks", "ragged_dot"], choices=["blocks", "ragged_dot"])
    parser.add_argument("--devices", type=int, nargs="+", default=[1], help="1 = one device; N = EP on N fake ones")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first (compiling) one")
    parser.add_argument("--batch", type=int, default=16, help="instances per step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--expert-hidden", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: "experts,dispatch,devices"; prints its JSON
    args = parser.parse_args()

    if args.row:
        experts, dispatch, devices = args.row.split(",")
        print("ROW " + json.dumps(run_row(args, int(experts), dispatch, int(devices))))
        return
    tokens = args.batch * args.seq
    active = args.top_k * 3 * args.d_model * args.expert_hidden
    print(f"train step: {args.batch} x {args.seq} tokens, d_model {args.d_model}, {args.layers} MoE layers, "
          f"top-{args.top_k} x expert hidden {args.expert_hidden} (active expert params/token/layer {active:,}), "
          "routing random")
    print(f"{'dispatch':<12}{'devices':>8}{'experts':>8}{'tokens/s':>10}{'step s':>9}{'vs first':>9}"
          f"{'compile s':>10}{'RSS GiB':>9}")
    report = []
    for dispatch in args.dispatch:
        for devices in args.devices:
            first = None
            for experts in args.experts:
                child = [sys.executable, __file__, "--row", f"{experts},{dispatch},{devices}"] + [
                    f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                    if k in ("steps", "batch", "seq", "layers", "d_model", "expert_hidden", "top_k")]
                flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
                env = huge_pages_env({**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"})
                out = subprocess.run(child, check=True, capture_output=True, text=True, env=env).stdout
                r = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ROW ")))
                step_s = statistics.median(r["times"])
                tps = tokens / step_s
                first = first or tps
                print(f"{dispatch:<12}{devices:>8}{experts:>8}{tps:>10,.0f}{step_s:>9.3f}{tps / first:>9.2f}"
                      f"{r['compile_s']:>10.1f}{r['peak_rss_gib']:>9.2f}", flush=True)
                report.append({"dispatch": dispatch, "devices": devices, "experts": experts, "tokens_per_s": tps,
                               "median_step_s": step_s, **r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
