"""Train-step throughput of olmax next to HF transformers' Olmo3ForCausalLM + torch AdamW, in one run.

Shape (default): OLMo 3 blocks, d 512, 8 layers, 8 heads of 64, MLP 1536, vocab 8192,
window 256 on the 3:1 pattern, sequence 1024, batch 4: 35,668,480 parameters.
Prints tokens/s, median step time and MFU (training FLOPs from olmax.model.flops, against
the measured matmul peak of the framework and dtype used) and the peak RSS of each; for olmax also the
step time the step-time model predicts from the compiled step (olmax.scale.step_time, with this CPU's
matmul rate, memory and cache bandwidth and per-op cost measured in the same process).

Each row runs in a fresh process, one after another. olmax runs as `olmax train` does,
with glibc's malloc on transparent huge pages (olmax.runtime); transformers runs as it
ships, and once more in fp32 with the same malloc setting, so that both comparisons show.

    python benchmarks/train_throughput.py [--steps 10] [--skip-torch] [--olmax key=value ...] [--preset tiny]

Run it alone on an idle machine: on 2 cores anything beside it moves the figures.
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

import jax
import numpy as np

from olmax.config import load_config
from olmax.model import flops
from olmax.parallel.mesh import make_layout
from olmax.runtime import huge_pages_env
from olmax.train.metrics import measure_matmul_flops
from olmax.train.step import create_state, jit_train_step

SHAPE = [
    "model.vocab_size=8192", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8",
    "model.mlp_hidden=1536", "model.sliding_window=256", "model.layer_pattern=[sliding,sliding,sliding,global]",
    "data.sequence_length=1024", "train.global_batch_instances=4", "train.micro_batch_per_device=null",
    "data.eos_id=0", "data.pad_id=1", "optim.lr=3e-4", "schedule.warmup_steps=0", "schedule.kind=constant",
    "mesh.fsdp=1",
]


def timed(step_fn, n_warmup: int, n_steps: int) -> list[float]:
    for _ in range(n_warmup):
        step_fn()
    times = []
    for _ in range(n_steps):
        start = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - start)
    return times


def shape_config(preset: str, overrides: list[str]):
    """The benchmark's shape (SHAPE on the tiny preset's recipe), or a preset as it is, on one device."""
    return load_config("tiny", SHAPE + overrides) if preset == "shape" else load_config(preset, ["mesh.fsdp=1", *overrides])


def predicted_step(cfg, step, state, batch) -> float:
    """The step-time model's prediction for the compiled step on this CPU (measured now, in this process)."""
    from olmax.scale import hardware, op_cost, step_time

    windows = {kind: (cfg.model.sliding_window if kind == "sliding" else None) for kind in set(cfg.model.layer_pattern)}
    block = cfg.impl.attention.block
    attention = op_cost.AttentionInfo(cfg.data.sequence_length, windows, block, block)
    text = step.lower(state, batch).compile().as_text()
    return step_time.predict(text, hardware.measure_cpu(), None, attention)["step_seconds"]


def bench_olmax(overrides: list[str], steps: int, tokens: np.ndarray, preset: str = "shape") -> dict:
    cfg = shape_config(preset, overrides)
    layout = make_layout(cfg.mesh)
    state = create_state(cfg, layout, jax.random.key(0))
    step = jit_train_step(cfg, layout, cfg.train.global_batch_instances)
    batch = {"input_ids": tokens[None], "instance_mask": np.ones((1, tokens.shape[0]), bool)}
    holder = [state]

    def one():
        holder[0], metrics = step(holder[0], batch)
        jax.block_until_ready(metrics)

    times = timed(one, 2, steps)
    dtype = np.dtype(cfg.impl.compute_dtype if cfg.impl.compute_dtype != "auto" else "float32").name
    return {"cfg": cfg, "times": times, "peak": measure_matmul_flops(jax.numpy.dtype(dtype)), "dtype": dtype,
            "predicted_step_s": predicted_step(cfg, step, holder[0], batch)}


