"""A diverging chain stops ``MCMC.run`` with :class:`numpyro_fed.DivergenceError` itself.

Every kernel carries a :class:`~numpyro_fed.kernels.base.DivergenceGuard` in its state; the
error is raised on the host when the state leaves compiled code (no host callback, so no
``JaxRuntimeError`` wrapper and no second traceback on stderr): at the diverging step with
``progress_bar=True``, at the end of the compiled loop with ``progress_bar=False``.

That every public kernel raises it through ``MCMC(..., chain_method="vectorized")``, naming
the kernel, chain, iteration and step size, is a check of the kernel contract
(``tests/test_kernel_contract.py``); here: the mechanism (the progress bar, the exception
type, the opt-out, reuse of a finite state, the guard under ``jit``/``scan``/``vmap``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import lax, random
from numpyro.infer import MCMC

from numpyro_fed import (
    ELF,
    MALA,
    QLSD,
    ULA,
    ClientPartition,
    DivergenceError,
    FederatedLangevin,
    compressors,
)
from numpyro_fed.kernels.base import DivergenceGuard


def gauss_model(y):
    theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([y.shape[-1]]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(theta, 1.0).to_event(1), obs=y)


def _clients():
    rng = np.random.default_rng(0)
    return [{"y": (rng.normal(size=(n, 2)) + k).astype(np.float32)}
            for k, n in enumerate((10, 25, 40, 60))]


PART = ClientPartition.from_clients(_clients())
POOLED = {"y": np.concatenate([c["y"] for c in _clients()])}
STEP = 0.5  # the Gaussian potential has curvature N + 1 = 136: gamma = 0.5 diverges


def _improper(z):
    """U = x^2/2 for x <= 3 and -inf beyond: a MALA proposal that lands there is always
    accepted (log ratio +inf, finite gradients), so the chain's energy becomes -inf."""
    x = z["x"]
    return jnp.sum(jnp.where(x > 3.0, -jnp.inf, 0.5 * x**2))


def make(name, step=STEP):
    """(kernel, run kwargs, init_params) of the kernels these tests use."""
    top1 = compressors.top_k(1)
    fed = dict(step_size=step)
    kernels = {
        "ULA": lambda: ULA(gauss_model, step_size=step),
        "FederatedLangevin": lambda: FederatedLangevin(gauss_model, PART, batch_size=5, **fed),
        "QLSD++": lambda: QLSD(gauss_model, PART, variant="++", bits=4, batch_size=5, **fed),
        "B-ELF": lambda: ELF(gauss_model, PART, variant="B", uplink=top1, downlink=top1, **fed),
    }
    if name == "MALA":
        kern = MALA(potential_fn=_improper, step_size=10.0 if step == STEP else step,
                    adapt_step_size=False)
        return kern, {}, {"x": jnp.zeros((2, 1))}
    kern = kernels[name]()
    return kern, (POOLED if name == "ULA" else {}), None


def _run(name, progress_bar, num_chains=2, num_samples=300):
    kern, kw, init = make(name)
    if init is not None and num_chains == 1:
        init = {k: v[0] for k, v in init.items()}
    mcmc = MCMC(kern, num_warmup=0, num_samples=num_samples, num_chains=num_chains,
                chain_method="vectorized", progress_bar=progress_bar)
    mcmc.run(random.key(0), init_params=init, **kw)
    return mcmc


@pytest.mark.parametrize("name", ["ULA", "MALA", "QLSD++", "B-ELF"])
def test_divergence_error_with_progress_bar_stops_at_the_step(name, capfd):
    """With the progress bar NumPyro runs one compiled step per iteration: the error comes
    at the diverging step, and names the same iteration as without the bar."""
    pattern = rf"{re.escape(name)} chain became non-finite"
    with pytest.raises(DivergenceError, match=pattern) as with_bar:
        _run(name, progress_bar=True, num_chains=1)
    err = capfd.readouterr().err
    assert "io_callback" not in err and "Traceback" not in err
    with pytest.raises(DivergenceError) as without:
        _run(name, progress_bar=False, num_chains=1)
    assert with_bar.value.iteration == without.value.iteration
    assert with_bar.value.chain is None
    assert f"iteration {with_bar.value.iteration} " in str(with_bar.value)


