"""Peak memory of `olmax convert` on a generated multi-GB HF Olmo3 checkpoint.

    .venv/bin/python benchmarks/convert_memory.py                 # OLMo 3 1B shape cut to 8 layers: 3.8 GB
    .venv/bin/python benchmarks/convert_memory.py --layers 16     # the full 1B shape: 6.0 GB

Writes a random float32 HF checkpoint (config.json + 1 GB safetensors shards,
as `save_pretrained` would) under a temporary directory, converts it with
hf-to-olmax and back with olmax-to-hf, each in a fresh process, and reports
each process's peak resident memory (VmHWM) next to the size of the model.
A baseline process that only imports olmax, jax and safetensors gives the
fixed cost; `hf_read_only` is the streaming read alone (hf-to-olmax without
the Orbax write). Everything generated is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from olmax.config import validate
from olmax.interop.hf import INDEX_FILE
from olmax.model import families

GB = 1e9
# VmHWM, not ru_maxrss: ru_maxrss survives exec and would count the parent's pages from before it.
PEAK = "print('PEAK_KB', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
BASELINE = "import jax, safetensors, orbax.checkpoint, olmax.interop.hf"


def write_hf_checkpoint(directory: Path, cfg, shard_bytes: int) -> int:
    """Random float32 tensors of the model, one tensor in memory at a time; total bytes written."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight_map, shard, shard_size, index, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, shard_size, index
        index += 1
        name = f"model-{index:05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_size = {}, 0

    for name, (p, at) in families.foreign_tensors(cfg.model).items():
        shape = p.foreign_shape(cfg.model, at)
        nbytes = math.prod(shape) * 4
        if shard and shard_size + nbytes > shard_bytes:
            flush()
        shard[name] = rng.standard_normal(shape, dtype=np.float32)
        shard_size += nbytes
        total += nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(families.to_hf(cfg)))
    return total


def peak_of(code: str) -> tuple[float, float]:
    """(peak RSS in GB, seconds) of a fresh Python process running `code`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", f"{code}\n{PEAK}"], env=env, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"failed ({run.returncode}):\n{code}\n{run.stderr[-3000:]}")
    out = run.stdout
    seconds = time.perf_counter() - start
    kb = int(next(line for line in out.splitlines() if line.startswith("PEAK_KB")).split()[1])
    return kb * 1024 / GB, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--mlp-hidden", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=100278)
    parser.add_argument("--shard-gb", type=float, default=1.0)
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the generated files go")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cfg = validate({"name": "convert-memory", "model": {
        "vocab_size": args.vocab, "d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
        "mlp_hidden": args.mlp_hidden}})
    m = cfg.model
    shapes = jax.tree.leaves(families.param_shapes(m), is_leaf=lambda s: isinstance(s, tuple))
    olmax_bytes = 4 * sum(math.prod(shape) for shape in shapes)
    work = Path(tempfile.mkdtemp(prefix="olmax-convert-memory-", dir=args.workdir))
    try:
        hf_dir, ckpt, back = work / "hf", work / "olmax", work / "hf-back"
        start = time.perf_counter()
        hf_bytes = write_hf_checkpoint(hf_dir, cfg, int(args.shard_gb * GB))
        generate_s = time.perf_counter() - start
        baseline, _ = peak_of(BASELINE)
        read_peak, read_s = peak_of("from olmax.interop.hf import load_hf_params, read_hf_config\n"
                                    f"from olmax.model import families\nsrc = {str(hf_dir)!r}\n"
                                    "load_hf_params(src, families.from_hf(read_hf_config(src), 'x'))")
        import_peak, import_s = peak_of(f"from olmax.interop.hf import hf_to_olmax\nhf_to_olmax({str(hf_dir)!r}, "
                                        f"{str(ckpt)!r})")
        export_peak, export_s = peak_of(f"from olmax.interop.hf import olmax_to_hf\nolmax_to_hf({str(ckpt)!r}, "
                                        f"{str(back)!r}, max_shard_bytes={int(args.shard_gb * GB)})")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report = {
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "params": sum(math.prod(p.foreign_shape(m, i)) for p, i in families.foreign_tensors(m).values()),
        "hf_checkpoint_gb": hf_bytes / GB,
        "olmax_params_gb": olmax_bytes / GB,
        "generate_s": generate_s,
        "baseline_process_gb": baseline,
        "hf_read_only": {"peak_rss_gb": read_peak, "above_baseline_gb": read_peak - baseline,
                         "x_model": (read_peak - baseline) * GB / olmax_bytes, "seconds": read_s},
        "hf_to_olmax": {"peak_rss_gb": import_peak, "above_baseline_gb": import_peak - baseline,
                        "x_model": (import_peak - baseline) * GB / olmax_bytes, "seconds": import_s},
        "olmax_to_hf": {"peak_rss_gb": export_peak, "above_baseline_gb": export_peak - baseline,
                        "x_model": (export_peak - baseline) * GB / olmax_bytes, "seconds": export_s},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"model: {report['params']:,} params; HF checkpoint {report['hf_checkpoint_gb']:.2f} GB in "
          f"{args.shard_gb:g} GB shards; olmax params {report['olmax_params_gb']:.2f} GB (vocab padded)")
    print(f"baseline process (imports only): {baseline:.2f} GB")
    for step in ("hf_read_only", "hf_to_olmax", "olmax_to_hf"):
        r = report[step]
        print(f"{step:<12} peak RSS {r['peak_rss_gb']:.2f} GB = baseline + {r['above_baseline_gb']:.2f} GB "
              f"({r['x_model']:.2f} x the model), {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
