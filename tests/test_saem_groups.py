"""SAEM with several grouping factors: crossed and nested random effects (issue 28).

When no plate holds every latent site (``numpyro.plate("batches")`` with the batch effects
and a second ``numpyro.plate("casks")`` with the cask effects, gathered as ``b[batch] +
c[cask]``), SAEM used to fall back to ONE Metropolis block over all latents: the importance
sampling -2LL of lme4's Pastes came out 9.8 above the exact value (reported SE 0.89) and the
batch variance 2.5x its maximum-likelihood value. The latents are now blocked by the
connected groups of the bipartite graph "latent coordinate -- log-density element"
(:func:`numpyro_fed.saem.model.group_layout`): nested factors give one group per top-level
unit (a batch with its casks), crossed factors one group. Linear Gaussian
models get their -2LL in closed form (``log_likelihood(method="exact")``, per group), checked
against the exact references of ``tests/saem_cases.py``.

Cost: each default fit compiles for ~20-30 s on a 2-core CPU; the fast suite fits Pastes
once (seed 0) and a small padded model (~50 s in all); Oats, Penicillin, cbpp_olre, more
seeds and the 20-seed honesty check are ``slow`` (~2-3 min, compiled programs shared).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import saem_cases as sc
from numpyro.distributions import constraints

from numpyro_fed.saem import SAEM, ConvergenceWarning, Schedule
from numpyro_fed.saem.model import ModelInfo, subject_layout

pytestmark = pytest.mark.xdist_group("saem_group_fits")


def _layout(name):
    case = sc.get_case(name)
    info = ModelInfo(case.model, (), case.data, jax.random.key(0))
    return case, info, subject_layout(info, None, (), case.data, jax.random.key(1))


# ------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("name,n,per", [("pastes", 10, 3), ("oats", 6, 3)])
def test_nested_factors_are_blocked_by_top_level_unit(name, n, per):
    """Nested: one group per batch (block), holding its own latent and its casks' (plots')."""
    case, info, (lay, reason) = _layout(name)
    assert lay is not None, reason
    assert (lay.n, lay.q) == (n, 1 + per)
    # flat z = [b (n), c (n * per)]: group g = b_g and c_{per g .. per g + per - 1}
    want = np.concatenate([np.arange(n)[:, None],
                           n + per * np.arange(n)[:, None] + np.arange(per)[None]], 1)
    np.testing.assert_array_equal(lay.zidx, want)
    ids = lay.ids
    top = case.data["batch"] if name == "pastes" else case.data["block"]
    obs = [k for k in info.observed_names][0]
    np.testing.assert_array_equal(ids[obs], top)
    np.testing.assert_array_equal(ids["b"], np.arange(n))
    np.testing.assert_array_equal(ids["c"], np.repeat(np.arange(n), per))


def test_crossed_factors_form_one_group():
    """Crossed: every latent in one group (u: 24 plates, v: 6 samples)."""
    case, info, (lay, reason) = _layout("penicillin")
    assert lay is not None, reason
    assert (lay.n, lay.q) == (1, 30)
    np.testing.assert_array_equal(lay.zidx, np.arange(30)[None])
    assert np.all(lay.ids["diameter"] == 0)


def test_crossed_intercept_shift_goes_to_the_factor_with_fewest_levels():
    """The centring shift of the intercept of a crossed model is not unique (it can move
    either factor); on the factor with the fewest levels (6 samples, not 24 plates) SAEM
    reaches the intercept's MLE on 4 seeds (the joint block without a shift stopped 0.5-1.8
    SE short on seeds 1-3; the minimum-norm shift, 80% on the plates, 0.56 SE short on seed
    1)."""
    from numpyro_fed.saem.model import centring_design

    case, info, (lay, _) = _layout("penicillin")
    M = np.asarray(centring_design(info, lay, info.theta0_u_flat, info.z0_u_flat, (),
                                   case.data, jax.random.key(2),
                                   ids={k: jnp.asarray(v) for k, v in lay.site_ids}))
    k = info.param_names.index("mu")
    # the shift is exact: every (plate, sample) cell moves by 1
    np.testing.assert_allclose(M[:24, k][:, None] + M[24:, k][None, :], 1.0, atol=1e-3)
    assert np.all(M[24:, k] > 0.9)


def test_groups_of_unequal_size_are_padded():
    """cbpp with an observation-level effect: each herd's group holds its u and the e of its
    rows (2 to 5 latents): padded to 5 with -1 entries."""
    case, _, (lay, reason) = _layout("cbpp_olre")
    assert lay is not None, reason
    herd = case.data["herd"]
    sizes = 1 + np.bincount(herd, minlength=15)
    assert lay.n == 15 and lay.q == sizes.max()
    # flat z = [e (56 rows), u (15 herds)]; group order: by first row
    for g in range(lay.n):
        idx = lay.zidx[g][lay.zidx[g] >= 0]
        h = lay.ids["u"].tolist().index(g)
        assert sorted(idx.tolist()) == sorted(np.nonzero(herd == h)[0].tolist() + [56 + h])
    assert np.sum(lay.zidx < 0) == lay.n * lay.q - 71


def test_a_latent_coupling_two_groups_merges_them():
    """A hierarchical mean: c_j ~ Normal(b[batch_of_cask[j]], tau) couples each cask to its
    batch through the prior alone (no observation shares them): still one group per batch."""
    nb, per = 5, 2
    boc = np.repeat(np.arange(nb), per)
    rng = np.random.default_rng(0)
    y = rng.normal(size=nb * per).astype(np.float32)

    def model(boc, y=None):
        mu = numpyro.param("mu", 0.0)
        tb = numpyro.param("tb", 1.0, constraint=constraints.positive)
        tc = numpyro.param("tc", 1.0, constraint=constraints.positive)
        with numpyro.plate("batches", nb):
            b = numpyro.sample("b", dist.Normal(mu, tb))
        with numpyro.plate("casks", nb * per):
            c = numpyro.sample("c", dist.Normal(b[boc], tc))
            numpyro.sample("y", dist.Normal(c, 1.0), obs=y)

    data = {"boc": boc, "y": y}
    info = ModelInfo(model, (), data, jax.random.key(0))
    lay, reason = subject_layout(info, None, (), data, jax.random.key(1))
    assert lay is not None, reason
    assert (lay.n, lay.q) == (nb, 1 + per)
    np.testing.assert_array_equal(lay.ids["y"], boc)


def _unequal_nested_data(seed=0):
    """Batches with 1 to 4 casks (unequal connected groups), 2 assays per cask."""
    rng = np.random.default_rng(seed)
    per = np.array([1, 2, 3, 4, 2, 3, 1, 4])
    boc = np.repeat(np.arange(len(per)), per)  # batch of each cask
    cask = np.repeat(np.arange(len(boc)), 2)
    batch = boc[cask]
    y = (5.0 + rng.normal(size=len(per))[batch] * 1.5 + rng.normal(size=len(boc))[cask]
         + 0.5 * rng.normal(size=len(cask))).astype(np.float32)
    return {"batch": batch, "cask": cask, "y": y}


def unequal_nested_model(batch, cask, y=None, n_batches=8, n_casks=20):
    mu = numpyro.param("mu", 0.0)
    tb = numpyro.param("tb", 1.0, constraint=constraints.positive)
    tc = numpyro.param("tc", 1.0, constraint=constraints.positive)
    s = numpyro.param("s", 1.0, constraint=constraints.positive)
    with numpyro.plate("batches", n_batches):
        b = numpyro.sample("b", dist.Normal(0.0, tb))
    with numpyro.plate("casks", n_casks):
        c = numpyro.sample("c", dist.Normal(0.0, tc))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + b[batch] + c[cask], s), obs=y)


def _dense_gaussian_m2ll(p, data):
    """-2 log N(y; mu, Z Sigma Z' + s^2 I) in float64 (numpy, independent of the library)."""
    batch, cask, y = data["batch"], data["cask"], np.asarray(data["y"], np.float64)
    Zb = (batch[:, None] == np.arange(batch.max() + 1)).astype(float)
    Zc = (cask[:, None] == np.arange(cask.max() + 1)).astype(float)
    V = (float(p["tb"]) ** 2 * Zb @ Zb.T + float(p["tc"]) ** 2 * Zc @ Zc.T
         + float(p["s"]) ** 2 * np.eye(len(y)))
    r = y - float(p["mu"])
    sign, logdet = np.linalg.slogdet(V)
    return float(logdet + r @ np.linalg.solve(V, r) + len(y) * np.log(2 * np.pi))


def test_unequal_groups_exact_and_importance_sampling_m2ll():
    """Batches with 1 to 4 casks: groups of 2 to 5 latents, padded. At the fitted theta the
    closed form equals the dense Gaussian marginal (float64: 1e-6) and IS agrees within 3 of
    its reported SE (+0.01)."""
    data = _unequal_nested_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = SAEM(unequal_nested_model, schedule=Schedule(num_iters=150,
                                                           num_exploration=100)).run(
            jax.random.key(0), **data)
        ex = res.log_likelihood(jax.random.key(1), method="exact")
        is_ = res.log_likelihood(jax.random.key(1), method="is", num_samples=2000)
    assert res.settings["subjects"] == 8
    dense = _dense_gaussian_m2ll(res.params, data)
    assert ex["method"] == "exact" and abs(ex["m2ll"] - dense) < 1e-6
    assert abs(is_["m2ll"] - dense) < 3 * is_["m2ll_se"] + 0.01


# ------------------------------------------------------------------------------ fits
def _check_default_fit(name, seed, or_warned: bool = False):
    """The default fit of case ``name`` meets the targets of tests/saem_cases.py; with
    ``or_warned``, a fit that misses a variance's target must instead have said that it did
    not converge (a ConvergenceWarning naming drift), never return it silently."""
    case = sc.get_case(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = SAEM(case.model).run(jax.random.key(seed), **case.data)
        ll_is = res.log_likelihood(jax.random.key(seed + 1000), method="is")
        # the reported (importance sampling) -2LL is scored too: within 0.5 of the exact one
        out = sc.compare(case, res.params, m2ll_at_est=ll_is["m2ll"])
        if or_warned and not out["ok"]:
            assert not {"m2ll_gap", "m2ll_reported"} & set(out["failures"]), \
                sc.format_comparison(out)
            assert any("drift" in m for m in res.convergence_messages), (
                sc.format_comparison(out), res.convergence_messages)
            return res
        assert out["ok"], sc.format_comparison(out)
        if name == "cbpp_olre":  # binomial: no closed form, "auto" says so
            auto = res.log_likelihood(jax.random.key(seed + 1000), method="auto")
            assert auto["method"] == "is"
            return res
        ll = res.log_likelihood(jax.random.key(seed + 1000), method="exact")
    # the closed form is the exact -2LL at the estimate (evaluated in float64)
    assert ll["method"] == "exact" and ll["m2ll_se"] == 0.0
    assert abs(ll["m2ll"] - out["m2ll_exact_at_est"]) < 1e-5
    # importance sampling over the groups agrees within its own reported SE (3 SE + 0.01)
    assert abs(ll_is["m2ll"] - out["m2ll_exact_at_est"]) < 3 * ll_is["m2ll_se"] + 0.01
    return res


@pytest.mark.slow  # 47-87 s (suite time; nested factors stay in the suite with the
# plate sizes from the data and oats' blocks)
def test_pastes_default_fit_reaches_the_exact_maximum():
    """Was: -2LL (IS) 9.8 above the exact value, tau_batch^2 2.5x its MLE (one joint block).
    Known open limit (issue 28): on some CPUs seed 0 ends with tau_batch^2 at 0.51 against its
    MLE 1.20 (0.34 SE, target 0.3 SE; -2LL gap 0.14): the weakly identified variance is at
    0.54 when the steps start decreasing and creeps back; the fit then warns that it still
    drifts, which this test requires (seeds 1-3 meet every target: the slow test below)."""
    res = _check_default_fit("pastes", 0, or_warned=True)
    assert res.settings["subjects"] == 10
    assert res.settings["subject_plate"] == "groups(batches/casks)"


@pytest.mark.slow
@pytest.mark.parametrize("name,seed", [("pastes", s) for s in (1, 2, 3)]
                         + [(n, s) for n in ("oats", "cbpp_olre", "penicillin")
                            for s in range(4)])
def test_grouped_default_fits_reach_the_exact_maximum(name, seed):
    _check_default_fit(name, seed)


# ------------------------------------------------------------------------------ -2LL
def _poisson_fit():
    """A small Poisson GLMM (not Gaussian): a short fit, enough to evaluate -2LL methods."""
    rng = np.random.default_rng(1)
    n, t = 12, 3
    sid = np.repeat(np.arange(n), t)
    y = rng.poisson(np.exp(rng.normal(size=n))[sid]).astype(np.float32)

    def model(sid, y=None):
        mu = numpyro.param("mu", 0.0)
        tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
        with numpyro.plate("subject", n):
            b = numpyro.sample("b", dist.Normal(mu, tau))
        with numpyro.plate("obs", sid.shape[0]):
            numpyro.sample("y", dist.Poisson(jnp.exp(b[sid])), obs=y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return SAEM(model, schedule=Schedule(num_iters=60, num_exploration=40)).run(
            jax.random.key(0), sid=sid, y=y)


def test_exact_m2ll_refuses_a_non_gaussian_model_and_auto_falls_back():
    res = _poisson_fit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        with pytest.raises(ValueError, match=r"method='exact'.*not linear Gaussian.*"
                                             r"use method='is'"):
            res.log_likelihood(jax.random.key(0), method="exact")
        auto = res.log_likelihood(jax.random.key(0), method="auto", num_samples=1000)
        is_ = res.log_likelihood(jax.random.key(0), method="is", num_samples=1000)
    assert auto["method"] == "is" and auto["requested_method"] == "auto"
    assert auto["m2ll"] == is_["m2ll"]


@pytest.mark.slow
def test_pastes_importance_sampling_se_is_honest_over_40_seeds():
    """At the fitted theta, the IS -2LL over the connected groups (``method="is"``; the
    default is the closed form for this linear model) lies within 2 reported SE of the exact
    value for >= 33 of 40 seeds (an honest SE misses with probability 4.55% per seed:
    P(Bin(40, 0.0455) >= 8) = 0.04%), with err/SE of mean within 1 and sd in (0.6, 1.5).
    The issue's 20-seed count is not asserted: an honest estimator misses 3 or more of 20
    with probability 6% (measured: 16/20 on seeds 100-119 and 36/40, but 188/200 = 94% on
    seeds 5000-5199 with sd/SE 1.03). Before the group layout (one joint block): error 9.8
    with a reported SE of 0.89."""
    case = sc.get_case("pastes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = SAEM(case.model).run(jax.random.key(0), **case.data)
        exact = -2 * sc.exact_loglik(case, res.params)
        errs = []
        for s in range(40):
            ll = res.log_likelihood(jax.random.key(100 + s), method="is")
            errs.append((ll["m2ll"] - exact) / ll["m2ll_se"])
    errs = np.asarray(errs)
    assert np.sum(np.abs(errs) <= 2.0) >= 33, errs
    assert abs(np.mean(errs)) < 1.0 and 0.6 < np.std(errs) < 1.5, errs


def pastes_plain_model(batch, cask, strength=None):
    """Pastes as a new user writes it: both plate sizes computed from the data."""
    mu = numpyro.param("mu", 50.0)
    tau_batch = numpyro.param("tau_batch", 3.0, constraint=constraints.positive)
    tau_cask = numpyro.param("tau_cask", 1.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 2.0, constraint=constraints.positive)
    with numpyro.plate("batches", len(np.unique(batch))):
        b = numpyro.sample("b", dist.Normal(0.0, tau_batch))
    with numpyro.plate("casks", int(cask.max()) + 1):
        c = numpyro.sample("c", dist.Normal(0.0, tau_cask))
    with numpyro.plate("obs", batch.shape[0]):
        numpyro.sample("strength", dist.Normal(mu + b[batch] + c[cask], sigma),
                       obs=strength)


def test_nested_factors_with_plate_sizes_from_the_data():
    """Two idioms at once: nested grouping factors whose plate sizes the model computes from
    the data. The layout is the constant-size model's (one group per batch), and a short fit
    gives its estimates (same programs up to the static sizes: float32 round-off)."""
    case = sc.get_case("pastes")
    data = {k: v for k, v in case.data.items() if k not in ("n_batches", "n_casks")}
    info = ModelInfo(pastes_plain_model, (), data, jax.random.key(0))
    lay, reason = subject_layout(info, None, (), data, jax.random.key(1))
    assert lay is not None, reason
    assert (lay.n, lay.q) == (10, 4)
    sched = Schedule(num_iters=40, num_exploration=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        plain = SAEM(pastes_plain_model, schedule=sched).run(jax.random.key(2), **data)
        const = SAEM(case.model, schedule=sched).run(jax.random.key(2), **case.data)
    want, got = const.estimates(), plain.estimates()
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4)


# ------------------------------------------------------------ -2LL of a nested GLMM: honest
# A Poisson GLMM with an observation-level effect nested in each group (the kind of cbpp_olre:
# connected groups of 1 + rows latents, no closed form), small enough for a fast fit, with an
# exact reference by nested one-dimensional integration written here with numpy.
_NG, _NR = 6, 4  # groups, rows per group: connected groups of 5 latents


def _olre_data():
    rng = np.random.default_rng(5)
    grp = np.repeat(np.arange(_NG), _NR).astype(np.int32)
    eta = 1.0 + 0.7 * rng.normal(size=_NG)[grp] + 0.5 * rng.normal(size=_NG * _NR)
    return {"grp": grp, "y": rng.poisson(np.exp(eta)).astype(np.float32)}


def olre_model(grp, y=None):
    mu = numpyro.param("mu", 0.0)
    tau_g = numpyro.param("tau_g", 1.0, constraint=constraints.positive)
    tau_o = numpyro.param("tau_o", 1.0, constraint=constraints.positive)
    with numpyro.plate("groups", _NG):
        u = numpyro.sample("u", dist.Normal(0.0, tau_g))
    with numpyro.plate("obs", grp.shape[0]):
        e = numpyro.sample("e", dist.Normal(0.0, tau_o))
        numpyro.sample("y", dist.Poisson(jnp.exp(mu + u[grp] + e)), obs=y)


def _olre_exact_m2ll(p, data, num_points=801, half_width=10.0):
    """Exact -2LL: per row the integral over its own effect e as a function of the group
    effect u (trapezoid on +-10 prior sd, 801 points: spacing 0.025 sd; the integrand is
    analytic and its posterior sd is >= 0.2 prior sd, so the rule's error is far below
    1e-8 -- 1201 points agree to 1e-10), then over u, in float64."""
    from scipy.special import gammaln, logsumexp

    mu, tg, to = (float(p[k]) for k in ("mu", "tau_g", "tau_o"))
    x = np.linspace(-half_width, half_width, num_points)
    u, e = tg * x, to * x
    lpe = -0.5 * x**2 - 0.5 * np.log(2 * np.pi) + np.log(x[1] - x[0])  # N(e; 0, to) de
    y = np.asarray(data["y"], np.float64)[:, None, None]
    eta = mu + u[None, :, None] + e[None, None, :]
    row = logsumexp(y * eta - np.exp(eta) - gammaln(y + 1) + lpe, axis=2)  # (rows, u)
    per_group = np.zeros((_NG, num_points))
    np.add.at(per_group, data["grp"], row)
    lpu = -0.5 * x**2 - 0.5 * np.log(2 * np.pi) + np.log(x[1] - x[0])
    return -2.0 * float(np.sum(logsumexp(per_group + lpu, axis=1)))


@pytest.fixture(scope="module")
def olre_fit():
    data = _olre_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = SAEM(olre_model, schedule=Schedule(num_iters=200, num_exploration=100)).run(
            jax.random.key(0), **data)
    return res, data, _olre_exact_m2ll(res.params, data)


@pytest.mark.filterwarnings("ignore::numpyro_fed.saem.ConvergenceWarning")
def test_nested_glmm_m2ll_default_is_importance_sampling_and_its_se_is_honest(olre_fit):
    """The default -2LL (``method="auto"``) of a non-Gaussian nested model is the importance
    sampler over each connected group (6 groups of 5 latents), and its reported SE is honest
    at the fitted theta: over 10 seeds the standardised errors z = err / SE have sum of
    squares ~ chi^2_10 when honest -- outside [1.48, 29.6] with probability 0.2% (0.1% each
    side); an SE understated 2x gives chi^2 ~ 4 chi^2_10 (> 29.6 with probability 85%), a
    bias of 2 SE a noncentral sum of mean 50. Measured: |z| <= 1.23, sum 5.5."""
    res, data, exact = olre_fit
    z = []
    for seed in range(10):
        ll = res.log_likelihood(jax.random.key(seed))
        assert ll["method"] == "is" and ll["requested_method"] == "auto"
        assert 0.0 < ll["m2ll_se"] < 0.15  # useful: far below the 0.5 target of the fits
        z.append((ll["m2ll"] - exact) / ll["m2ll_se"])
    z = np.asarray(z)
    assert 1.48 <= float(np.sum(z**2)) <= 29.6, z


@pytest.mark.filterwarnings("ignore::numpyro_fed.saem.ConvergenceWarning")
def test_importance_sampling_does_not_rest_on_the_draws(olre_fit):
    """Chains stuck at one point (an E-step that stopped moving): every final draw equal.
    The proposal used to be built from the draws alone -- a point mass (its covariance 0,
    regularised to 1e-12), and the -2LL came out ~hundreds too high with an SE of a few
    units (cbpp: error +300, SE 3.6, on 10 of 10 seeds). The Laplace component at the
    conditional mode does not depend on the draws: the estimate stays within 3 SE + 0.01."""
    import copy

    res, data, exact = olre_fit
    stuck = copy.copy(res)
    stuck.z_draws = np.broadcast_to(res.z_draws[-1:, :1], res.z_draws.shape).copy()
    stuck._mode_cache = stuck._exact_cache = stuck._exact64_cache = None  # from the stuck draws
    for seed in range(3):
        ll = stuck.log_likelihood(jax.random.key(seed), method="is")
        assert abs(ll["m2ll"] - exact) <= 3 * ll["m2ll_se"] + 0.01, (ll, exact)
        assert ll["m2ll_se"] < 0.15


@pytest.mark.filterwarnings("ignore::numpyro_fed.saem.ConvergenceWarning")
def test_repeated_m2ll_calls_compile_nothing(olre_fit):
    """The -2LL programs (modes, exact check, importance rounds) compile once: another call,
    with another key and more rounds, compiles nothing."""
    from compile_count import Compiles

    res, _, _ = olre_fit
    res.log_likelihood(jax.random.key(1))
    with Compiles() as c:
        a = res.log_likelihood(jax.random.key(2))
        b = res.log_likelihood(jax.random.key(3), method="is", num_samples=5000,
                               max_samples=20_000)
        res.log_likelihood(jax.random.key(4), method="is", max_samples=5000)
    assert c.names == [], c.names
    assert a["method"] == b["method"] == "is" and b["num_samples"] >= a["num_samples"]


@pytest.mark.filterwarnings("ignore::numpyro_fed.saem.ConvergenceWarning")
def test_max_samples_below_one_round_is_refused(olre_fit):
    res, _, _ = olre_fit
    with pytest.raises(ValueError, match=r"`max_samples` \(100\) must be at least "
                                         r"`num_samples` \(500\)"):
        res.log_likelihood(jax.random.key(0), method="is", num_samples=500, max_samples=100)


@pytest.mark.filterwarnings("ignore::numpyro_fed.saem.ConvergenceWarning")
def test_untrustworthy_importance_weights_warn(olre_fit):
    """When both proposal components are wrong -- draws stuck at one point and a conditional
    curvature 10^4 times too large (a Laplace component 100x too narrow) -- the weights are
    heavy-tailed in the sample (Pareto k-hat > 0.7 after every round): the -2LL says so with
    a LikelihoodWarning naming the groups, instead of returning a confident wrong value."""
    import copy

    from numpyro_fed.saem.likelihood import PARETO_K_WARN, LikelihoodWarning

    res, data, exact = olre_fit
    bad = copy.copy(res)
    bad.z_draws = np.broadcast_to(res.z_draws[-1:, :1], res.z_draws.shape).copy()
    z, H, val, rest = res._modes()
    bad._mode_cache, bad._exact_cache = (z, H * 1e4, val, rest), None
    with pytest.warns(LikelihoodWarning, match=r"subject\(s\) \(groups\) \[.*\] have Pareto "
                                                r"k-hat up to .* \(> 0.7\) after \d+ draws"):
        ll = bad.log_likelihood(jax.random.key(0), method="is", max_samples=20_000)
    assert ll["pareto_k"] > PARETO_K_WARN and ll["rounds"] == 4
