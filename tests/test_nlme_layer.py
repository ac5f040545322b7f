"""The NONMEM layer's seams (issue 30): :class:`~numpyro_fed.nlme.NLMEFit` reads its
:class:`~numpyro_fed.saem.SAEMResult` through the result's public API only."""

import ast
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from numpyro_fed import nlme
from numpyro_fed.saem import ConvergenceWarning, Schedule
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
        # the result computes its modes once, in the program it shares with the likelihood
        # and the standard errors (compiled with other XLA options than this jax.jit): the
        # same float32 Newton iterations, stopped where the objective's improvement is below
        # its rounding, so not bit for bit: a maximiser is fixed only to where
        # f'' d^2 / 2 < eps |f|, d / x ~ sqrt(2 eps) = 4.9e-4 relative in float32 (measured:
        # 2e-5 to 2.2e-4 as the programs' fusion changed)
        np.testing.assert_allclose(modes[k], np.asarray(v), rtol=5e-4, atol=1e-6,
                                   err_msg=k)
        assert modes[k].shape[0] == 6
    # and they are exactly the modes the likelihood and the standard errors use
    shared = res.info.constrain_z(res._modes()[0])[0]
    for k, v in shared.items():
        np.testing.assert_array_equal(modes[k], np.asarray(v), err_msg=k)
    cm = small_fit.conditional_modes()
    for n in small_fit.pk.random_names:
        np.testing.assert_array_equal(cm[n], modes[f"phi_{n}"])


# ----------------------------------------------------------------------------- the pipeline
def _pipeline_steps():
    """The module-level functions that ``PKDataset.from_dataframe`` calls, in call order."""
    from numpyro_fed.nlme import data as D

    tree = ast.parse(inspect.getsource(D))
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PKDataset")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef)
                  and n.name == "from_dataframe")
    called = [n.func.id for n in ast.walk(method) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id in funcs]
    return method, [funcs[c] for c in dict.fromkeys(called)]


def test_from_dataframe_is_a_pipeline_of_small_documented_checks():
    """``from_dataframe`` only chains named steps (its body, docstring aside, is short), and
    each step is a small function with a docstring saying what it checks or builds."""
    method, steps = _pipeline_steps()
    body = method.body[1:]  # after the docstring
    assert body[-1].end_lineno - body[0].lineno + 1 <= 60
    names = [s.name for s in steps]
    assert len([n for n in names if n.startswith("_check_")]) >= 8, names
    for step in steps:
        doc = step.body[0]
        assert isinstance(doc, ast.Expr) and isinstance(doc.value.value, str), (
            f"{step.name} has no docstring")
        assert step.end_lineno - step.lineno + 1 <= 80, f"{step.name} is not small"


def _faulty(**faults) -> pd.DataFrame:
    """Two subjects (a dose at 0, three samples), with ``faults`` = {column: {row: value}}."""
    rows = []
    for sid in (1, 2):
        rows.append({"ID": sid, "TIME": 0.0, "DV": np.nan, "AMT": 100.0, "EVID": 1,
                     "MDV": 1, "CMT": 1, "WT": 70.0})
        rows += [{"ID": sid, "TIME": t, "DV": 5.0 / t, "AMT": 0.0, "EVID": 0, "MDV": 0,
                  "CMT": 2, "WT": 70.0} for t in (1.0, 2.0, 4.0)]
    df = pd.DataFrame(rows)
    for col, at in faults.items():
        if any(isinstance(v, str) for v in at.values()):
            df[col] = df[col].astype(object)
        for row, v in at.items():
            df.loc[row, col] = v
    return df


@pytest.mark.parametrize("faults, match", [
    # a table with two faults reports the one of the earlier check
    ({"TIME": {2: -1.0}, "EVID": {3: 7}}, "is negative"),
    ({"EVID": {3: 7}, "CMT": {1: -2}}, "unknown code 7"),
    ({"TIME": {3: 1.5}, "CMT": {0: 0}}, "decreases within subject 1"),
    ({"CMT": {0: 0}, "AMT": {0: -5.0}}, r"\(cmt=\) must be a positive integer"),
    ({"AMT": {0: -5.0}, "DV": {1: np.nan}}, "a dose needs a finite AMT > 0"),
    ({"DV": {1: np.nan}, "WT": {1: np.inf}}, r"\(dv=\) = nan"),
    ({"WT": {1: np.inf}}, "covariate 'WT' is infinite"),
])
def test_the_first_fault_in_pipeline_order_is_reported(faults, match):
    assert nlme.PKDataset.from_dataframe(_faulty(), covariates=["WT"]).n_subjects == 2
    with pytest.raises(ValueError, match=match):
        nlme.PKDataset.from_dataframe(_faulty(**faults), covariates=["WT"])
