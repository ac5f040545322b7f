"""Batched LAPACK calls of a compiled program run one after another on the CPU
(:mod:`numpyro_fed._serial_lapack`): the values are those of the program as written, bit for
bit, and a program that hangs jaxlib 0.10's XLA:CPU as written returns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from numpyro_fed import _programs, _serial_lapack


def _spd(k, B, n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(k, B, n, n)).astype(np.float32)
    return jnp.asarray(X @ np.swapaxes(X, -1, -2) + n * np.eye(n, dtype=np.float32))


def _chains(A):
    """Independent Cholesky + triangular solve chains, one per leading index of A."""
    return [jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(a), a[..., :1], lower=True)
            for a in A]


def test_counts_batched_calls_through_nested_programs():
    A = _spd(2, 4, 3)
    assert _serial_lapack.count_batched_calls(jax.make_jaxpr(_chains)(A)) == 4
    # one matrix (no batch): no parallel batch map, nothing to order
    assert _serial_lapack.count_batched_calls(jax.make_jaxpr(_chains)(A[:, 0])) == 0

    def looped(A):  # a scan and a conditional holding calls count as the calls they hold
        out = lax.scan(lambda c, a: (c, _chains(a[None])[0]), 0.0, A[None, 0])[1]
        return lax.cond(A[0, 0, 0, 0] > 0, lambda: _chains(A[1:]), lambda: [A[1, ..., :1]]), out

    assert _serial_lapack.count_batched_calls(jax.make_jaxpr(looped)(A)) == 4


def test_programs_with_fewer_than_two_calls_are_left_alone():
    A = _spd(1, 4, 3)
    assert _serial_lapack.serialise(jax.jit(_chains).trace(A[:, :, :2, :2][:, :1])) is None
    assert _serial_lapack.serialise(jax.jit(lambda a: jnp.linalg.cholesky(a[0])).trace(A)) \
        is None
    assert _serial_lapack.serialise(jax.jit(_chains).trace(A)) is not None  # chol + solve


def test_tie_keeps_every_value_bit_for_bit():
    """x - 0 * |t| is x for signed zeros, infinities, NaNs, whatever t is."""
    x = jnp.asarray([-0.0, 0.0, np.inf, -np.inf, np.nan, 1.5, -2.25e-38], jnp.float32)
    for t in (np.nan, -np.inf, -3.0, -0.0, 7.0):
        (y,) = jax.jit(lambda x, t: _serial_lapack._tie([x], [t]))(x, jnp.asarray([t]))
        y = np.asarray(y)
        np.testing.assert_array_equal(np.signbit(y), np.signbit(np.asarray(x)))
        np.testing.assert_array_equal(y, np.asarray(x))  # NaN == NaN for this assertion
    z = jnp.asarray([-0.0 + 1j, np.nan - 0.0j], jnp.complex64)
    (w,) = _serial_lapack._tie([z], [jnp.asarray([np.inf])])
    np.testing.assert_array_equal(np.signbit(np.asarray(w).real), np.signbit(np.asarray(z).real))
    np.testing.assert_array_equal(np.signbit(np.asarray(w).imag), np.signbit(np.asarray(z).imag))


@pytest.mark.parametrize("nested", [False, True])
def test_serialised_program_gives_the_same_bits(nested, caplog):
    A = _spd(3, 8, 12, seed=1)

    def f(A):
        if nested:  # the chains inside a scan body and a conditional
            body = lax.scan(lambda c, a: (c, _chains(a)), 0.0, A[None])[1]
            return lax.cond(A[0, 0, 0, 0] > 0, lambda: body, lambda: [b * 0 for b in body])
        # jnp.linalg.solve: LU inside custom_linear_solve, whose jaxprs are a NamedTuple
        return _chains(A) + [jnp.linalg.slogdet(A)[1], jnp.linalg.eigh(A[0])[0],
                             jnp.linalg.solve(A[1], A[2, ..., :2])]

    with caplog.at_level("DEBUG", logger="numpyro_fed._serial_lapack"):
        got = _programs.Program(f)(A)
    assert not [r for r in caplog.records if "unordered" in r.getMessage()]
    want = jax.jit(f)(A)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # the rewrite is applied (on the CPU) and it orders the calls
    if jax.default_backend() == "cpu":
        tr = jax.jit(f).trace(A)
        assert _serial_lapack.serialise(tr) is not None


def test_gradients_through_serialised_programs():
    A = _spd(2, 4, 6, seed=2)

    def loss(A):
        return sum(jnp.sum(c ** 2) for c in _chains(A))

    g = _programs.Program(jax.grad(loss))(A)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.jit(jax.grad(loss))(A)),
                               rtol=0, atol=0)


_HANG = """
import sys
import jax, jax.numpy as jnp, numpy as np
from numpyro_fed._programs import Program
k = {k}
rng = np.random.default_rng(0)
X = rng.normal(size=(k, 16, 200, 200)).astype(np.float32)
A = jnp.asarray(X @ np.swapaxes(X, -1, -2) + 200 * np.eye(200, dtype=np.float32))
def f(A):
    return [jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(A[i]), A[i, :, :, :1],
                                              lower=True) for i in range(k)]
p = Program(f)
for _ in range(10):
    jax.block_until_ready(p(A))
print("returned")
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU defect")
def test_concurrent_batched_cholesky_does_not_hang():
    """As many independent batched Cholesky + solve chains as XLA's CPU pool has workers:
    compiled as written, jaxlib 0.10.2 hangs on every run of this program on a 2-core
    machine (measured: 16 x 200 x 200, 2 chains); through the library's programs it returns.
    A subprocess with a time limit, so that a regression fails instead of hanging the
    suite."""
    try:
        workers = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        workers = os.cpu_count() or 2
    k = int(min(max(2, workers), 16))
    try:
        res = subprocess.run([sys.executable, "-c", textwrap.dedent(_HANG.format(k=k))],
                             capture_output=True, text=True, timeout=240, check=False,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{k} concurrent batched Cholesky chains hung XLA:CPU (no return in "
                    "240 s): the batched LAPACK calls were not ordered")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "returned" in res.stdout
