"""Tests of numpyro_fed.nlme's model builder (PKModel) and of the diagnostics of its fits
(NLMEFit), on Phenobarb (multiple IV doses) and Theophylline (oral)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pandas as pd
import pytest
import saem_cases as sc
from numpyro.infer.util import log_density

from numpyro_fed import nlme

pytestmark = pytest.mark.xdist_group("nlme")


# ----------------------------------------------------------------------------- the model
def test_theophylline_on_the_layer_is_the_hand_written_model():
    """The PKModel of Theophylline (one compartment, first-order absorption into CMT 1,
    additive error) has the same log density as numpyro_fed.examples.pk's hand-written model at the
    same parameters and random effects (float32 round-off: 1e-5 relative)."""
    from numpyro_fed.examples.pk import load_theophylline, theophylline_model

    data = nlme.load_theophylline()
    pk = nlme.PKModel(nlme.one_compartment(absorption="first_order"),
                      params={"KA": 1.0, "V": 20.0, "CL": 0.5}, error="additive")
    old = load_theophylline()
    rng = np.random.default_rng(0)
    mu = np.array([0.4, 3.4, -3.2])
    phi = (mu + 0.3 * rng.normal(size=(12, 3))).astype(np.float32)
    om, s = np.array([0.6, 0.2, 0.3], np.float32), np.float32(0.7)
    new_p = {"mu_KA": mu[0], "mu_V": mu[1], "mu_CL": mu[2], "omega_KA": om[0],
             "omega_V": om[1], "omega_CL": om[2], "a": s, "phi_KA": phi[:, 0],
             "phi_V": phi[:, 1], "phi_CL": phi[:, 2]}
    old_p = {"mu_ka": mu[0], "mu_V": mu[1], "mu_CL": mu[2], "omega_ka": om[0],
             "omega_V": om[1], "omega_CL": om[2], "sigma": s, "phi": phi}
    lp_new, _ = log_density(pk.model, (), pk.arrays(data), new_p)
    lp_old, _ = log_density(theophylline_model, (old["dose"], old["time"], old["conc"]), {},
                            old_p)
    assert float(lp_new) == pytest.approx(float(lp_old), rel=1e-5)


def test_model_sites_and_full_omega():
    """Param sites (mu_, beta_, omega_ / L_omega, the error's), latent sites in the subject
    plate, one masked observed site; omega='full' gives one MultivariateNormal site."""
    data = nlme.load_phenobarb()
    pk = sc._phenobarb_pk(covariates=True)
    tr = numpyro.handlers.trace(numpyro.handlers.seed(pk.model, 0)).get_trace(
        **pk.arrays(data))
    params = sorted(k for k, v in tr.items() if v["type"] == "param")
    assert params == ["a", "beta_CL_WT", "beta_V_APGARIND_1", "beta_V_WT", "mu_CL", "mu_V",
                      "omega_CL", "omega_V"]
    assert pk.bind(data).references["WT"] == pytest.approx(
        float(np.median(data.covariates["WT"])))
    assert pk.references == {} and not pk.is_bound  # arrays() does not change the model
    assert tr["phi_CL"]["value"].shape == (59,)
    assert tr["dv"]["value"].shape == (59, 6)
    full = nlme.PKModel(nlme.one_compartment(absorption=None),
                        params={"CL": 0.01, "V": 1.0}, omega="full")
    tr = numpyro.handlers.trace(numpyro.handlers.seed(full.model, 0)).get_trace(
        **full.arrays(data))
    assert tr["phi"]["value"].shape == (59, 2)
    assert "L_omega" in tr


def test_samples_before_a_dose_at_the_same_time_follow_the_record_order():
    """A trough recorded before the dose given at the same time does not see that dose
    (NONMEM's record order), and one recorded after it does: checked against the closed
    form of a one-compartment IV bolus."""
    df = pd.DataFrame({
        "ID": [1, 1, 1, 1, 2, 2, 2],
        "TIME": [0.0, 12.0, 12.0, 13.0, 0.0, 12.0, 12.0],
        "AMT": [100.0, 0.0, 100.0, 0.0, 100.0, 100.0, 0.0],
        "EVID": [1, 0, 1, 0, 1, 1, 0],
        "DV": [np.nan, 5.0, np.nan, 8.0, np.nan, np.nan, 9.0],
    })
    data = nlme.PKDataset.from_dataframe(df)
    pk = nlme.PKModel(nlme.one_compartment(absorption=None), params={"CL": 1.0, "V": 10.0})
    a = pk.arrays(data)
    assert a["binding"].record_order and pk.bind(data).record_order
    ind = {"CL": jnp.array([1.0, 1.0]), "V": jnp.array([10.0, 10.0])}
    f = np.asarray(pk.predict(ind, jnp.asarray(a["obs_time"]),
                              nlme.Doses(*(jnp.asarray(a[k]) for k in (
                                  "dose_time", "dose_amt", "dose_rate", "dose_cmt", "dose_ss",
                                  "dose_ii", "dose_mask"))), jnp.asarray(a["doses_before"])))
    k = 0.1
    np.testing.assert_allclose(f[0], [10 * np.exp(-12 * k),
                                      10 * np.exp(-13 * k) + 10 * np.exp(-k)], rtol=1e-5)
    np.testing.assert_allclose(f[1, 0], 10 * np.exp(-12 * k) + 10, rtol=1e-5)


def test_builder_errors_name_the_thing():
    one = nlme.one_compartment(absorption=None)
    with pytest.raises(ValueError, match="lacks \\['V'\\]"):
        nlme.PKModel(one, params={"CL": 0.01})
    with pytest.raises(ValueError, match="'KA'.*unknown to the structural model"):
        nlme.PKModel(one, params={"CL": 0.01, "V": 1.0, "KA": 1.0})
    # a misspelt name: named as given, with the name it most likely meant
    with pytest.raises(ValueError, match=r"params has \['CLX'\], unknown to the structural "
                       r"model; it lacks \['CL'\].*did you mean 'CL' for 'CLX'\?"):
        nlme.PKModel(one, params={"CLX": 0.01, "V": 1.0})
    with pytest.raises(ValueError, match="params\\['CL'\\].value=-1"):
        nlme.PKModel(one, params={"CL": -1.0, "V": 1.0})
    with pytest.raises(ValueError, match="transform='exp'"):
        nlme.PKModel(one, params={"CL": nlme.Param(0.01, transform="exp"), "V": 1.0})
    with pytest.raises(ValueError, match="covariates\\['WT'\\]='quadratic'"):
        nlme.PKModel(one, params={"CL": nlme.Param(0.01, covariates={"WT": "quadratic"}),
                                  "V": 1.0})
    with pytest.raises(ValueError, match="omega="):
        nlme.PKModel(one, params={"CL": 0.01, "V": 1.0}, omega="block")
    with pytest.raises(ValueError, match="random effect"):
        nlme.PKModel(one, params={"CL": nlme.Param(0.01, random=False),
                                  "V": nlme.Param(1.0, random=False)})
    data = nlme.load_phenobarb()
    pk = nlme.PKModel(one, params={"CL": nlme.Param(0.01, covariates={"AGE": "linear"}),
                                   "V": 1.0})
    with pytest.raises(ValueError, match="covariate 'AGE' is not in the data"):
        pk.arrays(data)
    pk = nlme.PKModel(one, params={"CL": nlme.Param(0.01, covariates={"APGARIND": "linear"}),
                                   "V": 1.0})
    with pytest.raises(ValueError, match="'APGARIND' is categorical"):
        pk.arrays(data)
    with pytest.raises(TypeError, match="PKDataset"):
        pk.arrays({"dv": np.zeros(3)})


# ----------------------------------------------------------------------------- a fit
@pytest.fixture(scope="module")
def phenobarb_fit():
    """The covariate model of Phenobarb fitted by SAEM with its defaults (shared)."""
    data = nlme.load_phenobarb()
    pk = sc._phenobarb_pk(covariates=True)
    return pk.fit(data, jax.random.key(0))


def test_default_fit_reaches_the_exact_maximum(phenobarb_fit):
    """Phenobarb with weight and Apgar covariates, fitted with SAEM's defaults through the
    nlme layer: every quantity within the unseen-model targets of the exact MLE (fixed
    effects 0.2 SE or 1%, variances 0.3 SE or 10%, -2LL gap <= 0.5)."""
    cmp = sc.compare(sc.get_case("phenobarb_cov"), phenobarb_fit.params)
    assert cmp["ok"], sc.format_comparison(cmp)


def test_tables_and_individual_estimates(phenobarb_fit):
    fit = phenobarb_fit
    tab = fit.parameter_table()  # variances omega^2 (as saemix / Monolix report them); the
    # residual error parameter as written (the nlme error models are not the closed-form
    # Gaussian residual scale that SAEMResult.parameter_table squares)
    for k in ("mu_CL", "beta_V_APGARIND_1", "omega_V^2", "a", "typical_CL"):
        assert k in tab.index
    om = float(fit.params["omega_CL"])
    assert tab.loc["omega_CL^2", "estimate"] == pytest.approx(om**2, rel=1e-5)
    assert tab.loc["omega_CL^2", "cv_%"] == pytest.approx(100 * np.sqrt(np.expm1(om**2)))
    sd = fit.parameter_table(scale="sd")  # the model's own standard deviations
    assert sd.loc["omega_CL", "cv_%"] == pytest.approx(100 * np.sqrt(np.expm1(om**2)))
    # RSE(omega^2) = 2 RSE(omega) at a maximum; each scale takes the curvature in its own
    # coordinates at the stochastic estimate (the gradient term): 0.9% apart here
    assert tab.loc["omega_CL^2", "rse_%"] == pytest.approx(2 * sd.loc["omega_CL", "rse_%"],
                                                           rel=0.05)
    assert np.all(np.isfinite(tab.loc[["mu_CL", "mu_V", "a", "omega_CL^2"], "se"]))
    assert tab.loc["mu_CL", "rse_%"] == pytest.approx(
        100 * tab.loc["mu_CL", "se"] / abs(tab.loc["mu_CL", "estimate"]))
    ind = fit.individual_estimates()
    assert len(ind) == 59 and list(ind.index[:3]) == [1, 2, 3]
    assert np.all(ind["CL_sd"] > 0)
    # the mode and the conditional mean of each subject are close (sd units)
    z = np.abs(np.log(ind["CL_mode"]) - np.log(ind["CL_mean"])) / (ind["CL_sd"] / ind["CL_mean"])
    assert np.median(z) < 0.5
    shr = fit.shrinkage()
    assert set(shr) == {"CL", "V"} and all(-50 < v < 100 for v in shr.values())


def test_predictions_and_simulation(phenobarb_fit, tmp_path):
    fit = phenobarb_fit
    pr = fit.predictions()
    assert len(pr) == 155 and not pr[["PRED", "IPRED", "IWRES"]].isna().any().any()
    # IPRED fits better than PRED, and IWRES has unit scale (sd 0.5-1.5 over 155 rows)
    assert np.mean((pr.DV - pr.IPRED) ** 2) < np.mean((pr.DV - pr.PRED) ** 2)
    assert 0.5 < pr.IWRES.std() < 1.5
    # keeping the EBEs, the simulated structural predictions are IPRED
    sim = fit.simulate(jax.random.key(1), new_subjects=False)
    m = sim["mask"]
    np.testing.assert_allclose(sim["f"][0][m], pr.IPRED.to_numpy(), rtol=1e-5)
    # new subjects: the median of the simulated concentrations is near PRED
    sim = fit.simulate(jax.random.key(2), num_replicates=400)
    med = np.median(sim["f"], 0)[m]
    assert np.median(np.abs(np.log(med / pr.PRED.to_numpy()))) < 0.1
    nd = fit.npde(jax.random.key(3), num_sims=200)["NPDE"]
    # under the model NPDE ~ N(0, 1): mean within 4 SE (1/sqrt(155) = 0.08), sd in 0.7-1.3
    assert abs(nd.mean()) < 0.35 and 0.7 < nd.std() < 1.3
    vpc = fit.vpc_table(jax.random.key(4), num_sims=100)
    assert set(vpc["quantile"]) == {0.05, 0.5, 0.95}
    assert np.mean((vpc.observed >= vpc.sim_lo) & (vpc.observed <= vpc.sim_hi)) > 0.6
    fit.plot_goodness_of_fit(tmp_path / "gof.png")
    fit.plot_individual_fits(tmp_path / "ind.png", subjects=fit.data.ids[:4])
    fit.plot_vpc(jax.random.key(5), tmp_path / "vpc.png", num_sims=50,
                 prediction_corrected=True)
    for f in ("gof.png", "ind.png", "vpc.png"):
        assert (tmp_path / f).stat().st_size > 10_000
    with pytest.raises(ValueError, match="num_sims"):
        fit.npde(jax.random.key(0), num_sims=10)
    with pytest.raises(ValueError, match="fitted subjects"):
        fit.simulate(jax.random.key(0), nlme.load_phenobarb().subjects([0, 1]),
                     new_subjects=False)


def test_cwres_is_the_foce_linearisation_at_the_ebes(phenobarb_fit):
    """CWRES recomputed independently for three subjects: Jacobian of the predictions in the
    random effects by central finite differences (h = 1e-3 on the log scale), covariance
    J Omega J' + diag(a^2) (additive error), Cholesky whitening -- which differs from the
    symmetric square root by a rotation, so the sums of squares must agree (float32
    predictions, h^2 truncation: 1e-3 relative)."""
    fit = phenobarb_fit
    cw = fit.cwres()
    pr = fit.predictions()
    assert np.isfinite(pr.CWRES).all()
    # CWRES has unit scale over 155 observations (N(0, 1) under the model, up to the
    # linearisation): mean within 4 SE (0.32), sd in 0.7-1.3
    assert abs(pr.CWRES.mean()) < 0.32 and 0.7 < pr.CWRES.std() < 1.3
    a = fit._arrays
    typ = {k: np.asarray(v, np.float64) for k, v in fit._typical(a).items()}
    modes = fit.conditional_modes()
    Om = fit.omega()
    sig = float(fit.params["a"])
    for i in (0, 7, 22):
        j = np.nonzero(np.asarray(a["obs_mask"][i], bool))[0]
        eta = np.array([modes[n][i] - typ[n][i] for n in ("CL", "V")])

        def f(e, i=i, j=j):
            phi = {n: typ[n].copy() for n in typ}
            for k, n in enumerate(("CL", "V")):
                phi[n][i] = typ[n][i] + e[k]
            return fit._predict(fit.pk.individual(phi), a)[i, j].astype(np.float64)

        h = 1e-3
        J = np.stack([(f(eta + h * d) - f(eta - h * d)) / (2 * h) for d in np.eye(2)], -1)
        r = np.asarray(a["dv"][i, j], np.float64) - (f(eta) - J @ eta)
        C = J @ Om @ J.T + sig**2 * np.eye(len(j))
        w = np.linalg.solve(np.linalg.cholesky(C), r)
        assert np.sum(cw[i, j] ** 2) == pytest.approx(np.sum(w**2), rel=1e-3)
        assert np.isnan(cw[i, len(j):]).all()


def test_predictive_simulates_from_the_built_model():
    """The built model is an ordinary NumPyro model: Predictive with fixed params and no
    ``dv`` simulates observations of the padded shape (masked entries included)."""
    from numpyro.infer import Predictive

    data = nlme.load_phenobarb()
    pk = sc._phenobarb_pk(covariates=False)
    a = {k: v for k, v in pk.arrays(data).items() if k != "dv"}
    params = {"mu_CL": -5.17, "mu_V": 0.37, "omega_CL": 0.47, "omega_V": 0.45, "a": 2.8}
    out = Predictive(pk.model, params=params, num_samples=3)(jax.random.key(0), **a)
    assert out["dv"].shape == (3, 59, 6) and out["phi_CL"].shape == (3, 59)
    assert np.all(np.isfinite(np.asarray(out["dv"])))


def _hand_written():
    """A NumPyro model written by hand that calls nlme's structural function and error model
    (combined error), the PKModel built from the same pieces, and their arguments."""
    data = nlme.load_theophylline()
    # specialised to the data's dosing routes, as PKModel does (and a user should)
    one = nlme.one_compartment(absorption="first_order").for_doses(data.doses)
    err = nlme.ErrorModel("combined2")
    names = ("KA", "V", "CL")

    def model(t, doses, mask, dv=None):
        mu = {p: numpyro.param(f"mu_{p}", v) for p, v in zip(names, (0.0, 3.0, 1.0),
                                                              strict=True)}
        om = {p: numpyro.param(f"omega_{p}", 0.3, constraint=numpyro.distributions.
                               constraints.positive) for p in names}
        ep = err.params()
        with numpyro.plate("subject", t.shape[0]):
            phi = {p: numpyro.sample(f"phi_{p}", numpyro.distributions.Normal(mu[p], om[p]))
                   for p in names}
            f = jax.vmap(one)({p: jnp.exp(v) for p, v in phi.items()}, t, doses)
            numpyro.sample("dv", err.dist(f, ep).mask(mask).to_event(1), obs=dv)

    pk = nlme.PKModel(one, params={"KA": 1.0, "V": float(np.exp(3.0)), "CL": float(np.e)},
                      error=err)
    a = pk.arrays(data)
    doses = nlme.Doses(*(jnp.asarray(a[k]) for k in ("dose_time", "dose_amt", "dose_rate",
                                                      "dose_cmt", "dose_ss", "dose_ii",
                                                      "dose_mask")))
    rng = np.random.default_rng(1)
    vals = {"mu_KA": 0.4, "mu_V": 3.4, "mu_CL": 1.0, "omega_KA": 0.6, "omega_V": 0.2,
            "omega_CL": 0.3, "a": 0.5, "b": 0.1}
    vals.update({f"phi_{p}": (m + 0.2 * rng.normal(size=12)).astype(np.float32)
                 for p, m in zip(names, (0.4, 3.4, 1.0), strict=True)})
    args = (jnp.asarray(a["obs_time"]), doses, jnp.asarray(a["obs_mask"]),
            jnp.asarray(a["dv"]))
    return model, args, pk, a, vals


def test_a_hand_written_model_with_the_same_pieces():
    """The hand-written model has the log density of the PKModel built from the same pieces
    (1e-5 relative, float32)."""
    model, args, pk, a, vals = _hand_written()
    mine, _ = log_density(model, args, {}, vals)
    theirs, _ = log_density(pk.model, (), a, vals)
    assert float(mine) == pytest.approx(float(theirs), rel=1e-5)


@pytest.mark.slow
def test_saem_fits_the_hand_written_model():
    """SAEM fits the hand-written model (a short schedule: finite estimates). Slow: a SAEM
    program of its own to compile (38 s on the CI machine)."""
    from numpyro_fed.saem import SAEM, Schedule

    model, args, *_ = _hand_written()
    res = SAEM(model, schedule=Schedule(num_iters=30, num_exploration=20)).run(
        jax.random.key(0), *args)
    assert all(np.all(np.isfinite(v)) for v in res.params.values())


def test_example_smoke(phenobarb_fit, tmp_path):
    """examples/saem_phenobarb.py --smoke: the workflow's steps 1 and 3-5 (its fit reuses
    the programs compiled for ``phenobarb_fit``), tables and figures written."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    tables = importlib.import_module("saem_phenobarb").main(["--smoke", "--out",
                                                             str(tmp_path)])
    assert {"covariates", "parameters", "shrinkage", "regimen"} <= set(tables)
    assert np.all(np.isfinite(tables["regimen"].to_numpy()))
    for f in ("phenobarb_gof.png", "phenobarb_individual.png", "phenobarb_vpc.png",
              "phenobarb_pcvpc.png", "saem_phenobarb_smoke.md"):
        assert (tmp_path / f).exists(), f


