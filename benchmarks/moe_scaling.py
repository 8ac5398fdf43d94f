"""MoE layer forward+backward time as the expert count grows at fixed active parameters.

Shape (default): tokens 4096 x d_model 256, top-4 of E experts with SwiGLU hidden 256, so the
active parameters and the useful FLOPs per token do not depend on E (8, 32, 128 experts:
1.6M, 6.3M, 25M expert parameters). Routing is "random" with one fixed key, so every row sees the
same inputs and an even load in expectation, whatever the router learned. Each row runs in a
fresh process; a row is one dispatch (block-padded grouped matmul or jax.lax.ragged_dot) on one
device or with experts spread over N fake CPU devices (expert parallelism, all_to_all).

    python benchmarks/moe_scaling.py [--experts 8 32 128] [--dispatch blocks ragged_dot] [--devices 1 8]
                                     [--steps 5] [--tokens 2048] [--d-model 256] [--expert-hidden 256]

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


def run_row(args, experts: int, dispatch: str, devices: int) -> dict:
    """One row, in this process (a fresh one, with `devices` fake devices: see main)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from olmax.config import MoEConfig
    from olmax.model import moe

    cfg = MoEConfig(num_experts=experts, top_k=args.top_k, expert_hidden=args.expert_hidden, routing="random",
                    dispatch=dispatch)
    kp, kx, kc = jax.random.split(jax.random.key(0), 3)
    p = moe.init_params(cfg, args.d_model, kp)
    x = jax.random.normal(kx, (1, args.tokens, args.d_model))
    cotangent = jax.random.normal(kc, x.shape)
    key = jax.random.key(1)
    mesh, axes = None, ()
    if devices > 1:
        mesh, axes = Mesh(np.array(jax.devices()[:devices]), ("expert",)), ("expert",)
        x = x.reshape(devices, -1, args.d_model)  # the batch is what shards over devices
        cotangent = cotangent.reshape(x.shape)
        p = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec("expert" if k[0] == "w" else None)))
             for k, v in p.items()}
        x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("expert")))

    def objective(p, x):
        out, aux = moe.moe_mlp(cfg, p, x, key=key, mesh=mesh, batch_axes=axes)
        return jnp.sum(out * cotangent) + aux["load_balancing_loss"] + aux["router_z_loss"]

    step = jax.jit(jax.grad(objective, argnums=(0, 1)))
    start = time.perf_counter()
    jax.block_until_ready(step(p, x))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(step(p, x))
        times.append(time.perf_counter() - start)
    return {"times": times, "compile_s": compile_s,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--dispatch", nargs="+", default=["blocks", "ragged_dot"], choices=["blocks", "ragged_dot"])
    parser.add_argument("--devices", type=int, nargs="+", default=[1], help="1 = one device; N = EP on N fake ones")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
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
    active = args.top_k * 3 * args.d_model * args.expert_hidden
    print(f"tokens {args.tokens}  d_model {args.d_model}  top-{args.top_k} x expert hidden {args.expert_hidden}  "
          f"active expert params/token {active:,}  routing random")
    print(f"{'dispatch':<12}{'devices':>8}{'experts':>8}{'tokens/s':>10}{'step s':>9}{'vs first':>9}"
          f"{'compile s':>10}{'RSS GiB':>9}")
    report = []
    for dispatch in args.dispatch:
        for devices in args.devices:
            first = None
            for experts in args.experts:
                child = [sys.executable, __file__, "--row", f"{experts},{dispatch},{devices}", "--steps",
                         str(args.steps), "--tokens", str(args.tokens), "--d-model", str(args.d_model),
                         "--expert-hidden", str(args.expert_hidden), "--top-k", str(args.top_k)]
                flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
                env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
                out = subprocess.run(child, check=True, capture_output=True, text=True, env=env).stdout
                r = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ROW ")))
                step_s = statistics.median(r["times"])
                tps = args.tokens / step_s
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
