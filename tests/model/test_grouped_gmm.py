"""The GPU's grouped-matmul kernels (impl.moe.dispatch=grouped) run in Pallas' GPU interpreter on the CPU: the
Hopper kernels (forward, input and weight gradient) against lax.ragged_dot and the block loop, in float32 and
bf16, uneven and empty groups. The Blackwell kernels (tcgen05, tensor memory) the interpreter cannot run
("Unsupported memory space: tmem"): they are compiled for a B300 instead, and expert parallelism for 8 H100s.
And `auto`'s choice."""

import functools
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode

from olmax.config import ConfigError, MoEConfig
from olmax.model.moe import block_loop, experts, selfcheck, sublayer
from olmax.model.moe.kernels import blackwell, grouped, mxfp8
from olmax.model.moe.kernels.chip import ALIGN, WIDTH_MULTIPLE, Chip
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from olmax.scale.targets import aot_missing, compile_only_devices, parse_target
from testlib import moe_layer_params

HOPPER = Chip(major=9, sms=4)  # few SMs: the interpreter runs one thread per SM
BLOCK = ALIGN
D, F = 128, 128  # one 128 x 128 tile


def _grouped_inputs(counts, dtype, width=D, seed=0):
    """x [rows, D] in the block layout (each group padded to BLOCK rows, zero rows after the last), w [G, D, F],
    the block starts, and the layout's group sizes."""
    counts = np.asarray(counts)
    blocks = -(-counts // BLOCK)
    starts = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32)
    rows = (starts[-1] + 2) * BLOCK  # two spare blocks, as the layout's static bound leaves
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, width), dtype)
    used = np.zeros(rows, bool)
    for g, n in enumerate(counts):
        used[starts[g] * BLOCK: starts[g] * BLOCK + n] = True
    x = jnp.where(jnp.asarray(used)[:, None], x, 0)  # padding rows are zeros, as the layout gathers them
    w = jax.random.normal(kw, (len(counts), width, width), dtype) * width**-0.5
    cotangent = jax.random.normal(ky, (rows, width), dtype)
    return x, w, jnp.asarray(starts), jnp.asarray(blocks * BLOCK, jnp.int32), cotangent


def _value_and_grads(fn, x, w, cotangent):
    y, vjp = jax.vjp(fn, x, w)
    return (y, *vjp(cotangent))


def test_hopper_kernels_match_ragged_dot_and_the_block_loop():
    """Uneven groups, an empty one in the middle and one at the end, row counts off the 128-row tile: output,
    input and weight gradients of the kernels against lax.ragged_dot's and the block loop's, in float32 (in bf16:
    the check at first use, tests/model/test_selfcheck.py)."""
    dtype = jnp.float32
    x, w, starts, sizes, cotangent = _grouped_inputs([37, 0, 100, 65, 0], dtype)
    with force_gpu_interpret_mode(InterpretGPUParams()):
        ours = _value_and_grads(lambda a, b: grouped.matmul(a, b, starts, BLOCK, HOPPER), x, w, cotangent)
    loop = _value_and_grads(lambda a, b: block_loop.matmul(a, b, starts, BLOCK), x, w, cotangent)
    ragged = _value_and_grads(lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)
                              .astype(dtype), x, w, cotangent)
    tol = dict(rtol=1e-5, atol=1e-4)
    for name, a, b, c in zip(("y", "dx", "dw"), ours, loop, ragged):
        assert a.dtype == b.dtype == dtype, name
        np.testing.assert_allclose(np.float32(a), np.float32(b), **tol, err_msg=name)
        np.testing.assert_allclose(np.float32(a), np.float32(c), **tol, err_msg=name)
    np.testing.assert_array_equal(np.float32(ours[2][1]), 0)  # an empty group's weights get no gradient
    np.testing.assert_array_equal(np.float32(ours[0][int(starts[-1]) * BLOCK:]), 0)  # rows after the groups


def _device(cc, sms=132, platform="gpu"):
    return types.SimpleNamespace(platform=platform, compute_capability=cc, core_count=sms, device_kind="a GPU")


def test_auto_takes_the_kernels_where_they_run():
    """Any width: the kernels pad to their tiles (the 1.2T MoE's 4,480-wide experts were refused)."""
    assert sublayer.dispatch_for("auto", "gpu", _device("9.0")) == "grouped"
    assert sublayer.dispatch_for("auto", "gpu", _device("10.3")) == "grouped"
    assert sublayer.dispatch_for("auto", "gpu", _device("8.0")) == "blocks"  # an A100
    assert sublayer.dispatch_for("auto", "gpu", _device("9.0"), mxfp8=True) == "blocks"
    assert sublayer.dispatch_for("auto", "gpu", _device("10.3"), mxfp8=True) == "grouped"  # MXFP8 kernels
    assert sublayer.dispatch_for("auto", "cpu", None, mxfp8=True) == "blocks"  # the CPU emulates MXFP8
    assert sublayer.dispatch_for("auto", "cpu", None) == "blocks"  # the CPU keeps its loop
    assert sublayer.dispatch_for("grouped", "gpu", _device("10.0"), mxfp8=True) == "grouped"
    with pytest.raises(ConfigError, match="CPUs; set impl.moe.dispatch=auto or blocks"):
        sublayer.dispatch_for("grouped", "cpu", None)


