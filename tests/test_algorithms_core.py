"""The functional core (``numpyro_fed.algorithms``): one client's half equals its row of the
stacked half, and the server halves keep the algorithms' invariants.

The in-process kernels call the client halves on all clients at once
(:class:`~numpyro_fed.algorithms.estimators.StackedClients`), a deployed client on its own rows
(:class:`~numpyro_fed.algorithms.oracles.ClientProblem`); these tests check that the two give
the same message for every estimator, and the invariants the kernels and the Flower server rely
on (:math:`\\eta = \\sum_i\\eta_i`, :math:`g = \\sum_i g^i`, ratio weights).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from numpyro_fed import ClientPartition
from numpyro_fed.algorithms import elf, estimators, qlsd, theta_star
from numpyro_fed.algorithms.oracles import ClientProblem
from numpyro_fed.examples import logistic_regression
from numpyro_fed.potential import FederatedPotential

B, N, D = 3, 40, 4


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D)).astype(np.float32)
    y = (rng.uniform(size=N) < 0.5).astype(np.float32)
    part = ClientPartition.iid({"X": X, "y": y}, num_clients=B, key=random.key(0))
    pot = FederatedPotential(logistic_regression, part)
    rows = [{k: np.asarray(v[i, : part.sizes_np[i]]) for k, v in part.data.items()}
            for i in range(B)]
    problems = [ClientProblem(logistic_regression, rows[i], prior_weight=1.0 / B,
                              max_size=int(part.max_size), index=i) for i in range(B)]
    return pot, part, problems


def _estimators(pot, part, x):
    theta_star = 0.3 * jnp.ones(D)
    grads_star = pot.full_grads(theta_star, part)
    return {
        "plain-full": (estimators.plain(None), None),
        "plain-batch": (estimators.plain(5), None),
        "cv-full": (estimators.fixed_control_variate(theta_star, grads_star,
                                                     grads_star.sum(0), None), grads_star),
        "cv-batch": (estimators.fixed_control_variate(theta_star, grads_star,
                                                      grads_star.sum(0), 5), grads_star),
        "svrg": (estimators.svrg(5, 3), None),
    }


@pytest.mark.parametrize("name", ["plain-full", "plain-batch", "cv-full", "cv-batch", "svrg"])
def test_client_half_equals_its_row_of_the_stacked_half(clients, name):
    pot, part, problems = clients
    x = jnp.linspace(-0.5, 0.5, D)
    zeta = x + 0.1
    est, grads_star = _estimators(pot, part, x)[name]
    stacked = estimators.StackedClients(pot, part)
    state = est.init(stacked, zeta)
    state = est.refresh(stacked, zeta, state)
    key = random.key(7)
    h_all = est.estimate(stacked, key, x, state)
    assert h_all.shape == (B, D)
    for i, prob in enumerate(problems):
        est_i = est
        if grads_star is not None:  # a client holds only its own grad U_i(theta*)
            est_i = est._replace(estimate=estimators.fixed_control_variate(
                0.3 * jnp.ones(D), grads_star[i], 0.0, 5 if "batch" in name else None).estimate)
        state_i = est_i.init(prob, zeta)
        state_i = est_i.refresh(prob, zeta, state_i)
        h_i = est_i.estimate(prob, key, x, state_i)
        # float32: the client sums its N_i rows, the stack masked padded rows (~1e-6 relative)
        np.testing.assert_allclose(h_i, h_all[i], rtol=1e-5, atol=1e-5)


def test_svrg_refresh_schedule_and_cancellation(clients):
    pot, part, _ = clients
    stacked = estimators.StackedClients(pot, part)
    est = estimators.svrg(5, 3)
    x = jnp.linspace(-0.5, 0.5, D)
    state = est.init(stacked, x)
    refreshed = est.step_state(stacked, jnp.int32(3), x, state)  # 3 % 3 == 0: refresh
    kept = est.step_state(stacked, jnp.int32(4), x, refreshed)
    assert int(refreshed.refreshes) == 1 and int(kept.refreshes) == 1
    # at the control point the minibatch differences vanish: H_i = grad U_i(zeta) exactly
    np.testing.assert_allclose(est.estimate(stacked, random.key(1), x, refreshed),
                               pot.full_grads(x, part), rtol=1e-6, atol=1e-6)


def test_qlsd_memory_invariant_under_partial_participation():
    """eta = sum_i eta_i after rounds where only the masked clients' messages apply, and the
    ratio weights b/|S| reweight the received messages."""
    rng = np.random.default_rng(1)
    alpha, b, d = 0.3, 4, 3
    eta_i = jnp.zeros((b, d))
    eta = jnp.zeros(d)
    for _k in range(5):
        h = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
        mask = jnp.asarray(rng.uniform(size=b) < 0.6)
        msg = qlsd.client_message(h, eta_i, alpha)
        decoded = jnp.where(mask[:, None], msg, 0.0)
        g, eta_new = qlsd.server_aggregate(decoded, eta, alpha, mask)
        count = max(int(mask.sum()), 1)
        np.testing.assert_allclose(g, eta + (b / count) * decoded.sum(0), rtol=1e-6, atol=1e-6)
        eta_i = qlsd.client_commit(eta_i, decoded, alpha)
        eta = eta_new
        np.testing.assert_allclose(eta, eta_i.sum(0), rtol=1e-5, atol=1e-6)
    # without memory the state is untouched and g is the plain sum
    g, e = qlsd.server_aggregate(h, jnp.zeros((0,)), 0.0)
    np.testing.assert_allclose(g, h.sum(0), rtol=1e-6)
    assert e.shape == (0,)


@pytest.mark.parametrize("error_feedback", [True, False])
def test_elf_estimator_invariant_under_partial_participation(error_feedback):
    """g = sum_i g^i: EF21 adds only the applied corrections; P-ELF replaces the senders'
    rows of its table."""
    rng = np.random.default_rng(2)
    b, d = 4, 3
    g_local = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
    g = g_local.sum(0)
    for _k in range(5):
        h = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
        mask = jnp.asarray(rng.uniform(size=b) < 0.6)
        msg = elf.client_message(h, g_local, error_feedback)
        decoded = jnp.where(mask[:, None], msg, 0.0)
        g, table = elf.server_aggregate(g, decoded, error_feedback, g_local, mask)
        if error_feedback:
            g_local = elf.client_commit(g_local, decoded, True)
        else:
            g_local = table
            np.testing.assert_array_equal(table, jnp.where(mask[:, None], h, table))
        np.testing.assert_allclose(g, g_local.sum(0), rtol=1e-5, atol=1e-5)
    w = jnp.zeros(d)
    assert np.array_equal(elf.shadow_update(w, elf.downlink_message(h[0], w)), h[0])


@pytest.mark.parametrize("method", theta_star.METHODS)
def test_theta_star_search_finds_a_quadratic_minimiser(method):
    """The (init, update) pair on U(x) = |A x - c|^2 / 2 stops at the minimiser within its
    tolerance (BB: exact in a few dozen steps; Adam: slower, a loose tolerance)."""
    A = jnp.asarray([[2.0, 0.3], [0.3, 1.0]])
    c = jnp.asarray([1.0, -2.0])
    grad = jax.jit(lambda x: A.T @ (A @ x - c))
    st = theta_star.init(jnp.zeros(2), grad(jnp.zeros(2)))
    gtol = 1e-4 if method == "bb" else 1e-2
    tol = theta_star.tolerance(gtol, jnp.linalg.norm(st.g))
    lr = 5e-2
    while bool(theta_star.keep_going(st, tol, 5000)):
        st = theta_star.update(method, st, lr)
        st = st._replace(g=grad(st.x))
    x_star = jnp.linalg.solve(A, c)
    assert theta_star.converged(float(jnp.linalg.norm(st.g)), float(jnp.linalg.norm(grad(
        jnp.zeros(2)))), gtol)
    np.testing.assert_allclose(st.x, x_star, atol=50 * gtol)
    with pytest.raises(ValueError, match="method"):
        theta_star.update("newton", st)
