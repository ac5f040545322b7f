"""The NONMEM layer's seams (issue 30): :class:`~numpyro_fed.nlme.NLMEFit` reads its
:class:`~numpyro_fed.saem.SAEMResult` through the result's public API only."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from numpyro_fed import nlme
from numpyro_fed.errors import ConvergenceWarning
from numpyro_fed.saem import Schedule
from numpyro_fed.saem import likelihood as lik

pytestmark = pytest.mark.xdist_group("nlme")

#: what SAEMResult holds for its own computations (the fitted program's description, the
#: subject layout and the data it was run on, the raw unconstrained draws): not its API
INTERNALS = {"info", "layout", "ids", "args", "kwargs", "z_draws", "model", "theta0_c"}


class _PublicOnly:
    """An SAEMResult seen through its public API: reading an internal raises."""

    def __init__(self, result) -> None:
        object.__setattr__(self, "_result", result)

    def __getattr__(self, name):
        if name.startswith("_") or name in INTERNALS:
            raise AttributeError(f"NLMEFit read SAEMResult.{name}, an internal of the result")
        return getattr(object.__getattribute__(self, "_result"), name)


@pytest.fixture(scope="module")
def small_fit():
    """Six Theophylline subjects, a short SAEM run (the API is tested, not the estimates)."""
    data = nlme.load_theophylline().subjects(list(range(6)))
    pk = nlme.PKModel(nlme.one_compartment("first_order"),
                      params={"KA": 1.5, "V": 30.0, "CL": 3.0})
    with warnings.catch_warnings():  # a 6-iteration run is refused as converged: expected
        warnings.simplefilter("ignore", ConvergenceWarning)
        return pk.fit(data, jax.random.key(0),
                      schedule=Schedule(num_iters=6, num_exploration=3), num_chains=1)


def test_nlme_fit_uses_only_the_public_result_api(small_fit):
    fit = small_fit
    seen = nlme.NLMEFit(fit.pk, fit.data, _PublicOnly(fit.result))
    pd.testing.assert_frame_equal(seen.parameter_table(standard_errors=False),
                                  fit.parameter_table(standard_errors=False))
    for kind in ("mode", "mean", "typical"):
        got, want = seen.individual_parameters(kind), fit.individual_parameters(kind)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{kind} {k}")
    pd.testing.assert_frame_equal(seen.individual_estimates(), fit.individual_estimates())
    assert seen.shrinkage() == fit.shrinkage()
    pd.testing.assert_frame_equal(seen.predictions(), fit.predictions())
    np.testing.assert_array_equal(seen.cwres(), fit.cwres())


def test_result_conditional_modes_are_the_newton_modes_from_the_mean_draw(small_fit):
    """:meth:`SAEMResult.conditional_modes` is the damped Newton of
    :func:`~numpyro_fed.saem.likelihood.conditional_modes` from the mean of the final draws
    (what NLMEFit computed itself before), constrained, one value per subject."""
    res = small_fit.result
    modes = res.conditional_modes()
    zs = jnp.asarray(res.z_draws)
    z0 = jnp.mean(zs.reshape(-1, zs.shape[-1]), 0)
    tc = res.info.constrain_theta(jnp.asarray(res.theta))
    z = jax.jit(lambda tc, z: lik.conditional_modes(
        res.info, res.layout, res.ids, tc, z, res.args, res.kwargs)[0])(tc, z0)
    want = res.info.constrain_z(z)[0]
    assert set(modes) == set(want) == set(res.latent_samples())
    for k, v in want.items():
        np.testing.assert_array_equal(modes[k], np.asarray(v), err_msg=k)
        assert modes[k].shape[0] == 6
    cm = small_fit.conditional_modes()
    for n in small_fit.pk.random_names:
        np.testing.assert_array_equal(cm[n], modes[f"phi_{n}"])