def test_uncensored_data_use_the_plain_error_density():
    """Without a censored observation the model uses the error model's plain distribution
    (``Binding.censored`` is False): the log joint density equals the M3 form's with
    ``cens = False`` everywhere (float64: 1e-12 relative), and a ``cens`` array that does
    mark an observation while the binding says there is none is refused, naming ``cens``."""
    import dataclasses

    with jax.enable_x64(True):
        data = nlme.load_theophylline(dtype=np.float64).subjects(range(4))
        pk = nlme.PKModel(nlme.one_compartment(),
                          params={"CL": nlme.Param(3.0), "V": nlme.Param(30.0),
                                  "KA": nlme.Param(1.5)},
                          error="combined1")
        kw = pk.arrays(data)
        b = kw["binding"]
        assert b.censored is False
        rng = np.random.default_rng(0)
        vals = {"mu_CL": jnp.asarray(1.0), "mu_V": jnp.asarray(3.4), "mu_KA": jnp.asarray(0.4),
                "omega_CL": jnp.asarray(0.3), "omega_V": jnp.asarray(0.2),
                "omega_KA": jnp.asarray(0.5), "a": jnp.asarray(0.5), "b": jnp.asarray(0.1)}
        for k in ("CL", "V", "KA"):
            vals[f"phi_{k}"] = vals[f"mu_{k}"] + jnp.asarray(0.3 * rng.normal(size=4))
        plain, tr = log_density(pk.model, (), kw, vals)
        assert type(tr["dv"]["fn"].base_dist.base_dist).__name__ == "Normal"
        m3, tr3 = log_density(pk.model, (), {**kw, "binding": dataclasses.replace(
            b, censored=True)}, vals)
        assert "Censored" in type(tr3["dv"]["fn"].base_dist.base_dist).__name__
        assert abs(float(plain) - float(m3)) <= 1e-12 * abs(float(m3)), (plain, m3)
        cens = np.array(kw["cens"], bool)
        cens[0, 0] = True
        with pytest.raises(ValueError, match="`cens`"):
            log_density(pk.model, (), {**kw, "cens": cens}, vals)