def test_kernels_under_a_map_over_stages_run_each_stage_unbatched():
    """The pipeline maps its layers over a stage dimension (a vmap); a kernel's grid covers one GPU's rows and takes
    no batch dimension, so each stage's launch runs on its own (one_launch_a_device): under a map over 2 stages of
    different groups, the Hopper kernels' values and both gradients, and those of the TPU path's ragged_dot
    (experts.ragged_dot, whose forward and gradients run the same way), are lax.ragged_dot's for each stage."""
    stages = [_grouped_inputs(counts, jnp.float32, seed=seed) for seed, counts in enumerate([[37, 0, 100], [0, 64, 70]])]
    x, w, starts, sizes, cotangent = (jnp.stack(parts) for parts in zip(*stages))

    def value_and_grads(dot, x, w, groups, cotangent):
        return _value_and_grads(lambda a, b: dot(a, b, groups), x, w, cotangent)

    reference = jax.vmap(functools.partial(value_and_grads, jax.lax.ragged_dot))(x, w, sizes, cotangent)
    with force_gpu_interpret_mode(InterpretGPUParams()):
        kernels = jax.vmap(functools.partial(value_and_grads, lambda a, b, s: grouped.matmul(a, b, s, BLOCK, HOPPER)))(
            x, w, starts, cotangent)
    ragged = jax.vmap(functools.partial(value_and_grads, experts.ragged_dot))(x, w, sizes, cotangent)
    for name, ref, *ours in zip(("y", "dx", "dw"), reference, kernels, ragged):
        for got in ours:
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4, err_msg=name)


def test_hopper_kernels_run_any_width_padded_to_their_tiles():
    """Widths off the 128-wide tiles: x's columns and w's rows and columns padded with zeros, the output cut (in
    bf16 the check's problem is off the tiles too: d 576, f 192)."""
    x, w, starts, sizes, cotangent = _grouped_inputs([37, 0, 100], jnp.float32, 200)
    with force_gpu_interpret_mode(InterpretGPUParams()):
        ours = _value_and_grads(lambda a, b: grouped.matmul(a, b, starts, BLOCK, HOPPER), x, w, cotangent)
    ragged = _value_and_grads(lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32),
                              x, w, cotangent)
    for name, a, b in zip(("y", "dx", "dw"), ours, ragged):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-5, atol=1e-4, err_msg=name)


def test_grouped_runs_mxfp8_on_blackwell_only(capsys):
    """impl.fp8=mxfp8 with impl.moe.dispatch=grouped: the MXFP8 kernels on Blackwell (before: refused on any
    GPU, "no MXFP8 grouped kernel"); refused on Hopper, whose tensor cores have no block-scaled MMA."""
    from olmax.cli import main

    assert main(["config", "show", "tiny_moe", "impl.fp8=mxfp8", "impl.moe.dispatch=grouped"]) == 0
    capsys.readouterr()
    assert sublayer.dispatch_for("grouped", "gpu", _device("10.0"), mxfp8=True) == "grouped"
    with pytest.raises(ConfigError, match="MXFP8 kernels are Blackwell's .*; set impl.moe.dispatch=auto or blocks"):
        sublayer.dispatch_for("grouped", "gpu", _device("9.0"), mxfp8=True)


