"""Every benchmark script stays runnable: each runs its smallest case, in a process of its own as it is run by
hand (the figures are not checked: tests never judge time). benchmarks/gpu_bench.py and gpu.sh are run at toy
sizes by tests/scale/test_scale_gpu_bench.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TOY_MODEL = ["model.vocab_size=512", "model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
             "model.mlp_hidden=128", "model.sliding_window=32", "data.sequence_length=64", "impl.attention.block=32"]

SMALLEST = {
    "checkpoint_stall.py": ["--gb", "0.002", "--saves", "1"],
    "checkpoint_checksum.py": ["--arrays", "1", "--mb", "1", "--repeats", "1"],
    "convert_memory.py": ["--layers", "4", "--d-model", "64", "--heads", "4", "--mlp-hidden", "128",
                          "--shard-gb", "0.0001", "--workdir", "{tmp}", "--json"],
    "depth_extrapolation.py": ["--config", "tiny", "--target", "tpu:v5p:2x2x1", "model.n_layers=16"],
    "data_loader.py": ["--dir", "{tmp}/shards", "--shards", "1", "--tokens-per-shard", "32768", "--sequence-length",
                       "256", "--global-batch", "4", "--repeats", "1", "--json"],
    # One row (the script compiles each config in a fresh process; a second row shows nothing more).
    "compile_compare.py heads": ["--target", "tpu:tpu7x:2x2x1", "model.n_layers=4", "model.d_model=512",
                                 "model.mlp_hidden=1024", "model.vocab_size=512", "data.eos_id=0", "data.pad_id=1",
                                 "data.sequence_length=256", "train.global_batch_instances=8",
                                 "train.micro_batch_per_device=1", "--configs", "olmo3_7b_hd256"],
    "compile_compare.py experts": ["--experts", "8", "--target", "tpu:v5p:2x2x2", "mesh.fsdp=1", "model.n_layers=4",
                               "model.d_model=256", "model.n_heads=2", "model.n_kv_heads=1",
                               "model.moe.expert_hidden=64", "model.vocab_size=512", "data.eos_id=0",
                               "data.pad_id=1", "data.sequence_length=256",
                               "train.global_batch_instances=8", "train.micro_batch_per_device=1"],
    "moe_scaling.py": ["--experts", "4", "--dispatch", "blocks", "--steps", "1", "--batch", "2", "--seq", "32",
                       "--layers", "1", "--d-model", "32", "--expert-hidden", "32", "--top-k", "2"],
    "run_page.py": ["--steps", "2000", "--layers", "2", "--out", "{tmp}/run", "--repeat", "1"],
    "slow_bucket.py": ["--steps", "3", "--latencies-ms", "direct,20", "--workers", "2"],
    "step_model.py": ["--config", "tiny", "--target", "tpu:v5p:2x2x1"],
    "step_memory.py": ["tiny", "train.micro_batch_per_device=1", "--devices", "2"],
    "tokenize_throughput.py": ["--megabytes", "0.05", "--vocab-size", "300", "--workers", "1"],
    "tokenize_ray.py": ["--megabytes", "0.2", "--files", "4", "--vocab-size", "300", "--workers", "1", "--nodes", "1"],
    # the suite's compile cache (conftest), which holds this compile: the run is about Ray and the clock, not XLA
    "tune_ray.py": ["tiny", "--target", "tpu:v5p:2x2x2", "--budget", "1", "--workers", "2", "--cache", "{compiles}"],
    "train_throughput.py": ["--steps", "1", "--skip-torch", "--olmax", *TOY_MODEL],
}


def test_every_benchmark_has_a_smoke_test():
    # bucket_io.py runs at toy sizes against the test servers in tests/storage/test_bucket_bench.py
    scripts = {case.split()[0] for case in SMALLEST}  # a key is the script and the arguments it starts with
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == sorted([*scripts, "pipeline_memory.py", "gpu_bench.py",
                                                                      "bucket_io.py", "suite_profile.py"])


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_benchmark_runs_its_smallest_case(script, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)).replace("{compiles}", os.environ["OLMAX_COMPILE_CACHE"])
            for a in SMALLEST[script]]
    script, *first = script.split()
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *first, *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()
    if "--json" in args:
        json.loads(run.stdout)


@pytest.mark.slow
def test_pipeline_memory_runs_a_pipelined_layout(monkeypatch, capsys):
    """In this process (its 8 fake devices), one pipelined row: compiling all three layouts at its 16 layers
    takes minutes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_memory", BENCHMARKS / "pipeline_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = "4 stages, GPipe, 8 micro-batches"
    monkeypatch.setattr(module, "LAYOUTS", {row: module.LAYOUTS[row]})
    monkeypatch.setattr(sys, "argv", ["pipeline_memory.py", "--remat", "full"])
    module.main()
    assert f"| {row} |" in capsys.readouterr().out


