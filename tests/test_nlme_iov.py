"""Inter-occasion variability (IOV) in ``nlme.PKModel`` (issue 29).

``PKModel(..., iov={"CL": 0.2}, occasion="OCC")``: a random effect per occasion nested in the
subject, ``log CL_ik = mu + eta_i + kappa_ik``, the occasion effects a latent site
``kappa_CL`` in a plate ``occasion`` over every (subject, occasion) pair, so that SAEM blocks
each subject with its occasions (its connected groups, ``saem.model.group_layout``) and
updates ``omega_iov_CL`` in closed form.

Checked against ``tests/nlme_iov_reference.py``, written without ``numpyro_fed``: the
model's log joint density equals an independent one (analytic two-compartment propagation,
the parameters of an occasion in force from its first record), the -2LL of the default fit
is checked against the exact marginal likelihood (adaptive Gauss-Hermite quadrature over the
2 + K random effects of each subject) and its exact maximum, and the estimates against the
truth of the simulation. Misuse is refused with messages naming the fault (table style of
``tests/test_misuse_nlme.py``).
"""

import json
import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import nlme_iov_reference as ref
import numpy as np
import pandas as pd
import pytest
from numpyro.infer.util import log_density

from numpyro_fed import nlme
from numpyro_fed.nlme.model import occasion_indices

pytestmark = pytest.mark.xdist_group("nlme_iov")

REFERENCE = Path(__file__).resolve().parent / "data" / "nlme_iov_reference.json"


def _pk(**kw):
    """The model of the reference (IV bolus, IOV on CL), with rough initial values."""
    kw.setdefault("iov", {"CL": 0.2})
    kw.setdefault("occasion", "OCC")
    return nlme.PKModel(nlme.one_compartment(None),
                        params={"CL": nlme.Param(1.0), "V": nlme.Param(10.0)},
                        error="additive", **kw)


def _oral(**kw):
    return nlme.PKModel(nlme.one_compartment(),
                        params={"CL": nlme.Param(1.5), "V": nlme.Param(15.0),
                                "KA": nlme.Param(0.8, random=False)},
                        error="additive", **kw)


def _small(n=3, occasions=2, seed=0):
    df, _ = ref.simulate(n, occasions, seed=seed)
    return df


# ----------------------------------------------------------------------------- misuse
def _plain():
    def plain(p, t, doses):
        return jnp.zeros_like(t)

    plain.param_names = ("CL", "V")
    return plain


def _constant_occ(df):
    df = df.copy()
    df["OCC"] = 1
    return df


def _pk_params(**kw):
    return {"CL": nlme.Param(1.5), "V": nlme.Param(15.0), **kw}


CONSTRUCTION = [
    ("iov without occasion", lambda: _pk(occasion=None), ValueError,
     r"iov=\['CL'\] needs occasion=, the name of the data column"),
    ("occasion without iov", lambda: nlme.PKModel(nlme.one_compartment(None), _pk_params(),
                                                  occasion="OCC"),
     ValueError, r"occasion='OCC' is given without iov"),
    ("empty iov", lambda: _pk(iov={}), ValueError, r"iov is empty"),
    ("unknown parameter", lambda: _pk(iov={"Q": 0.2}), ValueError,
     r"iov names 'Q', which is not a parameter of the model"),
    ("no IIV", lambda: _oral(iov={"KA": 0.2}, occasion="OCC"), ValueError,
     r"iov names 'KA', which has no random effect between subjects.*random=True"),
    ("sd <= 0", lambda: _pk(iov={"CL": 0.0}), ValueError,
     r"iov\['CL'\]=0.0: the initial standard deviation .* > 0"),
    ("sd nan", lambda: _pk(iov={"CL": float("nan")}), ValueError, r"iov\['CL'\]=nan"),
    ("sd bool", lambda: _pk(iov={"CL": True}), ValueError, r"iov\['CL'\]=True"),
    ("iov a string", lambda: _pk(iov="CL"), TypeError,
     r"iov must be a dict \{name: initial sd\} or a list of names, got str"),
    ("plain structural function", lambda: nlme.PKModel(_plain(), _pk_params(), iov=["CL"],
                                                       occasion="OCC"),
     ValueError, r"only the compartment models"),
    ("lag time", lambda: nlme.PKModel(nlme.one_compartment(), _pk_params(
        KA=nlme.Param(1.0, random=False), TLAG=nlme.Param(0.1, random=False)),
        iov=["CL"], occasion="OCC"), ValueError, r"iov=\['CL'\].*lag time TLAG"),
]