def _untiled(values, tiled):
    """What a kernel's MXFP8 operand (mxfp8.mx_operand: values [R, C], scales in tcgen05's layout) stands for,
    in float32: each value times the scale tcgen05 reads for it, at [r // 128, j // 4, r % 32, (r % 128) // 32 *
    4 + j % 4] for row r and 32-wide block j = c // 32."""
    r, c = np.meshgrid(np.arange(values.shape[0]), np.arange(values.shape[1]), indexing="ij")
    j = c // 32
    scales = tiled[r // 128, j // 4, r % 32, (r % 128) // 32 * 4 + j % 4]
    return values.astype(jnp.float32) * scales.astype(jnp.float32)


def test_mxfp8_kernels_operands_are_the_block_loops_mxfp8_values():
    """The operands each MXFP8 kernel reads (values and scales, quantized once a call along its product's
    contraction, scales in tcgen05's layout) stand for the values fp8's MXFP8 emulation (the block loop's) gives
    the same product, bit for bit: x and w along K (the forward), dy and w along N (the input gradient), x and dy
    along the rows (the weight gradient: the rows of a group, 32-row blocks of a 256-row aligned layout)."""
    from olmax.model import fp8

    rows, k, n = 512, 256, 512
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16) * jnp.exp(jax.random.normal(kx, (rows, 1)) * 4)
    w = (jax.random.normal(kw, (2, k, n)) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(ky, (rows, n), jnp.bfloat16).at[:32].set(0)  # a block of zeros: scale 2^-127
    emulated = {"y": (fp8.mx_round(x, 1), jnp.swapaxes(fp8.mx_round(w, 1), 1, 2)),
                "dx": (fp8.mx_round(dy, 1), fp8.mx_round(w, 2)),
                "dw": (fp8.mx_round(x, 0).T, fp8.mx_round(dy, 0).T)}
    inputs = {"y": (x, w), "dx": (dy, w), "dw": (x, dy)}
    for product, (a, b) in inputs.items():
        (av, ascales), (bv, bscales) = mxfp8.OPERANDS[product](a, b)
        assert av.dtype == bv.dtype == jnp.float8_e4m3fn and ascales.dtype == jnp.float8_e8m0fnu, product
        ours = [_untiled(av, ascales)] + [_untiled(bv[g], bscales[g]) for g in range(2)] if bv.ndim == 3 else \
            [_untiled(av, ascales), _untiled(bv, bscales)]
        a_emulated, b_emulated = emulated[product]
        theirs = [a_emulated] + ([b_emulated[g] for g in range(2)] if b_emulated.ndim == 3 else [b_emulated])
        for mine, emulation in zip(ours, theirs):
            np.testing.assert_array_equal(np.float32(mine), np.float32(emulation.astype(jnp.float32)),
                                          err_msg=product)


def _compiled_in_own_process(check: str, target: str) -> None:
    # Mosaic GPU's compiler keeps the first GPU generation a process compiles its kernels for: a B300's kernels
    # after an H100's stop ptxas ("SM version specified by .target is higher than default SM version assumed").
    # `olmax compile` compiles for one target a process; so does each of these checks.
    tests = str(Path(__file__).parents[1])
    env = os.environ | {"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, check, target], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def _compile_kernels(target):
    """Forward and both gradients compiled for one GPU of the target, on the problem its check at first use runs
    (olmax.model.moe.selfcheck: widths off both generations' tiles, padded to them): three Mosaic GPU custom calls,
    the Hopper kernels' wgmma or the Blackwell kernels' tcgen05 lowered by LLVM and assembled by ptxas at compile
    time (wgmma on a B300 stops LLVM: "Cannot select: intrinsic %llvm.nvvm.wgmma.fence.sync.aligned"), and no
    expert block loop left (Blackwell's weight gradient ran in one)."""
    device = compile_only_devices(parse_target(target))[0]
    chip = Chip.of(device)
    x, w, starts, _, cotangent = selfcheck.problem(jnp.bfloat16, chip.block, selfcheck.Shape.of(chip))
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in (x, w, starts, cotangent)]

    def step(x, w, starts, cotangent):
        return _value_and_grads(lambda a, b: grouped.matmul(a, b, starts, chip.block, chip), x, w, cotangent)

    hlo = jax.jit(step).lower(*spec).compile().as_text()
    assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 3
    assert block_loop.BLOCK_LOOP not in hlo


def _compile_mxfp8_kernels(target):
    """impl.fp8=mxfp8's kernels, forward and both gradients, compiled for one GPU of the target: three Mosaic GPU
    custom calls, tcgen05's block-scaled MMAs assembled by ptxas, and no expert block loop left."""
    device = compile_only_devices(parse_target(target))[0]
    chip = Chip.of(device)
    x, w, starts, _, cotangent = selfcheck.problem(jnp.bfloat16, chip.block, selfcheck.Shape.of(chip, mxfp8=True))
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in (x, w, starts, cotangent)]

    def step(x, w, starts, cotangent):
        return _value_and_grads(lambda a, b: grouped.matmul(a, b, starts, chip.block, chip, mxfp8=True), x, w,
                                cotangent)

    hlo = jax.jit(step).lower(*spec).compile().as_text()
    assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 3
    assert "blackwell_mx_grouped_matmul" in hlo and "blackwell_mx_weight_grad" in hlo
    assert block_loop.BLOCK_LOOP not in hlo


