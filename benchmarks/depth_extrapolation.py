"""`olmax tune --depth reduced` against full compiles: how far a step's peak and predicted time, extrapolated
from compiles at one and two units of its repeated layers (olmax.scale.tune_depth.depths), are from the full compile's,
and what each compile took.

    python benchmarks/depth_extrapolation.py [--rows NAME ...] [--json OUT]
    python benchmarks/depth_extrapolation.py --config tiny --target tpu:v5p:2x2x1 model.n_layers=16   # your own row

Compiles are cached by program (`olmax compile`'s cache), so a rerun reads its figures back; compile times are
those of the first compile (this machine's, under whatever else ran beside it).
"""

from __future__ import annotations

import argparse
import json
import time

ROWS = {
    "7b": ("olmo3_7b", "gpu:h100x8", []),
    "32b-pipelined": ("olmo3_32b", "gpu:h100x64", ["mesh.stage=4", "mesh.fsdp=16", "impl.pipeline.microbatches=4",
                                                   "train.micro_batch_per_device=4"]),
    "47b": ("olmo3_moe_47b", "gpu:b300x8", []),
    "1.2t": ("olmo_moe_1t", "gpu:b300x512", ["mesh.stage=1", "mesh.expert=64", "mesh.fsdp=8",
                                             "impl.pipeline.microbatches=null", "train.micro_batch_per_device=1"]),
}


def row(name: str, config: str, target_name: str, overrides: list[str]) -> dict:
    from olmax.config import load_config
    from olmax.scale import targets, tune, tune_depth

    target = targets.parse_target(target_name)
    cfg = load_config(config, overrides, target.name)
    at = tune_depth.depths(cfg)
    if at is None:
        return {"row": name, "config": config, "target": target_name, "reduced": None}
    figures = {}
    for layers in (*at, cfg.model.n_layers):
        start = time.perf_counter()
        report = tune._compiled(tune_depth.at_depth(cfg, layers), target)
        figures[layers] = {"peak": report.get("peak"), "step": report.get("step_time", {}).get("step_seconds"),
                           "compile_seconds": report.get("compile_seconds"), "cached": report.get("compile_cached"),
                           "wall_seconds": time.perf_counter() - start}
    full = figures[cfg.model.n_layers]
    out = {"row": name, "config": config, "target": target_name, "overrides": overrides, "depths": list(at),
           "layers": cfg.model.n_layers, "figures": figures}
    for key in ("peak", "step"):
        guess = tune_depth.extrapolated(cfg.model.n_layers, at, [figures[d][key] for d in at])
        out[key] = {"extrapolated": guess, "full": full[key], "error": guess / full[key] - 1}
    return out


def main() -> None:
    from olmax import runtime

    runtime.skip_absent_tpus()  # compile-only targets, from this host's CPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--json", help="write the rows to this file too")
    parser.add_argument("--config", help="a row of your own: this config (with --target and overrides)")
    parser.add_argument("--target", help="the target of --config's row")
    parser.add_argument("overrides", nargs="*", help="key=value settings of --config's row")
    args = parser.parse_args()
    rows = {"own": (args.config, args.target, args.overrides)} if args.config else {n: ROWS[n] for n in args.rows}
    results = []
    print("| row | depths (of) | peak extrapolated / full GiB | error | step extrapolated / full s | error | "
          "compile s (reduced, reduced, full) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, (config, target, overrides) in rows.items():
        r = row(name, config, target, overrides)
        results.append(r)
        if r.get("reduced", True) is None:
            print(f"| {name} | under four units deep: compiled whole | | | | | |", flush=True)
            continue
        gib = 2**30
        times = ", ".join(f"{r['figures'][d]['compile_seconds']:.0f}" for d in (*r["depths"], r["layers"]))
        print(f"| {name} | {r['depths'][0]}, {r['depths'][1]} ({r['layers']}) | "
              f"{r['peak']['extrapolated'] / gib:.1f} / {r['peak']['full'] / gib:.1f} | {r['peak']['error']:+.1%} | "
              f"{r['step']['extrapolated']:.3g} / {r['step']['full']:.3g} | {r['step']['error']:+.1%} | {times} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
