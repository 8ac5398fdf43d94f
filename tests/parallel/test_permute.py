"""take_rows and sum_rows against the plain gather and scatter-add they replace: values and autodiff's gradients,
on random routings with rows taken several times, rows taken never and indices past the end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.parallel.permute import sum_rows, take_rows

ROWS, PLACES, D = 6, 11, 5


def _inverse(index: np.ndarray, rows: int, nowhere: int) -> np.ndarray:
    """[rows, W]: where each row's places are in `index` (padded past the end, by `nowhere` and beyond)."""
    places = [np.flatnonzero(index == r) for r in range(rows)]
    width = max(len(p) for p in places) + 1  # one padding column at least, with a place far past the end
    inverse = np.full((rows, width), nowhere, np.int32)
    for r, p in enumerate(places):
        inverse[r, :len(p)] = p
    inverse[:, -1] = nowhere + 7
    return inverse


def _vjp(f, *primals):
    """f's value and its gradients for a random cotangent."""
    out, pullback = jax.vjp(f, *primals)
    return out, pullback(jax.random.normal(jax.random.key(9), out.shape, out.dtype))


def _check(got, want, tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", [0, 1])
def test_take_rows_is_a_gather_and_its_backward_the_scatter_add(seed):
    """A row taken three times gets three cotangents, a row never taken none, and places past x's rows are
    zeros (their cotangents reach nothing)."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, ROWS + 2, PLACES).astype(np.int32)  # ROWS, ROWS + 1: past the end
    index[:3] = 2
    index[index == 4] = 5  # row 4 never taken
    inverse = jnp.asarray(_inverse(index, ROWS, PLACES))
    x = jax.random.normal(jax.random.key(seed), (ROWS, D))
    got = _vjp(lambda x: take_rows(x, jnp.asarray(index), inverse), x)
    want = _vjp(lambda x: jnp.take(x, jnp.asarray(index), axis=0, mode="fill", fill_value=0), x)
    _check(got, want, 1e-6)
    assert np.all(np.asarray(got[1][0][4]) == 0) and np.any(np.asarray(got[1][0][2]) != 0)


@pytest.mark.parametrize("weighed", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sum_rows_is_a_weighed_scatter_add_and_its_backward_the_gathers(weighed, dtype):
    """Rows of y added into their output rows, weighed in float32; some rows of y go nowhere (an index past
    rows x W), some places take nothing (past y's rows): value and the gradients of y and the weights equal
    autodiff's through the scatter-add."""
    rng = np.random.default_rng(3)
    width = 3
    index = rng.permutation(ROWS * width + 4)[:PLACES].astype(np.int32)  # past ROWS x width: nowhere
    inverse = np.full((ROWS, width), PLACES, np.int32)
    for i, place in enumerate(index):
        if place < ROWS * width:
            inverse[place // width, place % width] = i
    inverse[0, 0] = PLACES + 5  # far past y's rows: nothing
    index[index == 0] = ROWS * width + 9
    y = jax.random.normal(jax.random.key(1), (PLACES, D), dtype)
    weights = jax.random.uniform(jax.random.key(2), (ROWS, width))
    index_, inverse_ = jnp.asarray(index), jnp.asarray(inverse)

    def scattered(y, weights):
        weight = jnp.take(weights.reshape(-1), index_, mode="fill", fill_value=0) if weighed else 1.0
        added = y.astype(jnp.float32) * jnp.reshape(weight, (-1, 1))
        return jnp.zeros((ROWS, D), jnp.float32).at[index_ // width].add(added, mode="drop").astype(y.dtype)

    if weighed:
        got = _vjp(lambda y, w: sum_rows(y, inverse_, index_, w), y, weights)
        want = _vjp(scattered, y, weights)
    else:
        got = _vjp(lambda y: sum_rows(y, inverse_, index_), y)
        want = _vjp(lambda y: scattered(y, None), y)
    _check(got, want, 1e-6 if dtype == jnp.float32 else 1e-2)