def _compile_expert_parallel_layer(target):
    """The MoE layer expert-parallel over a host of 8 GPUs (2 experts resident a GPU) with its gradients: the
    dropless exchange is XLA's asynchronous ragged all-to-all (no emulation), and each GPU's kernels run its
    received rows."""
    devices = compile_only_devices(parse_target(target))
    mesh = Mesh(np.array(devices), ("expert",))
    chip = Chip.of(devices[0])
    width = WIDTH_MULTIPLE[chip.major]  # Hopper's at 128, under the 256 Blackwell needs
    cfg = MoEConfig(num_experts=16, top_k=2, expert_hidden=width)
    p = jax.eval_shape(lambda: moe_layer_params(cfg, width, jax.random.key(0)))
    rows, replicated = (NamedSharding(mesh, PartitionSpec(*spec)) for spec in (("expert",), ()))
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=replicated), p)
    x = jax.ShapeDtypeStruct((64, 16, width), jnp.bfloat16, sharding=rows)

    def loss(p, x):
        out, _ = sublayer.moe_mlp(cfg, p, x, mesh=mesh, batch_axes=("expert",), dispatch="grouped", chip=chip)
        return jnp.sum(out.astype(jnp.float32))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(p, x).compile().as_text()
    assert "ragged-all-to-all-start" in hlo and "ragged-all-to-all-done" in hlo
    assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 9  # 3 matmuls, each a kernel and 2 gradients
    assert block_loop.BLOCK_LOOP not in hlo


def _compile_train_step_report(target, overrides=(), mxfp8=False):
    """`olmax compile`'s report of a small MoE (widths in the kernels' tiles) for the target: `auto` takes the
    grouped kernels, the report names them, and the step-time model knows every one."""
    from olmax.config import load_config
    from olmax.scale.compile import compile_train_step

    cfg = load_config("tiny_moe", ["model.d_model=256", "model.moe.expert_hidden=256", *overrides])
    report = compile_train_step(cfg, parse_target(target), mfu=None)
    assert report["moe_dispatch"] == "grouped"
    calls = report["program"]["custom_calls"]
    hopper = report["device_kind"].startswith("NVIDIA H")
    names = (["grouped_matmul", "grouped_weight_grad"] if hopper
             else ["blackwell_mx_grouped_matmul", "blackwell_mx_weight_grad"] if mxfp8
             else [f"ragged_dot_kernel_{blackwell.RAGGED_DOT}", "blackwell_weight_grad"])
    assert all(calls.get(f"mosaic_gpu_v2 {name}", 0) > 0 for name in names), calls
    assert report["step_time"]["unknown_kernels"] == {} and report["step_time"]["warnings"] == []
    return report


def _compile_mxfp8_train_step_report(target):
    """impl.fp8=mxfp8 on a B300: `auto` takes the MXFP8 grouped kernels (before: the block loop), and the block
    projections stay cuDNN's block-scaled GEMMs."""
    report = _compile_train_step_report(target, ["impl.fp8=mxfp8", "data.sequence_length=256"], mxfp8=True)
    assert report["program"]["mxfp8_matmuls"] > 0


@pytest.mark.slow
@pytest.mark.skipif(aot_missing("gpu") is not None, reason="needs the aot-gpu extra")
@pytest.mark.parametrize("target", ["gpu:h100x8", "gpu:b300x8"])
def test_compile_report_names_the_kernels(target):
    _compiled_in_own_process("_compile_train_step_report", target)


@pytest.mark.slow
@pytest.mark.skipif(aot_missing("gpu") is not None, reason="needs the aot-gpu extra")
def test_compile_report_names_the_mxfp8_kernels_on_a_b300():
    """Cost: a compile of the MXFP8 grouped kernels for a B300 (Mosaic GPU), in a process of its own."""
    _compiled_in_own_process("_compile_mxfp8_train_step_report", "gpu:b300x8")


@pytest.mark.skipif(aot_missing("gpu") is not None, reason="needs the aot-gpu extra")
def test_kernels_compile_for_a_b300():
    _compiled_in_own_process("_compile_kernels", "gpu:b300x8")


@pytest.mark.skipif(aot_missing("gpu") is not None, reason="needs the aot-gpu extra")
def test_mxfp8_kernels_compile_for_a_b300():
    _compiled_in_own_process("_compile_mxfp8_kernels", "gpu:b300x8")


@pytest.mark.slow
@pytest.mark.skipif(aot_missing("gpu") is not None, reason="needs the aot-gpu extra")
@pytest.mark.parametrize("target", ["gpu:h100x8", "gpu:b300x8"])
def test_expert_parallel_layer_compiles_with_the_kernels(target):
    """(Pallas' GPU interpreter cannot run kernels inside a shard_map over several CPU devices: it joins the
    devices' kernels at a barrier, which XLA:CPU never reaches running them one after another.)"""
    _compiled_in_own_process("_compile_expert_parallel_layer", target)


if __name__ == "__main__":
    globals()[sys.argv[1]](sys.argv[2])
