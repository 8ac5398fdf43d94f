"""The grouped kernels (olmax.model.moe.kernels) checked on the GPU before a run uses them: once a process, for
the chip and dtype the run uses, forward, input and weight gradient on a small problem against `lax.ragged_dot` in
float32 (the MXFP8 kernels against the block loop's MXFP8 products, fp8.MXDot's: the same quantized operands).
A kernel that launches but computes wrong values (a compiler or driver the kernels were never run with) would
otherwise train on garbage; one that fails, or fails to launch, leaves the run the block loop instead."""

from __future__ import annotations

import functools
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import ConfigError
from olmax.model import fp8
from olmax.model.moe import block_loop
from olmax.model.moe.kernels import grouped
from olmax.model.moe.kernels.chip import WIDTH_MULTIPLE, Chip

COUNTS = (37, 0, 130, 64)  # rows a group: uneven, one empty, one of whole blocks (Hopper's), off the tiles
WIDTH = WIDTH_MULTIPLE[10]  # d and f: one of Blackwell's 256-wide tiles, two of Hopper's
# The largest difference allowed, a fraction of the reference's largest value: bf16 outputs round at 2^-9
# relative; float32 inputs run as TF32 on the tensor cores (10-bit mantissa). A wrong group is off by order 1.
TOLERANCE = {"bfloat16": 3e-2, "float32": 5e-3}
FAILED = "moe/grouped kernels failed check"  # the metric, 1 at the run's first step where they did


def problem(dtype, block: int, counts=COUNTS, width: int = WIDTH, seed: int = 0):
    """x [rows, width] in the kernels' layout (each group's rows padded with zero rows to a multiple of `block`,
    a spare block after the last), w [G, width, width], the block starts, the layout's group sizes, and a
    cotangent for the gradients."""
    counts = np.asarray(counts)
    blocks = -(-counts // block)
    starts = np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32)
    rows = (int(starts[-1]) + 1) * block
    used = np.zeros(rows, bool)
    for g, n in enumerate(counts):
        used[starts[g] * block: starts[g] * block + n] = True
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    x = jnp.where(jnp.asarray(used)[:, None], jax.random.normal(kx, (rows, width), dtype), 0)
    w = (jax.random.normal(kw, (len(counts), width, width)) * width**-0.5).astype(dtype)
    cotangent = jax.random.normal(ky, (rows, width), dtype)
    return x, w, jnp.asarray(starts), jnp.asarray(blocks * block, jnp.int32), cotangent


def ragged_dot_f32(x, w, sizes, cotangent):
    """y, dx, dw by `lax.ragged_dot` on the inputs in float32."""
    f32 = [a.astype(jnp.float32) for a in (x, w, cotangent)]
    y, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), f32[0], f32[1])
    return (y, *vjp(f32[2]))


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


def mxfp8_block_loop(x, w, sizes, cotangent, block: int):
    """y, dx, dw by the block loop in MXFP8 (fp8.MXDot's products of the dequantized operands, in float32 on any
    platform) over `block`-row blocks."""
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes // block)])
    y, vjp = jax.vjp(lambda a, b: block_loop.matmul(a, b, starts, block, fp8.MXDot("cpu")), x, w)
    return (y, *vjp(cotangent))


def errors(product, dtype, block: int, reference=ragged_dot_f32) -> dict[str, float]:
    """`product(x, w, block_starts, block)` (grouped.matmul's arguments) on the small problem: the largest
    difference of y, dx and dw from `reference`'s, each a fraction of the reference's largest value."""
    x, w, starts, sizes, cotangent = problem(dtype, block)
    y, vjp = jax.vjp(jax.jit(lambda a, b: product(a, b, starts, block)), x, w)
    ours = (y, *vjp(cotangent))
    theirs = reference(x, w, sizes, cotangent)
    return {name: float(np.max(np.abs(np.float64(a.astype(jnp.float32)) - np.float64(b))) / np.max(np.abs(b)))
            for name, a, b in zip(("y", "dx", "dw"), ours, theirs)}


def verdict(product, name: str, dtype, block: int, reference=ragged_dot_f32,
            reference_name: str = "lax.ragged_dot") -> str | None:
    """None where `product` (named `name`) agrees with `reference` (lax.ragged_dot) on the small problem, else one
    line saying how it does not: its largest error, or the first line of what it raised (a launch failure among
    them)."""
    dtype = jnp.dtype(dtype).name
    try:
        # In a thread of its own: JAX's tracing state is a thread's, so the check runs now, on concrete arrays and
        # outside any mesh, even while the program that asks for it is being traced.
        with ThreadPoolExecutor(1) as thread:
            found = thread.submit(errors, product, dtype, block, reference).result()
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


_verdicts: dict[tuple, str | None] = {}
_said: set[str] = set()


def check(chip: Chip, dtype, mxfp8: bool = False) -> str | None:
    """The grouped kernels' verdict for `chip` in `dtype` (`mxfp8`: the MXFP8 kernels, against the block loop's
    MXFP8 products) on this process's GPU (see `verdict`), found once."""
    key = (chip, jnp.dtype(dtype).name, mxfp8)
    if key not in _verdicts:
        reference = (dict(reference=functools.partial(mxfp8_block_loop, block=chip.block),
                          reference_name="the MXFP8 block loop") if mxfp8 else {})
        _verdicts[key] = verdict(lambda x, w, starts, block: grouped.matmul(x, w, starts, block, chip, mxfp8),
                                 kernel_name(chip, mxfp8), dtype, chip.block, **reference)
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