PROFILED_TEST = """
import subprocess, sys, time
import jax, jax.numpy as jnp

def test_compiles_sleeps_and_starts_a_process():
    jax.jit(lambda x: x * 2 + 1)(jnp.arange(7.0)).block_until_ready()
    time.sleep(0.2)
    subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp; jax.jit(lambda x: x - 3)(jnp.ones(5))"],
                   check=True)

def test_sleeps():
    time.sleep(0.1)
"""


@pytest.mark.slow
def test_suite_profile_attributes_a_tests_time(tmp_path):
    """Per file and per test: each test's compiles, sleep and child process are its own, cold then warm."""
    (tmp_path / "test_profiled.py").write_text(PROFILED_TEST)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    profiles = []
    for run in ("cold", "warm"):
        done = subprocess.run([sys.executable, str(BENCHMARKS / "suite_profile.py"), "--json", f"{run}.json", "-q",
                               "-n", "0", "-p", "no:cacheprovider", "test_profiled.py"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "compiles-missed" in done.stdout and "| `test_profiled.py::test_sleeps` |" in done.stdout
        profiles.append(json.loads((tmp_path / f"{run}.json").read_text()))
    cold, warm = (profile["files"]["test_profiled.py"] for profile in profiles)
    assert cold["tests"] == 2 and cold["processes"] == 1 and cold["start-up"] > 0 and cold["sleep"] >= 0.3
    assert cold["compiles-missed"] >= 2 and not cold.get("compiles-hit")  # the test's jit and its child's
    assert warm["compiles-hit"] >= 2 and not warm.get("compiles-missed")
    first, second = (profiles[0]["tests"][f"test_profiled.py::{name}"]
                     for name in ("test_compiles_sleeps_and_starts_a_process", "test_sleeps"))
    assert first["processes"] == 1 and first["compiles-missed"] >= 2 and first["sleep"] >= 0.2
    assert second["sleep"] >= 0.1 and not second.get("compiles-missed") and not second.get("processes")
    assert first["sleep"] + second["sleep"] == pytest.approx(cold["sleep"])
    assert profiles[0]["recorded"]["arguments"].endswith("test_profiled.py")


@pytest.mark.skipif(bool(__import__("olmax.scale.targets", fromlist=["aot_missing"]).aot_missing("tpu")),
                    reason="needs the aot extra")
def test_the_step_model_table_shows_a_prediction_as_a_range_where_its_two_estimates_disagree(monkeypatch):
    """BENCHMARKS.md's table (benchmarks/step_model.py) gave the v5p 7B's step at libtpu's estimate alone (47.8% MFU)
    where the roofline gives 58.4% and the published run measured 57.4%. A row whose two predictions are more than
    10% apart shows both and which the point figure is, and says whether the published figure is inside: tiny on
    v5p, 20% apart."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_model", BENCHMARKS / "step_model.py")
    step_model = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "step_model", step_model)  # its dataclasses look their module up there
    spec.loader.exec_module(step_model)
    inside, outside = (step_model.Row(name, "tiny", "tpu:v5p:2x2x2", [], "made up", "mfu_all_global", mfu, "")
                       for name, mfu in (("inside", 0.0003), ("outside", 0.5)))
    result = step_model.predict_row(inside)
    low, high = result["step_range"]
    assert low < result["step_seconds"] == high  # libtpu's estimate is the longer, here
    flops = result["mfu_all_global"] * high
    said = (f"{high:.3g} s, {result['mfu_all_global']:.1%} (range {low:.3g}-{high:.3g} s, {flops / high:.1%}-"
            f"{flops / low:.1%}: the point figure is libtpu's estimate, the range's other end the roofline)")
    table = step_model.markdown([inside, outside], {"inside": result, "outside": result})
    assert table.count(said) == 2
    for row, where in ((inside, "inside"), (outside, "outside")):
        verdict = step_model.compare(row, result, {})[1]
        assert verdict.endswith(f"; the published figure {where} the range") and f"| {verdict} |" in table
