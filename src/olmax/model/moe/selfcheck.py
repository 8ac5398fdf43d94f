"""The grouped kernels (olmax.model.moe.kernels) checked on the GPU before a run uses them: once a process, for
the chip and dtype the run uses, forward, input and weight gradient against a reference. A kernel that launches
but computes wrong values (a compiler or driver the kernels were never run with) would otherwise train on garbage;
one that fails, or fails to launch, leaves the run the block loop instead.

What a new driver or compiler is likeliest to break is the machinery a small problem never reaches, so the
problem is sized from the kernels' own tunings (`Shape.of`) for every path to run: each kernel's contraction goes
LAPS times round its ring of shared-memory slots and more (a slot refilled once its MMA has read it), the outputs
span several column tiles (a program's column indexing), and JAX's persistent Blackwell kernel gets more tiles
than twice its clusters (each cluster's second tile in the accumulator's other buffer, its third back in the
first once the store of the first has finished); the groups are uneven, one empty, one of whole blocks, and the
widths off the tiles (padded to them).

The reference is `lax.ragged_dot` in float32 at full precision on the same inputs; for the MXFP8 kernels, on
inputs rounded to MXFP8 along each product's contraction by `mx_round`, numpy's float64 arithmetic written from
the format's definition, so that a fault in the quantization the kernels share with the block loop
(fp8.mx_quantize) fails the check too."""

from __future__ import annotations

import functools
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import ConfigError
from olmax.model.moe.kernels import blackwell, grouped, hopper
from olmax.model.moe.kernels import mxfp8 as mx
from olmax.model.moe.kernels.chip import ALIGN, Chip

# The correct kernels' outputs differ from the float32 reference by their rounding to bf16: at most half a unit in
# the last place of the largest value, 2^-8 of it (0.20-0.33% measured under the interpreter on Hopper's
# problem). 1% keeps them with a margin of 2.5 and fails a kernel 2% off (1.6% at least after the rounding).
# float32 inputs run as TF32 on the tensor cores (10-bit mantissas: about 2^-10 of the largest value).
TOLERANCE = {"bfloat16": 1e-2, "float32": 5e-3}
FAILED = "moe/grouped kernels failed check"  # the metric, 1 at the run's first step where they did
LAPS = 2  # times each kernel's contraction goes round its ring of slots before its last, partial lap


