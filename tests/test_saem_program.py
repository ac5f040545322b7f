"""SAEM's front end (issue 30): the frozen program description, the declared E- and M-step
protocols, and failures as typed results decoded to named errors.

1. :class:`~numpyro_fed.saem.fit.SAEMProgram` is frozen (assigning raises
   ``FrozenInstanceError``), built afresh by every run (a second run gets a new one).
2. A user E-step and a user M-step written against
   :class:`~numpyro_fed.saem.protocols.EStep` / :class:`~numpyro_fed.saem.protocols.MStep`
   (outside the package) fit the conjugate normal-normal model to its exact MLE; an object
   missing a member is refused with a ``TypeError`` naming it.
3. Each :class:`~numpyro_fed.saem.fit.Failure` kind maps to a ``DivergenceError`` whose
   message names the cause and the parameter.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random
from numpyro.distributions import constraints

from numpyro_fed.errors import DivergenceError
from numpyro_fed.saem import SAEM, Schedule
from numpyro_fed.saem.fit import Failure, SAEMFailure, SAEMProgram, SAEMState, fit_saem
from numpyro_fed.saem.protocols import EStep, MStep, check_estep, check_mstep

pytestmark = [pytest.mark.xdist_group("saem_program"),
              # short schedules: the fits' own convergence warnings are not what is tested
              pytest.mark.filterwarnings("ignore::numpyro_fed.errors.ConvergenceWarning")]

N = 40


def hier(y=None):
    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", N):
        z = numpyro.sample("z", dist.Normal(mu, tau))
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)


Y = np.asarray(np.random.default_rng(3).normal(1.0, 2.0, N), np.float32)


def _mle(y):
    """MLE of y_i ~ N(mu, 1 + tau^2): mu = mean(y), tau^2 = max(var(y) - 1, 0)."""
    return float(np.mean(y)), float(np.sqrt(max(np.var(y) - 1.0, 0.0)))


# ----------------------------------------------------------------------------- user steps
class GibbsEStep(EStep):
    """Exact draws of z_i | y_i ~ N((y_i tau^2 + mu) / (tau^2 + 1), tau^2 / (tau^2 + 1)):
    a Gibbs E-step on the flat latents (theta_u = [mu, log tau], ModelInfo's order). The
    state is the latents themselves; ``move`` and ``step_size_summary`` are the protocol's
    defaults."""

    def init(self, key, z, theta_u, data, ids=None):
        return z

    def step(self, key, state, theta_u, data, num_steps, adapt, ids=None):
        y = data[1]["y"]
        mu, t2 = theta_u[0], jnp.exp(2.0 * theta_u[1])
        m, v = (y * t2 + mu) / (t2 + 1.0), t2 / (t2 + 1.0)
        z = m + jnp.sqrt(v) * random.normal(key, state.shape, state.dtype)
        return z, jnp.ones((), state.dtype), jnp.all(jnp.isfinite(z))

    def latents(self, state):
        return state


class MomentMStep:
    """Closed-form M-step of the normal-normal model, written structurally (no base
    class): SA statistics (mean z, mean z^2) over chains and subjects."""

    kind = "moments"
    needs_score = False
    transport = None

    def prepare(self, theta_u, z, data, M):
        return ()

    def _stats(self, z):
        return jnp.stack([jnp.mean(z), jnp.mean(z ** 2)])

    def init(self, theta_u, z, data, aux):
        return self._stats(z)

    def update(self, state, gamma, theta_u, z, data, aux, anneal, score_hess):
        s = state + gamma * (self._stats(z) - state)
        var = jnp.maximum(s[1] - s[0] ** 2, 1e-8)
        return jnp.stack([s[0], 0.5 * jnp.log(var)]).astype(theta_u.dtype), s

    def describe(self):
        return {}


def test_user_estep_and_mstep_written_against_the_protocols_fit_the_exact_mle():
    """Gibbs E-step + moment M-step, both outside the package: SAEM runs them and reaches
    the closed-form MLE. Monte Carlo error: 2 chains x 40 subjects x 200 averaging
    iterations of exact draws; the SA average of mean z has sd ~ sqrt(v / (80 * 200)) < 0.01,
    tolerance 0.05."""
    assert isinstance(GibbsEStep(), EStep) and isinstance(MomentMStep(), MStep)
    saem = SAEM(hier, kernel=GibbsEStep(), mstep=MomentMStep(), num_chains=2, num_draws=5,
                fisher=False, schedule=Schedule(num_iters=250, num_exploration=50))
    res = saem.run(random.key(0), y=Y)
    mu_hat, tau_hat = _mle(Y)
    assert res.mstep == "moments" and res.settings["interweave"] is False
    assert abs(res.params["mu"] - mu_hat) < 0.05
    assert abs(res.params["tau"] - tau_hat) < 0.05
    # the program is frozen and built again by the next run
    prog = saem.program
    assert isinstance(prog, SAEMProgram) and prog.estep is saem.kernel
    with pytest.raises(dataclasses.FrozenInstanceError):
        prog.num_chains = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        prog.mstep = None
    saem.run(random.key(1), y=Y)
    assert saem.program is not prog


class _NoUpdate:
    kind = "x"
    needs_score = False
    transport = None

    def prepare(self, *a):
        return ()

    def init(self, *a):
        return ()


class _NoLatents:
    def init(self, *a, **k):
        return None

    def step(self, *a, **k):
        return None


def test_a_step_missing_a_member_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"`mstep`: _NoUpdate is not an M-step: it lacks "
                                        r"`update`, `describe`"):
        SAEM(hier, mstep=_NoUpdate())
    with pytest.raises(TypeError, match=r"`kernel`: _NoLatents is not an E-step: it lacks "
                                        r"`latents`, `move`, `step_size_summary`"):
        SAEM(hier, kernel=_NoLatents())
    with pytest.raises(TypeError, match="kind must be a str"):
        check_mstep(type("K", (MomentMStep,), {"kind": 3})())
    with pytest.raises(TypeError, match="`estep`.*lacks `latents`"):
        fit_saem(_NoLatents(), MomentMStep())
    assert check_estep(GibbsEStep()) is not None
    with pytest.raises(ValueError, match="mstep='nope'"):
        SAEM(hier, mstep="nope")


# ----------------------------------------------------------------------------- failures
def _state(kind: Failure, at: int, theta):
    theta = jnp.asarray(theta, jnp.float32)
    return SAEMState(jnp.zeros((), jnp.int32), theta, None, None, random.key(0),
                     jnp.asarray(int(kind), jnp.int32), jnp.asarray(at, jnp.int32), theta)


def test_failure_codes_decode_to_named_failures():
    assert SAEMFailure.of(_state(Failure.NONE, 0, [0.0, 0.0])) is None
    f = SAEMFailure.of(_state(Failure.MSTEP, 7, [1.0, 2.0]))
    assert f.kind is Failure.MSTEP and f.iteration == 7
    np.testing.assert_array_equal(f.theta, [1.0, 2.0])
    assert {k.name for k in Failure} == {"NONE", "BURN_IN", "ESTEP", "MSTEP"}


@pytest.mark.parametrize("kind, pattern", [
    (Failure.BURN_IN, r"diverged during burn-in at theta_0=\{mu: 0\., tau: 1\.\}"),
    (Failure.ESTEP, r"E-step became non-finite at iteration 4 with theta=\{mu: 0\.5, "
                    r"tau: 2\.\}"),
    (Failure.MSTEP, r"M-step gave a non-finite theta at iteration 4, from theta=\{mu: 0\.5, "
                    r"tau: 2\.\}.*the moments M-step is not defined"),
], ids=["burn-in", "e-step", "m-step"])
def test_each_failure_kind_raises_its_divergence_error(kind, pattern):
    """The host-side decoding of each kind (no fit needed): the program of a short run, a
    failure at iteration 4 at theta = (0.5, 2), finite latents."""
    saem = SAEM(hier, kernel=GibbsEStep(), mstep=MomentMStep(), num_chains=2, num_draws=2,
                fisher=False, schedule=Schedule(num_iters=4, num_exploration=2))
    saem.run(random.key(0), y=Y)
    prog = saem.program
    theta = prog.info.unconstrain_theta({"mu": jnp.asarray(0.5), "tau": jnp.asarray(2.0)})
    theta0 = prog.info.theta0_u_flat
    fail = SAEMFailure(kind, 0 if kind is Failure.BURN_IN else 4, np.asarray(theta))
    z = jnp.zeros((2, N), jnp.float32)
    err = saem._divergence_error(prog, fail, z, theta0, (), {"y": Y}, np.zeros((0, 2)))
    assert isinstance(err, DivergenceError)
    assert re.search(pattern, str(err)), str(err)
    if kind is not Failure.MSTEP:
        assert "check your E-step GibbsEStep" in str(err)


def test_mstep_failure_in_the_loop_names_the_mstep():
    """An M-step that returns NaN from finite latents stops the compiled loop with
    Failure.MSTEP: the error blames the M-step, at iteration 0."""

    class NaNMStep(MomentMStep):
        kind = "nan"

        def update(self, state, gamma, theta_u, z, data, aux, anneal, score_hess):
            return theta_u * jnp.nan, state

    saem = SAEM(hier, kernel=GibbsEStep(), mstep=NaNMStep(), num_chains=2, num_draws=2,
                fisher=False, schedule=Schedule(num_iters=4, num_exploration=2))
    with pytest.raises(DivergenceError, match=r"M-step gave a non-finite theta at iteration "
                                              r"0.*the nan M-step"):
        saem.run(random.key(0), y=Y)


@pytest.mark.parametrize("zidx", [np.arange(6).reshape(3, 2),  # rows: subject-major
                                  np.arange(6).reshape(2, 3).T,  # columns: site-major
                                  np.array([[0, 1], [2, -1], [3, 4]])])  # unequal groups
def test_block_jet_is_the_value_gradient_and_block_hessian(zidx):
    """``block_jet`` (the E-step's mode tracker: one program site for the value, gradient and
    curvature) gives the function's value and gradient and the diagonal blocks of its dense
    Hessian (padded entries: curvature 1), as ``block_hessian`` does."""
    from numpyro_fed.saem.model import SubjectLayout, block_hessian, block_jet, to_blocks

    lay = SubjectLayout(plate="s", n=zidx.shape[0], q=zidx.shape[1], zidx=zidx, site_ids=())
    d = int(zidx.max()) + 1
    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.normal(size=(d,)))
    blocks = [jnp.asarray(r[r >= 0]) for r in zidx]

    def f(z):  # separable over subjects: each block's log-sum-exp plus a cubic
        return sum(jax.nn.logsumexp(z[b] * A[b]) + jnp.sum(z[b] ** 3) / 6 for b in blocks)

    def value_grad(z):
        return f(z), jax.grad(f)(z)

    z = jnp.asarray(rng.normal(size=(d,)))
    v, g, H = block_jet(value_grad, z, lay)
    np.testing.assert_allclose(v, f(z), rtol=1e-6)
    np.testing.assert_allclose(g, jax.grad(f)(z), rtol=1e-5, atol=1e-6)
    dense = jax.hessian(f)(z)
    for i, r in enumerate(zidx):
        for a, ia in enumerate(r):
            for b, ib in enumerate(r):
                want = (dense[ia, ib] if ia >= 0 and ib >= 0 else float(a == b))
                np.testing.assert_allclose(H[i, a, b], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(block_hessian(jax.grad(f), z, lay), H, rtol=1e-6, atol=1e-7)
    assert to_blocks(g, zidx).shape == zidx.shape