def bench_transformers(cfg, steps: int, tokens: np.ndarray, autocast_bf16: bool) -> dict:
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    torch.manual_seed(0)
    m = cfg.model
    hf_cfg = Olmo3Config(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.mlp_hidden,
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
        max_position_embeddings=cfg.data.sequence_length, sliding_window=m.sliding_window,
        layer_types=["full_attention" if m.is_global(i) else "sliding_attention" for i in range(m.n_layers)],
        rope_parameters={t: {"rope_type": "default", "rope_theta": m.rope["global"].theta}
                         for t in ("sliding_attention", "full_attention")}, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=False, attention_bias=False, pad_token_id=cfg.data.pad_id,
    )
    model = Olmo3ForCausalLM(hf_cfg)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    input_ids = torch.from_numpy(tokens.astype(np.int64))

    def one():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dtype = torch.bfloat16 if autocast_bf16 else torch.float32
    a = torch.ones(1024, 1024, dtype=dtype)
    best = min(timed(lambda: a @ a, 3, 10))
    return {"times": timed(one, 2, steps), "peak": 2 * 1024**3 / best, "dtype": "bfloat16-autocast" if autocast_bf16 else "float32"}


ROWS = {  # name: (framework, bf16 autocast, malloc on huge pages)
    "olmax": ("olmax", False, True),
    "transformers-fp32": ("transformers", False, False),
    "transformers-fp32-hugepages": ("transformers", False, True),
    "transformers-bf16": ("transformers", True, False),
}


def run_row(row: str, args, tokens: np.ndarray) -> dict:
    """One row, in this process (a fresh one: see main)."""
    framework, bf16, _ = ROWS[row]
    if framework == "olmax":
        r = bench_olmax(args.olmax, args.steps, tokens, args.preset)
        del r["cfg"]
    else:
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        r = bench_transformers(shape_config(args.preset, args.olmax), args.steps, tokens, bf16)
    return {**r, "framework": framework, "malloc": os.environ.get("GLIBC_TUNABLES") or "glibc default",
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--olmax", nargs="*", default=["impl.attention.block=128", "impl.scan_layers=false"], help="extra olmax overrides")
    parser.add_argument("--preset", default="shape", help="the shape above (default), or a preset as it is (tiny)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # internal: run one row, print its JSON
    args = parser.parse_args()

    cfg = shape_config(args.preset, args.olmax)
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, cfg.model.vocab_size, (cfg.train.global_batch_instances, cfg.data.sequence_length))
    tokens = tokens.astype(np.int32)
    if args.row:
        print("ROW " + json.dumps(run_row(args.row, args, tokens)))
        return
    count = flops.count(cfg.model, cfg.data.sequence_length)
    tokens_per_step = tokens.size
    report = []
    print(f"params {count.params:,}  train FLOPs/token {count.per_token / 1e6:.1f} M  "
          f"tokens/step {tokens_per_step}  jax {jax.__version__}")
    print(f"{'framework':<14}{'dtype':<19}{'malloc':<27}{'tokens/s':>9}{'step s':>8}{'MFU %':>7}"
          f"{'peak GFLOP/s':>13}{'RSS GiB':>9}")
    for row in ["olmax"] if args.skip_torch else list(ROWS):
        child = [sys.executable, __file__, "--row", row, "--steps", str(args.steps), "--preset", args.preset,
                 "--olmax", *args.olmax]
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        env = huge_pages_env(env) if ROWS[row][2] else env
        out = subprocess.run(child, check=True, capture_output=True, text=True, env=env).stdout
        r = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ROW ")))
        step_s = statistics.median(r["times"])
        tps = tokens_per_step / step_s
        mfu = 100 * tps * count.per_token / r["peak"]
        print(f"{r['framework']:<14}{r['dtype']:<19}{r['malloc']:<27}{tps:>9,.0f}{step_s:>8.3f}{mfu:>7.1f}"
              f"{r['peak'] / 1e9:>13,.0f}{r['peak_rss_gib']:>9.2f}", flush=True)
        report.append({"row": row, "framework": r["framework"], "dtype": r["dtype"], "malloc": r["malloc"],
                       "tokens_per_s": tps, "median_step_s": step_s, "step_s": r["times"], "mfu_percent": mfu,
                       "matmul_peak_flops": r["peak"], "peak_rss_gib": r["peak_rss_gib"],
                       "predicted_step_s": r.get("predicted_step_s")})
        if r.get("predicted_step_s"):
            print(f"  step-time model: predicted {r['predicted_step_s']:.3f} s against {step_s:.3f} s measured "
                  f"({r['predicted_step_s'] / step_s - 1:+.1%})", flush=True)
    by_row = {r["row"]: r["tokens_per_s"] for r in report}
    for torch_row in ("transformers-fp32", "transformers-fp32-hugepages"):
        if torch_row in by_row:
            print(f"olmax / {torch_row}: {by_row['olmax'] / by_row[torch_row]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