@dataclass(frozen=True)
class Paths:
    """What a chip's grouped kernels step through: the products' contraction along the width (`step` columns a
    step, `ring` slots) and along the rows (the weight gradient's), their widest column tile, and for a
    persistent kernel its workers (clusters that each take tiles of persistent_tile rows by column_tile columns
    in turn: 0 where every kernel runs a program per tile)."""

    step: int
    ring: int
    row_step: int
    row_ring: int
    column_tile: int
    workers: int = 0
    persistent_tile: int = 0

    @classmethod
    def of(cls, chip: Chip, mxfp8: bool = False) -> Paths:
        if chip.major == 9:
            tuning = hopper.TUNING
            return cls(tuning.block_k, tuning.max_concurrent_steps, ALIGN, tuning.max_concurrent_steps,
                       tuning.block_n)
        if mxfp8:
            tuning = mx.TUNING
            return cls(tuning.block_k, tuning.max_concurrent_steps, tuning.block_k, tuning.max_concurrent_steps,
                       tuning.block_n)
        ragged, weight_grad = blackwell.RAGGED_DOT, blackwell.WEIGHT_GRAD
        return cls(ragged.tile_k, ragged.max_concurrent_steps, blackwell.SWIZZLE // 2,
                   weight_grad.max_concurrent_steps, max(2 * ragged.tile_n, weight_grad.block_n),
                   workers=chip.sms // 2, persistent_tile=blackwell.ROW_TILE)


@dataclass(frozen=True)
class Shape:
    """The check's problem: rows in groups of `counts`, x [rows, k], w [G, k, n] (k the forward's contraction and
    the input gradient's columns, n the reverse)."""

    counts: tuple[int, ...]
    k: int
    n: int

    @classmethod
    def of(cls, chip: Chip, mxfp8: bool = False) -> Shape:
        paths = Paths.of(chip, mxfp8)
        k = (LAPS * paths.ring + 1) * paths.step  # off the tiles: padded to the next
        n = paths.column_tile + paths.column_tile // 2  # two column tiles, the second half zeros
        big = (LAPS * paths.row_ring + 1) * paths.row_step - paths.row_step // 2  # the weight gradient's laps
        counts = [37, 0, big, 64]
        if paths.workers:  # a linear grid of (row tiles + groups - 1) x column tiles over the workers
            linear_rows = -(-(2 * paths.workers + 1) // -(-n // paths.column_tile))
            # the row tiles the other groups and the layout's spare block take
            others = sum(-(-c // paths.persistent_tile) for i, c in enumerate(counts) if i != 2) + 1
            counts[2] = max(big, (linear_rows - (len(counts) - 1) - others) * paths.persistent_tile)
        return cls(tuple(counts), k, n)


def problem(dtype, block: int, shape: Shape, seed: int = 0):
    """x [rows, k] in the kernels' layout (each group's rows padded with zero rows to a multiple of `block`, a
    spare block after the last), w [G, k, n], the block starts, the layout's group sizes, and a cotangent for the
    gradients."""
    counts = np.asarray(shape.counts)
    blocks = -(-counts // block)
    starts = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32)
    rows = (int(starts[-1]) + 1) * block
    used = np.zeros(rows, bool)
    for g, n in enumerate(counts):
        used[starts[g] * block: starts[g] * block + n] = True
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    x = jnp.where(jnp.asarray(used)[:, None], jax.random.normal(kx, (rows, shape.k), dtype), 0)
    w = (jax.random.normal(kw, (len(counts), shape.k, shape.n)) * shape.k**-0.5).astype(dtype)
    cotangent = jax.random.normal(ky, (rows, shape.n), dtype)
    return x, w, jnp.asarray(starts), jnp.asarray(blocks * block, jnp.int32), cotangent


def mx_round(a, axis: int) -> np.ndarray:
    """a's values (float64) after MXFP8 rounding along `axis`, from the format's definition (OCP Microscaling
    Formats v1.0): blocks of 32 along it (zeros past its end), each under the power of two at or above its largest
    magnitude over e4m3's largest, 448 (as jax.nn's mxfp8 rounds the scale, so that nothing clips; exponents in
    [-127, 127]), each value rounded to nearest even among e4m3's: 3 mantissa bits, subnormals below 2^-6."""
    a = np.moveaxis(np.asarray(a, np.float64), axis, -1)
    width = a.shape[-1]
    blocks = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -width % 32)]).reshape(*a.shape[:-1], -1, 32)
    largest = np.max(np.abs(blocks), axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        exponent = np.clip(np.ceil(np.log2(np.where(largest > 0, largest / 448, 1))), -127, 127)
    scaled = blocks / 2.0**exponent
    with np.errstate(divide="ignore"):
        binade = np.maximum(np.floor(np.log2(np.where(scaled != 0, np.abs(scaled), 1))), -6)
    quantum = 2.0 ** (binade - 3)
    rounded = np.clip(np.round(scaled / quantum) * quantum, -448, 448) * 2.0**exponent
    return np.moveaxis(rounded.reshape(*a.shape[:-1], -1)[..., :width], -1, axis)


def reference(x, w, sizes, cotangent, rounded=None):
    """y, dx, dw by `lax.ragged_dot` in float32 at full precision; `rounded(a, axis)` rounds each product's two
    operands along its contraction first (mx_round: MXFP8's products)."""
    def f32(a, axis):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        return jnp.asarray(a if rounded is None else rounded(a, axis), jnp.float32)

    def ragged(a, b):
        return jax.lax.ragged_dot(a, b, sizes, precision=jax.lax.Precision.HIGHEST)

    y = ragged(f32(x, 1), f32(w, 1))
    dx = jax.vjp(lambda a: ragged(a, f32(w, 2)), f32(x, 1))[1](f32(cotangent, 1))[0]
    dw = jax.vjp(lambda b: ragged(f32(x, 0), b), f32(w, 1))[1](f32(cotangent, 0))[0]
    return y, dx, dw


def float64(x, w, sizes, cotangent):
    """y, dx, dw in float64 by numpy, group by group."""
    x, w, dy = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w, cotangent))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    ends = np.cumsum(np.asarray(sizes))
    for g, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends)):
        y[start:end] = x[start:end] @ w[g]
        dx[start:end] = dy[start:end] @ w[g].T
        dw[g] = x[start:end].T @ dy[start:end]
    return y, dx, dw