@pytest.mark.parametrize("name,make,exc,text", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_iov_specification_misuse(name, make, exc, text):
    with pytest.raises(exc, match=text):
        make()


DATA = [
    ("occasion column missing", lambda df: df.drop(columns="OCC"), {},
     r"occasion='OCC': no such column in the data .*covariates=\[\.\.\., 'OCC'\]"),
    ("occasion column not read", lambda df: df, {"covariates": []},
     r"occasion='OCC': no such column in the data"),
    ("one occasion per subject", _constant_occ, {},
     r"occasion='OCC' has one value per subject.*cannot be told from the variability "
     r"between subjects"),
]


@pytest.mark.parametrize("name,edit,kw,text", DATA, ids=[c[0] for c in DATA])
def test_iov_data_misuse(name, edit, kw, text):
    data = nlme.PKDataset.from_dataframe(edit(_small()), **kw)
    pk = _pk()
    with pytest.raises(ValueError, match=text):
        pk.arrays(data)
    with pytest.raises(ValueError, match=text):
        pk.bind(data)


def test_the_model_without_its_occasions_is_refused():
    pk = _pk()
    a = pk.arrays(nlme.PKDataset.from_dataframe(_small()))
    a = {k: v for k, v in a.items() if k not in ("occ_obs", "occ_dose")}
    with pytest.raises(ValueError, match=r"needs the occasions of its data.*pk.arrays\(data\)"):
        jax.eval_shape(lambda: log_density(pk.model, (), a, {}))


# ----------------------------------------------------------------------------- occasions
def test_occasions_are_numbered_per_subject_from_the_records():
    """Occasion codes 5 and 2 (any values, unsorted in time), a subject with three occasions,
    one with one; an EVID = 2 row with a code of its own is no record and no occasion."""
    rows = []
    for sid, codes in ((1, (5, 2)), (2, (1, 2, 3)), (3, (7,))):
        for k, c in enumerate(codes):
            t0 = 24.0 * k
            rows.append({"ID": sid, "TIME": t0, "DV": np.nan, "AMT": 100.0, "EVID": 1,
                         "MDV": 1, "OCC": c})
            for s in (1.0, 4.0):
                rows.append({"ID": sid, "TIME": t0 + s, "DV": 1.0, "AMT": 0.0, "EVID": 0,
                             "MDV": 0, "OCC": c})
    rows.append({"ID": 3, "TIME": 30.0, "DV": np.nan, "AMT": 0.0, "EVID": 2, "MDV": 1,
                 "OCC": 9})
    data = nlme.PKDataset.from_dataframe(pd.DataFrame(rows))
    oo, od, K = occasion_indices(data, "OCC")
    assert K == 2 + 3 + 1
    m = np.asarray(data.obs.mask)
    # subject 1: code 2 -> 0, code 5 -> 1 (sorted by value); subject 2: 2, 3, 4; subject 3: 5
    assert oo[0][m[0]].tolist() == [1, 1, 0, 0]
    assert od[0][:2].tolist() == [1, 0]
    assert oo[1][m[1]].tolist() == [2, 2, 3, 3, 4, 4]
    assert set(oo[2][m[2]].tolist()) == {5}
    b = _pk().arrays(data)["binding"]
    assert b.occasions == 6 and b.piecewise


# ----------------------------------------------------------------------------- density
def test_log_joint_equals_the_independent_reference(x64):
    """The model's log joint density at random latents (occasion effects of either sign, a
    large one included) equals ``nlme_iov_reference``'s, which propagates the amounts by
    hand: the occasion's clearance from its dose on, the previous occasion's until then,
    the amounts carried over. Float64: 1e-9 relative."""
    df = _small(n=4, occasions=3, seed=3)
    data = nlme.PKDataset.from_dataframe(df, dtype=np.float64)
    pk = _pk()
    a = pk.arrays(data)
    case = ref._case(df, y32=False)
    rng = np.random.default_rng(0)
    th = dict(ref.TRUTH)
    for _ in range(3):
        b = rng.normal(size=(4, 5)) * np.array([0.3, 0.2, 0.6, 0.6, 0.6])
        params = {"mu_CL": th["mu_CL"], "mu_V": th["mu_V"],
                  "omega_CL": th["omega_CL"], "omega_V": th["omega_V"],
                  "omega_iov_CL": th["omega_iov_CL"], "a": th["a"],
                  "phi_CL": th["mu_CL"] + b[:, 0], "phi_V": th["mu_V"] + b[:, 1],
                  "kappa_CL": b[:, 2:].reshape(-1)}  # occasions subject after subject
        lp, _ = log_density(pk.model, (), a, {k: jnp.asarray(v) for k, v in params.items()})
        want = float(jnp.sum(case.log_joint({k: jnp.asarray(v) for k, v in th.items()},
                                            jnp.asarray(b))))
        assert abs(float(lp) - want) < 1e-9 * abs(want), (float(lp), want)
    # without the occasion effects: the IOV-free model's predictions (closed forms)
    base = nlme.PKModel(nlme.one_compartment(None), params={"CL": nlme.Param(1.5),
                                                            "V": nlme.Param(15.0)})
    ab = base.arrays(data)
    phi = {"CL": jnp.full(4, 0.7), "V": jnp.full(4, 3.0)}
    d = nlme.Doses(*(jnp.asarray(a[k]) for k in ("dose_time", "dose_amt", "dose_rate",
                                                   "dose_cmt", "dose_ss", "dose_ii",
                                                   "dose_mask")))
    at = pk.record_parameters(phi, {}, {}, binding=a["binding"],
                              kappa={"CL": jnp.zeros(a["binding"].occasions)},
                              occ_obs=a["occ_obs"], occ_dose=a["occ_dose"])
    f_iov = pk.predict(pk.individual(phi), jnp.asarray(a["obs_time"]), d, a["doses_before"],
                       binding=a["binding"], at_records=at)
    f_base = base.predict(base.individual(phi), jnp.asarray(ab["obs_time"]), d,
                          ab["doses_before"], binding=ab["binding"])
    np.testing.assert_allclose(np.asarray(f_iov), np.asarray(f_base), rtol=1e-10)


# ----------------------------------------------------------------------------- the fit
def _reference():
    return json.loads(REFERENCE.read_text())


def test_stored_reference_is_that_of_the_simulated_data():
    """The stored exact maximum belongs to the data the fit below uses (regenerate with
    ``python tests/nlme_iov_reference.py --write`` if the simulation changes), and its
    quadrature is converged: 5 nodes per axis (the stored maximum) and 7 agree to 1e-3 on
    -2LL there (stored, measured when written)."""
    r = _reference()
    df, _ = ref.simulate(r["n"], r["occasions"], seed=r["seed"])
    got = ref.m2ll(df, r["mle"], r["num_nodes"])
    assert abs(got - r["mle"]["m2ll"]) < 1e-6, (got, r["mle"]["m2ll"])
    assert abs(r["m2ll_at_mle_7_nodes"] - got) < 1e-3
    # the MLE of these data lies within 2 SE of the truth (a check of the simulation)
    assert all(abs(r["mle"][k] - r["truth"][k]) < 2 * se for k, se in r["se"].items())


@pytest.mark.slow
def test_default_fit_reaches_the_exact_maximum_and_recovers_the_truth():
    """SAEM's defaults on the simulated IOV data (30 subjects x 2 occasions, 240 samples):
    the exact -2LL at the estimates within 0.5 of the exact maximum (the tolerance of the
    SAEM cases, ``tests/saem_cases.py``), the estimates within 3 standard errors of the
    truth (SEs from the exact information at the maximum, stored), the importance-sampling
    -2LL within 3 of its reported SE (+0.05) of the exact value at the same estimates, and
    the diagnostics (IPRED with the occasion effects) closer to the data than PRED."""
    r = _reference()
    df, _ = ref.simulate(r["n"], r["occasions"], seed=r["seed"])
    data = nlme.PKDataset.from_dataframe(df)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = _pk().fit(data, jax.random.key(0))
        ll = fit.result.log_likelihood(jax.random.key(1), method="is")
    assert fit.result.settings["subjects"] == r["n"]
    p = {k: float(v) for k, v in fit.params.items()}
    exact = ref.m2ll(df, p, r["num_nodes"])
    assert exact - r["mle"]["m2ll"] < 0.5, (exact, r["mle"])
    assert abs(ll["m2ll"] - exact) < 3 * ll["m2ll_se"] + 0.05, (ll, exact)
    for k, se in r["se"].items():
        assert abs(p[k] - r["truth"][k]) < 3 * se + 0.02 * abs(r["truth"][k]), (k, p[k], se)
    pr = fit.predictions()
    assert np.mean((pr.DV - pr.IPRED) ** 2) < np.mean((pr.DV - pr.PRED) ** 2)
    kap = fit.occasion_effects("mode")["CL"]
    assert kap.shape == (r["n"] * r["occasions"],)
    ind = fit.individual_estimates()
    assert {"CL_mode", "V_mode", "eta_CL"} <= set(ind.columns)
    # the CV % of the occasion effect on the variance row of the default table, as the
    # between-subject ones (it was missing once the table moved to variances)
    tab = fit.parameter_table(standard_errors=False)
    cv = 100 * math.sqrt(math.expm1(p["omega_iov_CL"] ** 2))
    assert tab.loc["omega_iov_CL^2", "cv_%"] == pytest.approx(cv)
    assert fit.parameter_table(scale="sd", standard_errors=False).loc[
        "omega_iov_CL", "cv_%"] == pytest.approx(cv)


# ----------------------------------------------------------------------------- propagator
@pytest.mark.parametrize("ka,k,t", [(1.0, 0.1, 3.0), (0.1, 0.1, 5.0), (0.5, 0.5 + 1e-7, 2.0),
                                    (0.3, 2.0, 40.0), (2.0, 3.0, 0.0)])
def test_one_compartment_exponential_in_closed_form(x64, ka, k, t):
    """The closed-form e^{Mt} of one compartment with a depot (what IOV and time-varying
    covariates advance the amounts with) equals expm, with its first and second derivatives
    in KA, at KA = CL/V too (a min/max branch there gave a second derivative 0.63 off)."""
    from jax.scipy.linalg import expm

    from numpyro_fed.nlme.timevarying import exp_rate_matrix, rate_matrix

    p = {"CL": jnp.asarray(10.0 * k), "V": jnp.asarray(10.0)}

    def ours(a):
        return exp_rate_matrix(rate_matrix({**p, "KA": a}, 1, True), t, 1, True)

    def theirs(a):
        return expm(rate_matrix({**p, "KA": a}, 1, True) * t)

    a0 = jnp.asarray(ka)
    np.testing.assert_allclose(ours(a0), theirs(a0), atol=1e-14)
    for order in (1, 2):
        f, g = (lambda a, h=h: h(a)[1, 0] for h in (ours, theirs))
        for _ in range(order):
            f, g = jax.grad(f), jax.grad(g)
        np.testing.assert_allclose(float(f(a0)), float(g(a0)), rtol=1e-9, atol=1e-12)
