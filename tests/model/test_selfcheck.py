"""The grouped kernels' check at first use (olmax.model.moe.selfcheck), tried as a reviewer would: the Hopper
kernels under Pallas' GPU interpreter pass it, and wrong kernels substituted for them fail it (an output 2% off;
a contraction that stops after one ring of shared-memory slots; the column tiles past the first skipped); the
problem runs every path of every chip's kernels; the MXFP8 check's reference does not share the kernels'
quantization; a failed check falls back to the block loop and says why."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src import config
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, set_gpu_interpret_mode

from olmax.config import ConfigError
from olmax.model import fp8
from olmax.model.moe import block_loop, selfcheck
from olmax.model.moe.kernels import blackwell, grouped, hopper, mxfp8
from olmax.model.moe.kernels.chip import ALIGN, BLACKWELL_BLOCK, WIDTH_MULTIPLE, Chip

HOPPER = Chip(major=9, sms=4)  # few SMs: the interpreter runs one thread per SM (Hopper's kernels take no SM count)
B300 = Chip(major=10, sms=148)


def _hopper_kernels(x, w, starts, block):
    return grouped.matmul(x, w, starts, block, HOPPER)


def _hopper_verdict():
    # the interpreter for every thread's kernels: the check runs in a thread of its own
    state = config.pallas_tpu_interpret_mode_context_manager
    before = state.get_global()
    set_gpu_interpret_mode(InterpretGPUParams())
    try:
        return selfcheck.verdict(_hopper_kernels, "hopper", jnp.bfloat16, ALIGN, selfcheck.Shape.of(HOPPER))
    finally:
        state.set_global(before)


def test_the_hopper_kernels_pass_their_check():
    """The real kernels under the interpreter, on the problem the check runs on an H100, in bf16."""
    assert _hopper_verdict() is None


def _off_by_two_percent(monkeypatch):
    kernel = hopper.matmul_kernel
    monkeypatch.setattr(hopper, "matmul_kernel", lambda *a: (kernel(*a).astype(jnp.float32) * 1.02).astype(
        a[0].dtype))


def _one_ring_of_steps(monkeypatch):
    """Each program's contraction stops after max_concurrent_steps steps: its slots never reused."""
    def emit_pipeline(body, *, grid, max_concurrent_steps, **kwargs):
        return plgpu.emit_pipeline(body, grid=(jnp.minimum(grid[0], max_concurrent_steps),),
                                          max_concurrent_steps=max_concurrent_steps, **kwargs)

    monkeypatch.setattr(hopper, "plgpu", types.SimpleNamespace(**vars(plgpu) | {"emit_pipeline": emit_pipeline}))


def _first_column_tile_only(monkeypatch):
    """Only the programs of the first column tile run: the others' outputs are never written."""
    def kernel(body, **kwargs):
        def first_tile(*refs):
            pl.when(jax.lax.axis_index("n") == 0)(lambda: body(*refs))

        return plgpu.kernel(first_tile, **kwargs)

    monkeypatch.setattr(hopper, "plgpu", types.SimpleNamespace(**vars(plgpu) | {"kernel": kernel}))


@pytest.mark.parametrize("fault, least, most", [(_off_by_two_percent, 0.015, 0.03), (_one_ring_of_steps, 0.1, 1.0),
                                                 (_first_column_tile_only, np.nan, np.nan)])
def test_wrong_hopper_kernels_fail_their_check(monkeypatch, fault, least, most):
    """At the old check's size (groups of 37, 0, 130 and 64 rows, width 256) and tolerance (3%), the first two
    passed: a 2% error hid under the tolerance, and no contraction there outran its ring of 4 slots (the third
    failed there on Hopper's 128-wide column tiles, not on Blackwell's 256-wide ones). The forward is off, so the
    gradients are not run."""
    fault(monkeypatch)
    line = _hopper_verdict()
    found = re.fullmatch(r"hopper: y in bfloat16 off lax\.ragged_dot by (\S+) of its largest value \(tolerance 0.01\)",
                         line or "")
    assert found, line
    off = float(found.group(1))
    assert least <= off <= most or np.isnan(least) and np.isnan(off), line