def test_divergence_error_is_not_wrapped():
    """The exception is the DivergenceError itself (a FloatingPointError), not a JAX runtime
    error whose text contains it."""
    with pytest.raises(DivergenceError) as err:
        _run("FederatedLangevin", progress_bar=False, num_chains=1)
    assert type(err.value) is DivergenceError
    assert isinstance(err.value, FloatingPointError)
    assert str(err.value).startswith("numpyro_fed: FederatedLangevin chain became non-finite")


def test_check_finite_false_opts_out():
    kern = FederatedLangevin(gauss_model, PART, step_size=STEP, check_finite=False)
    mcmc = MCMC(kern, num_warmup=0, num_samples=100, progress_bar=False)
    mcmc.run(random.key(0))
    assert not np.all(np.isfinite(mcmc.get_samples()["theta"]))


def test_finite_run_then_reuse_of_last_state():
    """A run that stays finite carries a clean guard: ``last_state`` can be reused."""
    kern = QLSD(gauss_model, PART, variant="++", bits=4, batch_size=5, step_size=1e-3)
    mcmc = MCMC(kern, num_warmup=20, num_samples=30, num_chains=2,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(random.key(1))
    assert np.all(np.asarray(mcmc.last_state.guard.first_bad) == -1)
    mcmc.post_warmup_state = mcmc.last_state
    mcmc.run(mcmc.post_warmup_state.rng_key)
    assert np.all(np.isfinite(mcmc.get_samples()["theta"]))


def test_guard_through_jit_scan_and_vmap():
    """The guard works outside MCMC: ``jit`` + ``lax.scan`` over ``kernel.sample`` raises
    when the final state comes back to the host, with the first non-finite iteration."""
    kern, _, _ = make("FederatedLangevin")
    state = kern.init(random.key(0), 0, None, (), {})

    @jax.jit
    def run(s):
        return lax.scan(lambda c, _: (kern.sample(c, (), {}), None), s, None, length=200)[0]

    with pytest.raises(DivergenceError, match="iteration") as err:
        run(state)
    mcmc_err = pytest.raises(DivergenceError, _run, "FederatedLangevin", False, 1)
    assert err.value.iteration == mcmc_err.value.iteration
    # unflattening with tracers, axis specs, shape structs or None never raises
    bad = DivergenceGuard(jnp.int32(3), "{iteration}")
    leaves, tree = jax.tree.flatten(bad)
    with pytest.raises(DivergenceError, match="^3$"):
        jax.tree.unflatten(tree, leaves)
    for leaf in (None, 0, jax.ShapeDtypeStruct((), jnp.int32), object()):
        jax.tree.unflatten(tree, [leaf])
    out = jax.eval_shape(lambda g: g, bad)
    assert isinstance(out, DivergenceGuard)


def test_guard_vmapped_output_names_the_chain():
    guard = DivergenceGuard(jnp.full((3,), -1, jnp.int32), "chain{chain} at {iteration}")
    xs = jnp.asarray([[0.0], [jnp.nan], [1.0]])
    with pytest.raises(DivergenceError, match=r"^chain 1 at 5\b") as err:
        jax.vmap(lambda g, x: g.update(x, 5))(guard, xs)
    assert err.value.chain == 1 and err.value.iteration == 5
    ok = jax.vmap(lambda g, x: g.update(x, 5))(guard, jnp.zeros((3, 1)))
    np.testing.assert_array_equal(ok.first_bad, [-1, -1, -1])
    # the first non-finite iteration is kept
    g = DivergenceGuard.create("{iteration}")
    g = jax.jit(lambda g: g.update(jnp.ones(2), 1))(g)
    with pytest.raises(DivergenceError, match=r"^2\b"):
        jax.jit(lambda g: g.update(jnp.asarray([jnp.inf, 0.0]), 2).update(jnp.nan, 3))(g)