def _error(ours, theirs) -> float:
    """The largest difference, a fraction of the reference's largest value."""
    ours, theirs = np.float64(np.asarray(ours.astype(jnp.float32))), np.float64(np.asarray(theirs))
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def errors(product, dtype, block: int, shape: Shape, reference=reference, until: float = math.inf
           ) -> dict[str, float]:
    """`product(x, w, block_starts, block)` (grouped.matmul's arguments) on the problem of `shape`: the largest
    difference of y, dx and dw from `reference`'s, each a fraction of the reference's largest value. The forward
    first: where y is off by more than `until` (or NaN) the gradients are not run."""
    x, w, starts, sizes, cotangent = problem(dtype, block, shape)
    expected = reference(x, w, sizes, cotangent)
    y, vjp = jax.vjp(jax.jit(lambda a, b: product(a, b, starts, block)), x, w)
    found = {"y": _error(y, expected[0])}
    if math.isinf(until) or found["y"] <= until:  # the gradients once the forward passed (a NaN did not)
        found |= {name: _error(a, b) for name, a, b in zip(("dx", "dw"), vjp(cotangent), expected[1:])}
    return found


def verdict(product, name: str, dtype, block: int, shape: Shape, reference=reference,
            reference_name: str = "lax.ragged_dot") -> str | None:
    """None where `product` (named `name`) agrees with `reference` (lax.ragged_dot) on the problem of `shape`,
    else one line saying how it does not: its largest error, or the first line of what it raised (a launch
    failure among them)."""
    dtype = jnp.dtype(dtype).name
    try:
        # In a thread of its own: JAX's tracing state is a thread's, so the check runs now, on concrete arrays and
        # outside any mesh, even while the program that asks for it is being traced.
        with ThreadPoolExecutor(1) as thread:
            found = thread.submit(errors, product, dtype, block, shape, reference, TOLERANCE[dtype]).result()
    except Exception as e:  # whatever the kernel raises (a launch failure among them) is its failure
        return f"{name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    worst = max(found, key=lambda name: (np.isnan(found[name]), found[name]))  # a NaN is the worst
    if not found[worst] <= TOLERANCE[dtype]:
        return (f"{name}: {worst} in {dtype} off {reference_name} by {found[worst]:.3g} of its largest value "
                f"(tolerance {TOLERANCE[dtype]})")
    return None


def kernel_name(chip: Chip, mxfp8: bool = False) -> str:
    kernels = ("grouped_matmul, grouped_weight_grad" if chip.major == 9
               else "blackwell_mx_grouped_matmul, blackwell_mx_weight_grad" if mxfp8
               else "blackwell_ragged_dot_mgpu, blackwell_weight_grad")
    return f"grouped.matmul{' in MXFP8' if mxfp8 else ''} for sm_{chip.major}0 ({kernels})"


MXFP8_REFERENCE = dict(reference=functools.partial(reference, rounded=mx_round),
                       reference_name="lax.ragged_dot on MXFP8-rounded inputs")

_verdicts: dict[tuple, str | None] = {}
_said: set[str] = set()


def check(chip: Chip, dtype, mxfp8: bool = False) -> str | None:
    """The grouped kernels' verdict for `chip` in `dtype` (`mxfp8`: the MXFP8 kernels, against MXFP8's products)
    on this process's GPU (see `verdict`), found once."""
    key = (chip, jnp.dtype(dtype).name, mxfp8)
    if key not in _verdicts:
        _verdicts[key] = verdict(lambda x, w, starts, block: grouped.matmul(x, w, starts, block, chip, mxfp8),
                                 kernel_name(chip, mxfp8), dtype, chip.block, Shape.of(chip, mxfp8),
                                 **(MXFP8_REFERENCE if mxfp8 else {}))
    return _verdicts[key]


def failed() -> list[str]:
    """The lines of this process's checks that failed."""
    return [line for line in _verdicts.values() if line]


def checked_dispatch(dispatch: str, chip: Chip, dtype, check=check, processes: int | None = None) -> str:
    """`dispatch` for a run on this process's GPUs: `blocks` instead of `grouped` where the kernels fail
    `check`, said in one line. A run of several processes stops instead (ConfigError): each process checks its own
    GPU, and one falling back alone would build another program than its peers, which would wait for it."""
    if dispatch != "grouped" or (reason := check(chip, dtype)) is None:
        return dispatch
    if (processes or jax.process_count()) > 1:
        raise ConfigError(f"the grouped kernels failed their check on this process's GPU ({reason}); a run of "
                          "several processes cannot fall back on one alone: set impl.moe.dispatch=blocks")
    if reason not in _said:  # once a process, however many times the model is built
        _said.add(reason)
        print(f"olmax: the grouped kernels failed their check on this GPU, so the experts run in the block loop "
              f"(impl.moe.dispatch=blocks): {reason}", file=sys.stderr, flush=True)
    return "blocks"
