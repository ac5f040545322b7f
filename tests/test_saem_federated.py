"""MCMC-SAEM with a federated kernel in the E-step (data partitioned across clients)."""

import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import random
from numpyro.distributions import constraints
from scipy.optimize import minimize_scalar

from numpyro_fed import ClientPartition, FederatedLangevin
from numpyro_fed.saem import SAEM, Schedule


def eb_model(X, y=None):
    """Empirical Bayes: the prior scale tau of the regression weights is a hyperparameter."""
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    beta = numpyro.sample("beta", dist.Normal(0.0, tau).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ beta, 1.0), obs=y)


def exact_tau(X, y):
    """Maximum of the exact marginal likelihood y ~ N(0, tau^2 X X^T + I) (Woodbury)."""
    XtX, Xty, yty = X.T @ X, X.T @ y, y @ y
    d = X.shape[1]

    def nll(log_tau):
        t2 = np.exp(2 * log_tau)
        A = np.eye(d) + t2 * XtX
        quad = yty - t2 * Xty @ np.linalg.solve(A, Xty)
        return 0.5 * (np.linalg.slogdet(A)[1] + quad)

    return float(np.exp(minimize_scalar(nll, bounds=(-5, 3), method="bounded").x))


def test_saem_with_federated_langevin_e_step():
    rng = np.random.default_rng(0)
    n, d = 240, 12
    X = rng.normal(size=(n, d)).astype(np.float32)
    beta = rng.normal(0.0, 0.6, d)
    y = (X @ beta + rng.normal(size=n)).astype(np.float32)
    tau_hat = exact_tau(X.astype(np.float64), y.astype(np.float64))

    clients = ClientPartition.iid({"X": X, "y": y}, 6, key=random.PRNGKey(0))
    # step * L = 1e-3 * ~260 = 0.26: stable, with an O(step) ULA bias on beta's posterior
    # variance of ~13% of 1/260, i.e. negligible against tau^2 ~ 0.4 in the M-step statistic
    kernel = FederatedLangevin(eb_model, clients, step_size=1e-3, prior="server")
    # burn-in: 50 E-steps of 4 kernel steps = 200 steps at theta_0
    saem = SAEM(eb_model, kernel=kernel, num_chains=2,
                schedule=Schedule(num_iters=400, num_exploration=100, decay=1.0,
                                  num_burnin=50))
    result = saem.run(random.PRNGKey(1), X=X, y=y)
    tau = float(result.params["tau"])
    # SA-averaged estimate over ~300 decreasing-step iterations of 2 chains x 12 coordinates:
    # Monte Carlo sd of tau is ~ tau / sqrt(2 * 2 * 12 * 75) ~ 1.5%; allow 6%.
    assert abs(tau - tau_hat) / tau_hat < 0.06, (tau, tau_hat)
    assert result.mstep in ("gaussian", "newton")


def test_elf_refresh_rebuilds_error_feedback_for_a_new_target():
    """After `refresh` with new hyperparameters, D-ELF's g_i equal the new local gradients at
    w (g = sum g_i) and one dense uplink round is counted."""
    import jax
    import jax.numpy as jnp

    from numpyro_fed import DELF, compressors, counter_value

    rng = np.random.default_rng(1)
    X = rng.normal(size=(60, 3)).astype(np.float32)
    y = (X @ np.array([0.5, -0.5, 1.0]) + rng.normal(size=60)).astype(np.float32)
    clients = ClientPartition.iid({"X": X, "y": y}, 3, key=random.PRNGKey(0))

    def wrapper(m):
        def conditioned(*a, _saem_theta=None, **kw):
            with numpyro.handlers.substitute(data=_saem_theta or {}):
                return m(*a, **kw)

        return conditioned

    kernel = DELF(eb_model, clients, step_size=1e-3, uplink=compressors.top_k(1)).wrap_model(
        wrapper)
    kw_old = {"_saem_theta": {"tau": jnp.asarray(1.0)}}
    kw_new = {"_saem_theta": {"tau": jnp.asarray(0.1)}}
    state = kernel.init(random.PRNGKey(0), 0, None, (), kw_old)
    for _ in range(5):
        state = kernel.sample(state, (), kw_old)
    up_before = counter_value(state.total_up)
    state = kernel.refresh(state, (), kw_new)
    new_grads = jax.jit(kernel.potential.with_kwargs(kw_new).full_grads)(state.extra.w, clients)
    np.testing.assert_allclose(state.extra.g_local, new_grads, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.extra.g, new_grads.sum(0), rtol=1e-5, atol=1e-4)
    assert counter_value(state.total_up) - up_before == 3 * 32 * 3
