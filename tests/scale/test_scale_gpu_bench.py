"""benchmarks/gpu.sh stays runnable where no GPU is: its shell parses, its Python half runs at toy sizes."""

import importlib.util
import subprocess
from pathlib import Path

import jax.numpy as jnp
import pytest

from olmax.scale.targets import aot_missing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu.sh")], check=True)


@pytest.mark.parametrize("window", [32, None])
def test_cudnn_attention_call_sees_the_keys_olmax_sees(gpu_bench, window):
    """olmax's cuDNN attention call (model/attention/cudnn.py: q pre-scaled, scale 1, olmax's window as
    local_window_size, grouped KV heads), made without cuDNN, agrees with the blocked XLA attention forward
    and backward: the comparison the GPU run makes with cuDNN itself."""
    r = gpu_bench.attention_benchmark(seq=128, heads=4, kv_heads=2, head_dim=16, window=window, block=32,
                                      implementation="xla", steps=1, dtype=jnp.float32)
    assert r["max_abs_diff_out"] < 1e-5
    assert max(r["max_abs_diff_grads"]) < 1e-4


def test_step_benchmark_runs(gpu_bench):
    toy = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_hidden=128",
           "model.vocab_size=512", "data.sequence_length=64", "model.sliding_window=16", "impl.attention.block=16"]
    r = gpu_bench.step_benchmark("cpu", steps=1, overrides=toy)
    assert r["tokens_per_step"] == 4 * 64 and r["tokens_per_s"] > 0
    # the step-time model's prediction for the device it ran on (here this CPU) beside the measurement
    assert r["predicted_hardware"] == "this CPU" and r["predicted_step_s"] > 0
    assert 0 < r["mfu_exact_window"] < r["mfu_all_global"]


def test_experts_benchmark_runs(gpu_bench):
    """The grouped kernels (in Pallas' GPU interpreter here), the block loop and lax.ragged_dot on the same
    uneven groups: the same products, forward and gradients."""
    from olmax.model.moe.kernels.chip import Chip

    r = gpu_bench.experts_benchmark(rows=200, d=128, f=128, groups=3, steps=1, chip=Chip(9, 4),
                                    interpret=True)
    assert sum(r["group_sizes"]) == 200
    assert r["grouped"]["max_abs_diff_from_blocks"] < 0.1 and r["ragged_dot"]["max_abs_diff_from_blocks"] < 0.1
    assert all(r[name]["train_s"] > 0 for name in ("grouped", "blocks", "ragged_dot"))


def test_kernel_checks_run(gpu_bench):
    """`check`'s path with the block loop and one product off in one group's weights (on the GPU: its grouped
    kernels and the block loop): each one's verdict, and its errors against float64."""
    from olmax.model.moe import block_loop
    from olmax.model.moe.kernels.chip import Chip

    r = gpu_bench.kernel_checks({"loop": lambda x, w, s, b: block_loop.matmul(x, w, s, b),
                                 "wrong": lambda x, w, s, b: block_loop.matmul(x, w.at[0].multiply(2), s, b)},
                                Chip(9, 4), dtypes=[jnp.bfloat16])
    assert r["loop bfloat16"]["verdict"] == "passed"
    assert 0 < max(r["loop bfloat16"]["error_vs_float64"].values()) < 0.01
    assert r["wrong bfloat16"]["verdict"].startswith("wrong: y in bfloat16 off lax.ragged_dot by")
    assert r["wrong bfloat16"]["error_vs_float64"]["y"] > 0.5


def test_moe_layer_benchmark_runs(gpu_bench):
    """The MoE layer's step predicted beside measured (on this CPU: the block loop and ragged_dot)."""
    r = gpu_bench.moe_layer_benchmark(tokens=64, d=32, f=64, experts=4, top_k=2, dispatches=["blocks", "ragged_dot"],
                                      steps=1)
    assert r["predicted_hardware"] == "this CPU"
    for dispatch in ("blocks", "ragged_dot"):
        assert r[dispatch]["measured_s"] > 0 and r[dispatch]["predicted_s"] > 0 and r[dispatch]["predicted_ops"] > 0


@pytest.mark.slow
@pytest.mark.skipif(aot_missing("gpu") is not None, reason="needs the aot-gpu extra")
def test_experts_prediction_runs_without_a_gpu(gpu_bench):
    """One GPU's expert work under expert parallelism, compiled for an H100 and predicted: the grouped kernels
    are costed from their work (no unknown kernel) and run fewer ops than the block loop."""
    shape = dict(rows=1024, routed=768, d=256, f=256, groups=4)
    grouped = gpu_bench.experts_prediction("gpu:h100x8", "grouped", **shape)
    blocks = gpu_bench.experts_prediction("gpu:h100x8", "blocks", **shape)
    assert grouped["warnings"] == [] and blocks["warnings"] == []
    assert 0 < grouped["ops"] < blocks["ops"] and grouped["predicted_s"] > 0
