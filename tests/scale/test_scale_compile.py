"""`olmax compile`: the real train step compiled for TPU slices and GPU hosts without the hardware.

TPU targets need the aot extra (libtpu; CI installs it), GPU targets the aot-gpu extra (skipped without it).
"""

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from testlib import ROOT

from olmax.cli import main
from olmax.config import load_config
from olmax.model import families
from olmax.parallel.schedules import schedule_for
from olmax.scale.cli import format_compile
from olmax.scale.compile import compile_train_step
from olmax.figures import size
from olmax.scale.targets import (ACCELERATORS, GiB, aot_missing, compile_only_devices, flag_profile, parse_target,
                                  running_target)

needs_tpu = pytest.mark.skipif(bool(aot_missing("tpu")), reason=str(aot_missing("tpu")))
needs_gpu = pytest.mark.skipif(bool(aot_missing("gpu")), reason=str(aot_missing("gpu")))


def _check_report(report, target):
    assert report["devices"] == target.devices and report["mesh"]["fsdp"] == target.devices
    assert report["compute_dtype"] == "bfloat16"  # `auto` resolved for the accelerator, not the host's CPU
    assert 0 < report["parameters"] < report["optimizer_state"] < report["arguments"] <= report["peak"]
    assert report["peak"] <= report["memory_per_device"] == target.accelerator.memory_per_device
    assert report["plan"]["exact_window"]["tflop_per_device_step"] > 0


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@needs_tpu
def test_tiny_step_compiles_with_splash_for_a_tpu_slice(capsys):
    """`auto` attention on TPU devices is Splash: the compiled step runs its forward and both backward kernels
    in every layer (Splash tiles are 128 tokens at least, hence 256-token sequences)."""
    args = ["compile", "tiny", "data.sequence_length=256", "--target", "tpu:v5p:2x2x2", "--mfu", "0.5", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device_kind"] == "TPU v5"
    _check_report(report, parse_target("tpu:v5p:2x2x2"))
    assert report["attention"] == "splash"
    kernels = report["program"]["custom_calls"]
    for kernel in ("splash_mha_fwd_residuals", "splash_mha_dkv_no_residuals", "splash_mha_dq_no_residuals"):
        assert kernels[kernel] == 4  # the tiny model's 4 layers
    table = format_compile(report)
    assert "tiny for tpu:v5p:2x2x2: 8 x TPU v5, mesh data 1 x stage 1 x fsdp 8 x expert 1 x tensor 1" in table
    assert report["attention_tiles"] == {"block_q": 256, "block_kv": 256, "block_kv_compute": 256, "head_dim": 16}
    assert "splash attention (tiles: 256 queries x 256 keys, 256 keys a step, head_dim 16), loss in chunks of 1024 " \
        "positions" in table
    assert report["xla_flags"] == {} and "XLA flags" not in table  # v5p has no flag profile
    assert "splash_mha_dkv_no_residuals x4" in table
    assert re.search(r"peak \(compiler\)\s+[\d.,]+ [KMG]iB\s+[\d.]+% of the device", table)


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@needs_tpu
def test_ironwood_compiles_with_its_sparsecore_flag_profile(capsys, monkeypatch):
    """A TPU7x target (named `ironwood` here) gets the SparseCore collective-offload profile as compile options: the
    report lists it, the compiled step runs collectives on the SparseCores, and the compiler reads every flag (a
    name it does not know is an error, so a profile cannot go stale unnoticed)."""
    from olmax.scale import targets

    assert main(["compile", "tiny", "--target", "tpu:ironwood:2x2x1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == "tpu:tpu7x:2x2x1" and report["device_kind"] == "TPU7x"
    assert report["xla_flags"] == targets.XLA_FLAGS["tpu7x"]
    assert report["xla_flags"]["xla_tpu_enable_sparse_core_collective_offload_all_reduce"] is True
    assert report["program"]["sparsecore_collectives"] > 0
    table = format_compile(report)
    assert "XLA flags (tpu7x profile): --xla_tpu_enable_async_collective_fusion_fuse_all_gather=false" in table
    assert f"; {report['program']['sparsecore_collectives']} collectives on the SparseCores" in table
    # The tiny model's memory in its own units (it read 0.00 GiB everywhere), and no summed temporaries (buffers
    # that never all coexist: for the 7B recipe 101.06 GiB beside a peak of 78.74) as if they were held: the
    # temporaries shown are what the peak leaves beside the split's other parts, which add up to the peak.
    assert re.search(r"peak \(compiler\) +[\d.]+ MiB", table) and re.search(r"parameters \(fp32\) +[\d.]+ KiB", table)
    assert not re.search(r"\b0\.00 [KMG]iB", table)
    stack = {s["segment"]: s["bytes"] for s in report["memory_stack"]}
    assert sum(stack.values()) - stack["free"] == report["peak"] and 0 <= stack["temporaries"] <= report["peak"]
    assert re.findall(r"temporaries +([\d.]+ [KMG]?i?B)", table) == [size(stack["temporaries"])]
    from olmax.scale.comparison import markdown_table
    from olmax.scale.layout_page import page

    html_page = page(report)
    assert " MiB" in html_page and " KiB" in html_page and "0.00 GiB" not in html_page
    assert "never all live at once" in html_page  # the page says what the compiler's total of temporaries is
    # the share of the device with the digits it needs (it read 0.0%)
    assert re.search(r" MiB \(0\.0*[1-9]\d*%\)", markdown_table([report]))
    assert not re.search(r"\b0\.00 [KMG]iB", markdown_table([report]))
    monkeypatch.setitem(targets.XLA_FLAGS, "tpu7x", {"xla_tpu_no_such_flag": True})
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_tpu_no_such_flag"):
        compile_train_step(load_config("tiny"), parse_target("tpu:tpu7x:2x2x1"), mfu=0.4)


@needs_tpu
def test_loading_libtpu_to_compile_leaves_child_processes_no_made_up_tpu_variables():
    """libtpu without TPU hardware sets TPU_WORKER_ID and others to "WARNING: could not determine ..." in the C
    environment, which os.environ does not show but every child inherits: they are unset again."""
    compile_only_devices(parse_target("tpu:v5p:2x2x1"))
    inherited = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout
    assert "WARNING: could not determine" not in inherited and "ALLOW_MULTIPLE_LIBTPU_LOAD=1" in inherited
    assert "TPU_ACCELERATOR_TYPE" not in inherited and "TPU_WORKER_HOSTNAMES" not in inherited


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@needs_tpu
def test_a_tpu_compile_prints_its_report_and_nothing_of_libtpus_start_up(tmp_path):
    """libtpu loaded without TPUs printed its failed probing of the cloud's metadata (`Failed to find host
    bounds`, an `E0000 ... unexpected worker hostname` line, a `Source Location Trace`) before every report. In
    a process of its own: libtpu says it once, when it loads. The compile's phases are all it prints there.
    """
    command = ["-c", "import sys; from olmax.cli import main; sys.exit(main())", "compile", "tiny", "--target",
               "tpu:v5p:2x2x1", "--json"]
    out = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["devices"] == 4
    phases = ["loading the target's devices", "tracing the train step", "lowering", "compiling"]
    assert [line.split(": ")[-1].split(" (")[0] for line in out.stderr.splitlines()] == phases, out.stderr


@needs_tpu
def test_tiny_compiles_for_a_tpu_slice_with_xla_attention_and_the_configs_layout_for_it(capsys, tmp_path):
    """64-token sequences: no Splash tile (a multiple of 128) fits them, so `auto` takes XLA's attention and the
    report says so; an explicit `splash` is refused with the fix. The config's layout for the target is the
    compiled mesh, and the report names it."""
    config = tmp_path / "tiny_laid_out.yaml"
    config.write_text("base: tiny\nlayouts:\n  tpu:v5p:*:\n    mesh: {data: 2}\n  gpu:*: {mesh: {data: 4}}\n")
    assert main(["compile", str(config), "--target", "tpu:v5p:2x2x2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"]["data"] == 2 and report["mesh"]["fsdp"] == 4
    assert report["layout"] == {"target": "tpu:v5p:*", "settings": ["mesh.data=2"]}
    assert report["attention"] == "xla" and not any("splash" in k for k in report["program"]["custom_calls"])
    assert "bfloat16 compute, xla attention" in format_compile(report)
    assert "layout for tpu:v5p:* from the config: mesh.data=2" in format_compile(report)
    assert main(["compile", "tiny", "--target", "tpu:v5p:2x2x2", "impl.attention.implementation=splash"]) == 2
    assert "set impl.attention.implementation=xla" in capsys.readouterr().err


@needs_tpu
@pytest.mark.parametrize("target", ["tpu:v5p:2x2x2", "tpu:v5p:2x4x4", "tpu:v5e:2x4", "tpu:v6e:4x4", "tpu:tpu7x:2x2x1"])
def test_a_slices_devices_name_their_target(target):
    """What a run on these chips matches `layouts:` by: the devices' kind and their coordinates' extent."""
    assert running_target(compile_only_devices(parse_target(target))) == target


@needs_gpu
def test_a_gpu_hosts_devices_name_their_target_and_its_flag_profile():
    devices = compile_only_devices(parse_target("gpu:b300x8"))
    assert running_target(devices) == "gpu:b300x8"
    assert flag_profile(running_target(devices)) == {"xla_gpu_enable_latency_hiding_scheduler": True}


def test_cpus_have_no_flag_profile():
    assert running_target(jax.devices()) is None and flag_profile(None) == {}


@needs_tpu
def test_a_signal_stops_a_compile_at_once(tmp_path):
    """`olmax compile olmo3_7b --target tpu:v5p:4x4x8` given SIGINT 20 s in compiled 12 more minutes ("still waiting
    for XLA"), then exit 130; SIGTERM likewise: XLA holds the main thread, and the interrupt came when it returned.
    The signal is said at once and ends the command (exit 143 for SIGTERM), here while XLA compiles tiny with 64
    layers unrolled (5 minutes on 2 loaded cores, 2026-12-07), which it reaches in seconds."""
    compile_ = subprocess.Popen([sys.executable, "-m", "olmax.cli", "compile", "tiny", "model.n_layers=64",
                                 "impl.scan_layers=false", "--target", "tpu:v5p:2x2x2"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OLMAX_COMPILE_CACHE": str(tmp_path / "cache")})
    try:
        while not (line := compile_.stderr.readline()).startswith("olmax compile: compiling ("):
            assert line, "the compile ended before it started compiling"
        compile_.send_signal(signal.SIGTERM)
        _, err = compile_.communicate(timeout=120)  # a guard: the compile alone takes minutes
    finally:
        compile_.kill()
    assert compile_.returncode == 143 and err.splitlines() == ["olmax compile: stopping (SIGTERM)"], err
    assert not list((tmp_path / "cache").glob("*/result.json"))  # nothing compiled


@pytest.mark.parametrize("command", [
    ["compile", "tiny", "--target", "tpu:v5p:2x2x2", "mesh.fsdp=3", "train.global_batch_instances=15"],
    ["compile", "tiny", "--target", "tpu:v5p:2x2x2", "mesh.fsdp=3"],  # the batch was blamed
    ["plan", "tiny", "--target", "tpu:v5p:2x2x2", "mesh.fsdp=3", "--mfu", "0.4"],
    ["config", "show", "olmo3_7b", "mesh.fsdp=3", "--target", "tpu:v5p:4x4x8"],
    ["compile", "tiny", "--target", "tpu:v5p:2x2x2", "mesh.data=3"],  # fsdp -1: what 3 leaves of 8
])
def test_a_mesh_that_is_not_the_targets_devices_is_exit_2_naming_both(command, capsys):
    """`compile tiny --target tpu:v5p:2x2x2 mesh.fsdp=3 train.global_batch_instances=15` compiled a mesh of 3
    devices, reported as "8 x TPU v5", and `config show` printed it: exit 2 now, one line naming the mesh and the
    target's device count, before anything is compiled."""
    assert main(command) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    devices = "8" if "tpu:v5p:2x2x2" in command else "128"
    assert line.startswith("olmax: ConfigError: mesh data ") and f"multiply to {devices}" in line, line
    assert "fsdp 3" in line or "data 3" in line and out == ""


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@needs_tpu
def test_moe_experts_run_on_the_tpu_grouped_matmul_kernel(capsys):
    """`impl.moe.dispatch` auto on TPU devices is ragged_dot, which the TPU compiler runs as its ragged-dot
    kernels (no loop of per-block matmuls); the report names the dispatch and counts the kernels. Expert-parallel
    over the 8 chips, dropless, the exchange is the real ragged all-to-all (XLA:CPU's emulation is for CPU devices
    only), costed by the rows the routing sends."""
    assert main(["compile", "tiny_moe", "mesh.expert=8", "mesh.fsdp=1", "--target", "tpu:v5p:2x2x2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["moe_dispatch"] == "ragged_dot"
    counts = report["program"]["custom_calls"]
    assert counts["ragged-dot-none"] >= 3  # at least the forward's three matmuls
    # the counts docs/model.md quotes of this command (a compiler that moves them fails this until it says them)
    assert (f"`olmax compile tiny_moe mesh.expert=8 mesh.fsdp=1 --target tpu:v5p:2x2x2` counts `ragged-dot-none` "
            f"x{counts['ragged-dot-none']} and `ragged-dot-metadata` x{counts['ragged-dot-metadata']}") in " ".join(
        (ROOT / "docs" / "model.md").read_text().split())
    assert "experts by ragged_dot" in format_compile(report)
    moved = report["step_time"]["collectives"]["bytes_by_kind"]
    assert moved.get("ragged-all-to-all", 0) > 0 and "all-to-all" in moved, moved  # the counts first, then rows


def test_the_model_expects_the_rows_a_dropless_exchange_sends_and_each_part_runs():
    """Dropless over 8 devices of one expert each (top-2 of 8): a device's tokens each go to 2 peers, and each of
    its experts runs tokens x 2 / 1 rows; in 2 parts each exchange and each part's experts have half of that. A
    capacity per peer has no ragged exchange."""
    from olmax.parallel.mesh import make_layout
    from olmax.scale.compile import expert_blocks

    def expected(*overrides):
        cfg = load_config("tiny_moe", ["mesh.expert=8", "mesh.fsdp=1", "train.micro_batch_per_device=1", *overrides])
        found = expert_blocks(cfg, make_layout(cfg.mesh), 8)
        return found.rows_per_expert, found.exchanged_rows

    assert expected() == (64 * 2, 64 * 2)
    assert expected("impl.moe.exchange_chunks=2") == (32 * 2, 32 * 2)
    assert expected("impl.moe.ep_capacity=1.25")[1] is None
    cfg = load_config("tiny_moe", ["mesh.expert=8", "mesh.fsdp=1", "train.micro_batch_per_device=1",
                                   "impl.moe.ep_buffer=1.5"])
    bounded = expert_blocks(cfg, make_layout(cfg.mesh), 8)
    assert (bounded.buffer_slots, bounded.overflow_trips) == (192, 0)  # 1.5 x 128 assignments expected, one round


@pytest.mark.parametrize("config, target", [("olmo3_moe_47b", "gpu:b300x8"), ("olmo_moe_1t", "tpu:v5p:8x8x8"),
                                            ("olmo_moe_1t", "gpu:b300x512")])
def test_the_model_the_compile_report_and_tune_size_an_moe_layer_alike(config, target):
    """How many rows an expert, a block, a round of the exchange and a device receive was written three times: in
    the model's layer, the compile report and tune's estimate. Each now reads one definition (olmax.parallel.
    moe_sizing) from its own inputs: the model from the tokens its layer gets and its mesh, the compile report from
    the layout and a micro-step's rows, tune from its candidate layout. For the 47B and the 1.2T in their preset
    layouts (dropless in rounds of 1.25 x the expected rows; a capacity of 1.25 a peer under 8 or 2 pipeline stages)
    the three agree, and so do the figures the report and tune's estimate show; no program is compiled."""
    if aot_missing(target.split(":")[0]):
        pytest.skip(aot_missing(target.split(":")[0]))
    from olmax.model import fp8
    from olmax.model.moe import sublayer
    from olmax.parallel.mesh import make_layout
    from olmax.parallel.schedules import schedule_for
    from olmax.scale.compile import expert_blocks, expert_exchange, expert_rows
    from olmax.scale.tune_estimate import Estimate
    from olmax.scale.tune_space import EVERYTHING, Candidate
    from olmax.train.step import micro_batch_rows

    cfg = load_config(config, [], target)
    moe = cfg.impl.moe
    layout = make_layout(cfg.mesh, compile_only_devices(parse_target(target)))
    micro_rows = micro_batch_rows(cfg, layout.data_parallel_size)
    sched = schedule_for(cfg)
    microbatches = sched.microbatches if sched else 1
    # the model's layer gets one pipeline micro-batch of the micro-step's rows, the whole mesh's, each a sequence
    model = sublayer.layer_rows(cfg.model.moe, layout.mesh, layout.batch_axes,
                                micro_rows // microbatches * cfg.data.sequence_length, moe.ep_capacity,
                                moe.exchange_chunks, moe.ep_buffer)
    report = expert_rows(cfg, layout, micro_rows)
    candidate = Candidate(tuple((a, getattr(cfg.mesh, a)) for a in ("data", "fsdp", "tensor", "expert", "stage")),
                          EVERYTHING, cfg.train.micro_batch_per_device, None, False,
                          (cfg.impl.pipeline.schedule, microbatches, cfg.impl.pipeline.repeats) if sched else None)
    estimate = Estimate(cfg, parse_target(target))
    assert model == report == estimate.layer_rows(candidate)
    assert model.ep > 1 and (model.capacity is None) == (model.slots is not None)

    blocks, exchange = expert_blocks(cfg, layout, micro_rows), expert_exchange(cfg, layout, micro_rows)
    smallest = fp8.MX_BLOCK if cfg.impl.fp8 == "mxfp8" else 16
    assert (blocks.rows_per_expert, blocks.block, blocks.buffer_slots) == (
        model.rows_per_expert, model.block(moe.block, smallest), model.slots)
    run, outputs, received = estimate.routed(candidate)
    assert received == exchange["receive_rows"] * exchange["parts"] == model.received * exchange["parts"]
    assert run == (model.received if model.capacity is not None else model.slots)


def test_the_compile_page_states_what_the_exchange_holds():
    """A dropless exchange's receive buffer is sized for every token of the expert group (8 x 64 rows of 64 float32
    values here); a capacity's for the capacity of each peer; the compile output says which, and what arrives."""
    from olmax.parallel.mesh import make_layout
    from olmax.scale.cli import _exchange
    from olmax.scale.compile import expert_exchange

    def exchange(*overrides):
        cfg = load_config("tiny_moe", ["mesh.expert=8", "mesh.fsdp=1", "train.micro_batch_per_device=1", *overrides])
        return expert_exchange(cfg, make_layout(cfg.mesh), 8)

    dropless = exchange()
    assert dropless == {"kind": "dropless, ragged", "parts": 1, "receive_rows": 512, "receive_bytes": 512 * 64 * 4,
                        "expected_rows": 128.0}
    assert _exchange(dropless) == ("expert exchange: dropless, ragged; a layer's receive buffer 512 rows (128.00 KiB "
                                   "of hidden states) a part, 128 expected to arrive")
    assert exchange("impl.moe.exchange_chunks=2")["receive_rows"] == 256
    bounded = exchange("impl.moe.ep_buffer=1.5")
    assert (bounded["receive_rows"], bounded["expected_rows"]) == (192, 128)
    assert "dropless, ragged, rounds of 1.5 x the 128 assignments expected" in _exchange(bounded)
    capacity = exchange("impl.moe.ep_capacity=1.25")
    assert (capacity["receive_rows"], capacity["expected_rows"]) == (8 * 20, 128)
    assert "capacity 1.25 a peer (drops beyond it)" in _exchange(capacity)
    assert exchange("mesh.expert=1") is None


def test_moe_dispatch_auto_is_ragged_dot_on_tpu_only():
    from olmax.model.moe.sublayer import dispatch_for

    assert [dispatch_for("auto", p) for p in ("cpu", "gpu", "tpu")] == ["blocks", "blocks", "ragged_dot"]
    assert dispatch_for("blocks", "tpu") == "blocks" and dispatch_for("ragged_dot", "cpu") == "ragged_dot"


# 2 stages x 4-way expert parallelism on 8 devices, 4 layer_pattern periods (2 chunks a stage for the circular
# schedules), 2 pipeline micro-batches of 2 instances.
PIPELINED_MOE = ["mesh.stage=2", "mesh.expert=4", "mesh.fsdp=1", "model.n_layers=8", "model.layer_pattern=[sliding,global]",
                 "impl.pipeline.microbatches=2", "--json"]


@pytest.mark.slow  # the fast tier keeps a lighter test of the same module
@pytest.mark.parametrize("target, schedule", [
    pytest.param("tpu:v5p:2x2x2", "gpipe", marks=needs_tpu),
    pytest.param("tpu:v5p:2x2x2", "interleaved_1f1b", marks=needs_tpu),
    pytest.param("gpu:b300x8", "circular", marks=needs_gpu),
    pytest.param("gpu:b300x8", "1f1b", marks=needs_gpu),
])
def test_pipelined_expert_parallel_moe_runs_the_platforms_kernels(target, schedule, capsys):
    """Under pipeline stages, expert parallel: the experts run on the platform's grouped-matmul kernels (the TPU's
    `ragged-dot`, Blackwell's Mosaic GPU kernels), forward and both gradients, each stage's launch unbatched under
    the pipeline's map over its stages, and the tokens travel by the ragged all-to-all; no expert block loop is left
    (a loop over an expert's blocks would be in the step's derived loops). Each schedule once, each of the two runners
    on both platforms: GPipe and circular share pipeline.run (circular through its chunk-picking remat, GPipe not),
    1F1B and interleaved 1F1B pipeline.run_1f1b; a schedule whose runner maps a kernel it cannot batch fails its
    compile. (Before: the block loop under stages, and ragged_dot asked for there refused.) A B300's kernels are
    compiled in a process of their own (Mosaic GPU keeps the first GPU generation a process compiles for)."""
    args = ["compile", "tiny_moe", "--target", target, f"impl.pipeline.schedule={schedule}", *PIPELINED_MOE]
    if target.startswith("tpu"):
        assert main(args) == 0
        report = json.loads(capsys.readouterr().out)
    else:
        done = subprocess.run([sys.executable, "-c", "import sys; from olmax.cli import main; sys.exit(main())",
                               *args], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout)
    sched = schedule_for(load_config("tiny_moe", [f"impl.pipeline.schedule={schedule}", *PIPELINED_MOE[:-1]]))
    assert report["plan"]["pipeline"]["schedule"] == sched.title
    calls, found = report["program"]["custom_calls"], report["step_time"]
    if target.startswith("tpu"):
        assert report["moe_dispatch"] == "ragged_dot" and "experts by ragged_dot" in format_compile(report)
        assert calls["ragged-dot-none"] >= 9, calls  # a layer's 3 matmuls and their 6 gradients
    else:
        from olmax.model.moe.kernels import blackwell

        assert report["moe_dispatch"] == "grouped"
        assert calls[f"mosaic_gpu_v2 ragged_dot_kernel_{blackwell.RAGGED_DOT}"] >= 6, calls  # 3 products, 3 gradients
        assert calls["mosaic_gpu_v2 blackwell_weight_grad"] >= 3, calls
    assert found["loops"] == [] and found["warnings"] == [] and found["unknown_kernels"] == {}
    # the counts first (all-to-all), then the rows, costed by what the routing sends
    assert found["collectives"]["bytes_by_kind"].get("ragged-all-to-all", 0) > 0 and "all-to-all" in \
        found["collectives"]["bytes_by_kind"]


@needs_gpu
def test_xla_gpu_expands_ragged_dot_so_auto_keeps_the_blocks_on_gpu():
    """What `auto` rests on: compiled for H100s, ragged_dot's expert matmuls become dots batched over every
    expert, each with the same static rows (a dense expansion, no grouped-matmul kernel); the block loop has
    none. Should XLA:GPU lower ragged_dot to a kernel, this fails and `auto` can take it there too."""
    from olmax.parallel.mesh import make_layout
    from olmax.scale import hardware, step_time
    from olmax.scale.compile import abstract_inputs, attention_info, expert_blocks
    from olmax.scale.targets import compile_only_devices
    from olmax.train.step import jit_train_step, micro_batch_rows

    def compiled_text(dispatch: str) -> str:
        cfg = load_config("tiny_moe", [f"impl.moe.dispatch={dispatch}"])
        layout = make_layout(cfg.mesh, compile_only_devices(parse_target("gpu:h100x8")))
        rows = micro_batch_rows(cfg, layout.data_parallel_size)
        return jit_train_step(cfg, layout, rows).lower(*abstract_inputs(cfg, layout, rows)).compile().as_text()

    moe = load_config("tiny_moe").model.moe
    batched = rf"\[{moe.num_experts},\d+,{2 * moe.expert_hidden}\]\S* dot\("
    assert re.search(batched, compiled_text("ragged_dot"))
    blocks = compiled_text("blocks")
    assert not re.search(batched, blocks)
    # the block loops' trip count is data: the step-time model finds them by their named scope and counts each at
    # the routing's expectation (a device's tokens x top_k over its experts, in whole blocks)
    cfg = load_config("tiny_moe", ["impl.moe.dispatch=blocks"])
    layout = make_layout(cfg.mesh, compile_only_devices(parse_target("gpu:h100x8")))
    experts = expert_blocks(cfg, layout, micro_batch_rows(cfg, layout.data_parallel_size))
    found = step_time.predict(blocks, hardware.target_hardware(parse_target("gpu:h100x8")),
                              attention=attention_info(cfg, layout), experts=experts)
    assert [(loop["scope"], loop["trips"]) for loop in found["loops"]] == [("expert_block_loop", experts.trips)]
    assert experts.trips > 1 and found["warnings"] == []


@needs_gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_tiny_step_compiles_with_cudnn_for_a_gpu_host(fp8):
    """cuDNN's fused attention forward and backward in every layer; with impl.fp8 the 7 projections of each layer
    are float8 GEMMs forward and in both gradients (3 x 7 x 4), the LM head is not."""
    cfg = load_config("tiny", ["data.sequence_length=256", f"impl.fp8={str(fp8).lower()}"])
    target = parse_target("gpu:h100x8")
    report = compile_train_step(cfg, target, mfu=0.5)
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3"
    _check_report(report, target)
    assert report["attention"] == "cudnn" and report["fp8"] == fp8
    assert report["program"]["custom_calls"] == {"__cudnn$fmhaSoftmax": 4, "__cudnn$fmhaSoftmaxBackward": 4}
    float8 = report["program"]["float8_matmuls"]
    assert float8 == (3 * 7 * cfg.model.n_layers if fp8 else 0) and report["program"]["matmuls"] > float8
    # a GPU has no SparseCores: the report says nothing of them (it said "0 collectives on the SparseCores")
    assert "compiled: " in format_compile(report) and "SparseCores" not in format_compile(report)


@needs_tpu
@pytest.mark.parametrize("kind, topology", [("v5e", "2x2"), ("v5p", "2x2x1"), ("v6e", "2x2"), ("tpu7x", "2x2x1")])
def test_tpu_memory_table_is_what_the_compiler_allows(kind, topology):
    """Ask each TPU compiler for 256 GiB per device and read the HBM it says it has."""
    devices = topologies.get_topology_desc(topology_name=f"{kind}:{topology}", platform="tpu").devices
    mesh = Mesh(np.array(devices), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x"))
    x = jax.ShapeDtypeStruct((len(devices) * 2**16, 2**14), jnp.float32, sharding=rows)  # 4 GiB per device
    with pytest.raises(jax.errors.JaxRuntimeError, match="exceeds available HBM") as raised:
        jax.jit(lambda x: [x * i for i in range(64)]).lower(x).compile()
    available = float(re.search(r"exceeds available HBM \(([\d.]+)G\)", str(raised.value)).group(1))
    assert ACCELERATORS[kind].memory_per_device / GiB == pytest.approx(available, abs=0.005)


# The tiny preset made wide: 5.5B parameters in its 4 layers, whose state (float32 parameters, two Adam moments and
# the gradient, 16 bytes a parameter) cannot fit 4 chips of 16 GiB. It reaches the compiler's out-of-memory error
# as the 7B recipe does, in a small part of the 7B's compile.
OVERSIZED = ["model.d_model=8192", "model.mlp_hidden=49152", "impl.attention.implementation=xla"]


@needs_tpu
def test_a_model_too_large_for_four_v5e_chips_does_not_fit(capsys):
    """A step on a v5e 2x2 (16 GiB per chip) that cannot fit: exit 1, a named error, the compiler's figures."""
    cfg = load_config("tiny", OVERSIZED)
    with pytest.raises(SystemExit) as exited:
        main(["compile", "tiny", *OVERSIZED, "--target", "tpu:v5e:2x2", "--json"])
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert "olmax: DoesNotFit: RESOURCE_EXHAUSTED" in captured.err
    report = json.loads(captured.out)
    assert report["compiler_memory"] == pytest.approx(ACCELERATORS["v5e"].memory_per_device, abs=0.01 * GiB)
    assert report["required"] > report["compiler_memory"]
    # fp32 parameters and two fp32 Adam moments, a quarter of each per chip
    assert report["parameters"] == pytest.approx(families.param_count(cfg.model) * 4 / 4, rel=1e-3)
    assert report["optimizer_state"] == pytest.approx(2 * report["parameters"], rel=1e-3)


@needs_tpu
def test_a_step_lowers_to_the_same_program_whatever_the_process_traced_before():
    """Splash kernels kept from an earlier trace made JAX hoist a mask table once where a fresh kernel put it in
    twice: `olmax plan` for one config in one process gave two programs, two predictions (1e-5 apart) and a
    compile-cache miss. Here the first trace (fresh kernels, as in a new process) and a second are one text."""
    from olmax.model.attention import splash
    from olmax.parallel.mesh import make_layout
    from olmax.scale.compile import abstract_inputs
    from olmax.train.step import jit_train_step, micro_batch_rows

    cfg = load_config("tiny", ["data.sequence_length=512", "model.sliding_window=256"])
    layout = make_layout(cfg.mesh, compile_only_devices(parse_target("tpu:v5p:2x2x2")))
    rows = micro_batch_rows(cfg, layout.data_parallel_size)
    splash.kernel.cache_clear()  # as a new process starts
    first, second = (jit_train_step(cfg, layout, rows).lower(*abstract_inputs(cfg, layout, rows)).as_text()
                     for _ in range(2))
    assert "splash" in first and first == second


def _tamper(entry, how: str, other, tmp_path) -> None:
    """Do to the cache entry `entry` what `how` says; `other` is another program's entry."""
    result = entry / "result.json"
    record = json.loads(result.read_text())
    if how == "result.json cut short":
        result.write_text(result.read_text()[: len(result.read_text()) // 2])
    elif how == "program.hlo.gz garbled":
        stored = (entry / "program.hlo.gz").read_bytes()
        (entry / "program.hlo.gz").write_bytes(stored[:20] + bytes(b ^ 0xFF for b in stored[20:40]) + stored[40:])
    elif how == "program.hlo.gz empty":
        (entry / "program.hlo.gz").write_bytes(b"")
    elif how == "program.hlo.gz another text":
        (entry / "program.hlo.gz").write_bytes(gzip.compress(b"not a program"))
    elif how in ("a link to another program's entry", "a dangling link", "a copy of another program's entry"):
        shutil.rmtree(entry)
        if how == "a copy of another program's entry":
            shutil.copytree(other, entry)
        else:
            entry.symlink_to(other if how == "a link to another program's entry" else tmp_path / "gone")
    elif how == "a negative peak":
        result.write_text(json.dumps({**record, "peak": -5}))
    elif how == "a compile time of NaN":
        result.write_text(json.dumps({**record, "compile_seconds": float("nan")}))
    else:  # an out-of-memory refusal the compiler never gave
        assert how == "a made-up RESOURCE_EXHAUSTED"
        (entry / "program.hlo.gz").unlink()
        made_up = {"compile_seconds": 1.0, "error": "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out "
                   "of memory in memory space hbm. Used 200.00G of 95.74G hbm. Exceeded hbm capacity by 104.26G."}
        result.write_text(json.dumps({**{k: v for k, v in record.items() if k in ("key", "digest")}, **made_up}))


@needs_tpu
@pytest.mark.parametrize("how", ["result.json cut short", "program.hlo.gz garbled", "program.hlo.gz empty",
                                 "program.hlo.gz another text", "a link to another program's entry",
                                 "a copy of another program's entry", "a dangling link", "a negative peak",
                                 "a compile time of NaN", "a made-up RESOURCE_EXHAUSTED"])
def test_a_compile_cache_entry_not_this_programs_whole_and_valid_is_compiled_again_and_said(tmp_path, monkeypatch,
                                                                                            caplog, how):
    """A truncated result.json or a garbled program.hlo.gz was trusted on every later read (`olmax tune` then said
    no layout fits, on every rerun); so were an empty program.hlo.gz or a gzip of other text (an AttributeError
    from the report), an entry replaced by a link to (or a copy of) another program's (its figures shown for this
    one), and well-formed lies (a negative peak, a compile time of NaN, an out-of-memory refusal turned into
    DoesNotFit); a dangling link made every run compile again, silently. An entry must prove it is this program's,
    stored whole, with valid figures, or it is compiled again, with one line naming it, and stored whole again
    (what a link pointed to left as it was)."""
    from olmax.scale.compile import compiled_program

    monkeypatch.setenv("OLMAX_COMPILE_CACHE", str(tmp_path / "cache"))
    target = parse_target("tpu:v5p:2x2x2")
    mesh = Mesh(np.asarray(compile_only_devices(target)), ("fsdp",))
    x = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    lowered = jax.jit(lambda a: jnp.tanh(a @ a.T)).trace(x).lower()
    other_lowered = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a).trace(x).lower()
    first = compiled_program(lowered, target)
    (entry,) = (tmp_path / "cache").iterdir()
    other = compiled_program(other_lowered, target)
    assert not first["cached"] and compiled_program(lowered, target)["cached"] and other["peak"] != first["peak"]
    (other_entry,) = set((tmp_path / "cache").iterdir()) - {entry}
    _tamper(entry, how, other_entry, tmp_path)
    caplog.clear()
    again = compiled_program(lowered, target)
    assert not again["cached"] and again["peak"] == first["peak"] and again["text"] == first["text"]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and f"the compile cache entry {entry} " in said[0], said
    assert "compiling the program again" in said[0] and "\n" not in said[0]
    assert compiled_program(lowered, target)["cached"] and not entry.is_symlink()  # stored whole again
    assert compiled_program(other_lowered, target) == {**other, "cached": True}  # the other entry untouched


@pytest.mark.parametrize("command", [["compile"], ["plan"], ["tune", "--budget", "1", "--jobs", "1"]])
def test_a_compile_cache_that_names_a_file_is_refused_before_anything_is_compiled(tmp_path, monkeypatch, capsys,
                                                                                   command):
    """`OLMAX_COMPILE_CACHE` naming a regular file: the compile ran, then a traceback, no result printed. Exit 2 and
    one line now, before any compile, and before the --report directory is made."""
    cache = tmp_path / "cache"
    cache.write_text("someone's file\n")
    monkeypatch.setenv("OLMAX_COMPILE_CACHE", str(cache))
    args = [*command, "tiny", "--target", "tpu:v5p:2x2x1", "--report", str(tmp_path / "page")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"olmax: ConfigError: OLMAX_COMPILE_CACHE {cache}: {cache} is a file, not a directory; set another "
                                "OLMAX_COMPILE_CACHE"], err
    assert cache.read_text() == "someone's file\n" and not (tmp_path / "page").exists()