def _steps(size: int, step: int, multiple: int) -> int:
    return -(-size // multiple) * multiple // step


@pytest.mark.parametrize("chip, mx", [(Chip(9, 132), False), (B300, False), (B300, True)])
def test_the_check_runs_every_path_of_the_kernels(chip, mx):
    """From the kernels' tunings: every contraction goes twice round its ring of slots and on, in the forward (the
    input gradient is the same kernel) and the weight gradient's largest group; the outputs of the forward and of
    the input gradient span two column tiles or more; JAX's persistent Blackwell kernel takes more tiles than twice
    its clusters (SMs in pairs), so that each cluster's accumulator buffers are both used and one reused."""
    shape = selfcheck.Shape.of(chip, mx)
    multiple = WIDTH_MULTIPLE[chip.major]
    if chip.major == 9:
        t = hopper.TUNING
        kernels = [(t.block_k, t.max_concurrent_steps, t.block_n, ALIGN, t.max_concurrent_steps)]
    elif mx:
        t = mxfp8.TUNING
        kernels = [(t.block_k, t.max_concurrent_steps, t.block_n, t.block_k, t.max_concurrent_steps)]
    else:
        r, g = blackwell.RAGGED_DOT, blackwell.WEIGHT_GRAD
        kernels = [(r.tile_k, r.max_concurrent_steps, 2 * r.tile_n, blackwell.SWIZZLE // 2, g.max_concurrent_steps),
                   (r.tile_k, r.max_concurrent_steps, g.block_n, blackwell.SWIZZLE // 2, g.max_concurrent_steps)]
        rows = (sum(-(-c // BLACKWELL_BLOCK) for c in shape.counts) + 1) * BLACKWELL_BLOCK
        linear_grid = (rows // blackwell.ROW_TILE + len(shape.counts) - 1) * _steps(shape.n, 2 * r.tile_n, multiple)
        assert linear_grid > 2 * (chip.sms // 2)
    largest = max(shape.counts)
    for step, ring, columns, row_step, row_ring in kernels:
        assert _steps(shape.k, step, multiple) > 2 * ring
        assert -(-largest // chip.block) * chip.block // row_step > 2 * row_ring
        assert _steps(shape.n, columns, multiple) >= 2 and _steps(shape.k, columns, multiple) >= 2
        assert shape.k % multiple and shape.n % multiple  # widths off the tiles, padded
    assert 0 in shape.counts and any(0 < c % chip.block for c in shape.counts)  # an empty group, a partial block


def test_mx_round_is_the_mxfp8_rounding():
    """The MXFP8 check's reference rounding (numpy, from the format's definition) gives fp8.mx_quantize's values
    bit for bit, along either axis: wide-ranging blocks, a block of zeros, and a width off the 32-value blocks."""
    key = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key[0], (96, 80), jnp.bfloat16) * jnp.exp(jax.random.normal(key[1], (96, 1)) * 4)
    a = a.at[:32, :32].set(0)
    for axis in (0, 1):
        ours = selfcheck.mx_round(np.float32(a), axis)
        theirs = np.float32(fp8.mx_round(jnp.pad(a, ((0, 0), (0, 16))), 1)[:, :80]) if axis else np.float32(
            fp8.mx_round(a, 0))
        np.testing.assert_array_equal(ours, theirs)


def _mxfp8_verdict():
    """The block loop's MXFP8 products (fp8.MXDot, the kernels' quantization) through the MXFP8 check."""
    return selfcheck.verdict(lambda x, w, starts, b: block_loop.matmul(x, w, starts, b, fp8.MXDot("cpu")), "loop",
                             jnp.bfloat16, BLACKWELL_BLOCK, selfcheck.Shape.of(B300, True),
                             **selfcheck.MXFP8_REFERENCE)


def test_the_mxfp8_check_does_not_share_the_kernels_quantization(monkeypatch):
    """The block loop's MXFP8 products pass the MXFP8 check; with fp8.mx_quantize's scales rounded down (the
    largest values of a block clipped to e4m3's 448), which the kernels and the block loop share, they fail it
    (against the block loop's own products, the reference before, they would pass)."""
    assert _mxfp8_verdict() is None
    quantize = fp8.mx_quantize

    def scales_rounded_down(x, axis):  # each scale one power of two smaller: the values twice as large, clipped
        values, scales = quantize(x, axis)
        doubled = jnp.clip(values.astype(jnp.float32) * 2, -448, 448).astype(values.dtype)
        exponents = jax.lax.bitcast_convert_type(scales, jnp.uint8)
        return doubled, jax.lax.bitcast_convert_type(exponents - 1, scales.dtype)

    monkeypatch.setattr(fp8, "mx_quantize", scales_rounded_down)
    line = _mxfp8_verdict()
    assert line is not None and line.startswith("loop: y in bfloat16 off lax.ragged_dot on MXFP8-rounded inputs by")


def _one_group_wrong(x, w, starts, block):
    """The block loop's product with group 2's weights 10% too large: a kernel that launches and is wrong."""
    return block_loop.matmul(x, w.at[2].multiply(1.1), starts, block)


@jax.custom_vjp
def _nan_weight_grad(x, w, starts):
    """The block loop's product whose weight gradient is NaN (its value and input gradient right)."""
    return block_loop.matmul(x, w, starts, ALIGN)


def _nan_weight_grad_bwd(res, dy):
    x, w, starts = res
    dx, dw = jax.vjp(lambda a, b: block_loop.matmul(a, b, starts, ALIGN), x, w)[1](dy)
    return dx, dw * jnp.nan, None


_nan_weight_grad.defvjp(lambda x, w, starts: (_nan_weight_grad(x, w, starts), (x, w, starts)), _nan_weight_grad_bwd)


def _launch_fails(x, w, starts, block):
    raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure\n(the driver's details)")


def _verdict(product, name, dtype=jnp.bfloat16):
    return selfcheck.verdict(product, name, dtype, ALIGN, selfcheck.Shape.of(HOPPER))


def test_the_check_names_a_wrong_kernel_and_its_error():
    """A product off in one group's weights fails the check, naming the kernel and the largest error; one with a
    NaN gradient fails it; one that raises fails it with the first line of what it raised; the block loop passes
    it, in bf16 and float32."""
    assert _verdict(_one_group_wrong, "wrong_kernel").startswith("wrong_kernel: y in bfloat16 off lax.ragged_dot by 0.1")
    assert _verdict(_launch_fails, "launcher") == (
        "launcher: RuntimeError: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")
    assert _verdict(lambda x, w, starts, block: _nan_weight_grad(x, w, starts), "nan").startswith(
        "nan: dw in bfloat16 off lax.ragged_dot by nan")
    for dtype in (jnp.bfloat16, jnp.float32):
        assert _verdict(lambda x, w, starts, block: block_loop.matmul(x, w, starts, block), "loop", dtype) is None


def test_a_failed_check_runs_the_block_loop_and_says_why(capsys):
    """Inside the trace of the program being built (as the train step builds its model), the check runs on
    concrete arrays; a failure makes the dispatch `blocks`, said once in one line naming the kernel."""
    def check(chip, dtype):
        return _verdict(_one_group_wrong, selfcheck.kernel_name(chip), dtype)

    dispatches = []

    @jax.jit
    def build(a):  # the model built twice in one process (the train step, an eval)
        dispatches.extend(selfcheck.checked_dispatch("grouped", HOPPER, jnp.bfloat16, check) for _ in range(2))
        return a

    build(1.0)
    assert dispatches == ["blocks", "blocks"]
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("olmax: the grouped kernels failed their check on this GPU, so the experts run in the "
                           "block loop (impl.moe.dispatch=blocks): grouped.matmul for sm_90 (grouped_matmul, "
                           "grouped_weight_grad): y in bfloat16 off lax.ragged_dot by 0.1")
    assert selfcheck.checked_dispatch("grouped", HOPPER, jnp.bfloat16, lambda chip, dtype: None) == "grouped"
    # Several processes each check their own GPU: one falling back alone would build another program than its
    # peers, so the run stops with the line instead.
    with pytest.raises(ConfigError, match="cannot fall back on one alone: set impl.moe.dispatch=blocks"):
        selfcheck.checked_dispatch("grouped", HOPPER, jnp.bfloat16, check, processes=2)
