"""Residual error models (numpyro_fed.nlme.error): log-densities against scipy, M3 censoring,
simulation moments, gradients, NumPyro integration and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.infer.util import log_density
from scipy import integrate, stats

from numpyro_fed.nlme.error import (
    ALIASES,
    KINDS,
    CensoredLogNormal,
    CensoredNormal,
    ErrorModel,
)

PARAMS = {"a": 0.7, "b": 0.2, "sigma": 0.3}  # unprefixed values used throughout


def _params(em: ErrorModel) -> dict:
    return {em.prefix + k: v for k, v in PARAMS.items() if em.prefix + k in em.param_names}


def _scale_np(kind: str, f: np.ndarray) -> np.ndarray:
    a, b, s = PARAMS["a"], PARAMS["b"], PARAMS["sigma"]
    return {
        "additive": np.full_like(f, a),
        "proportional": b * np.abs(f),
        "combined1": a + b * np.abs(f),
        "combined2": np.sqrt(a**2 + b**2 * f**2),
        "exponential": np.full_like(f, s),
    }[kind]


def _logpdf_np(kind: str, y: np.ndarray, f: np.ndarray) -> np.ndarray:
    g = _scale_np(kind, f)
    if kind == "exponential":  # LogNormal on the observation scale (scipy's s, scale=e^mu)
        return stats.lognorm.logpdf(y, s=g, scale=f)
    return stats.norm.logpdf(y, loc=f, scale=g)


F = np.array([0.4, 1.0, 3.0, 12.0])
Y = np.array([0.5, 0.8, 3.7, 10.1])


# ------------------------------------------------------------------------------ construction
def test_kinds_aliases_param_names_and_repr():
    assert KINDS == ("additive", "proportional", "combined1", "combined2", "exponential")
    names = {"additive": ("conc_a",), "proportional": ("conc_b",),
             "combined1": ("conc_a", "conc_b"), "combined2": ("conc_a", "conc_b"),
             "exponential": ("conc_sigma",)}
    for kind, expected in names.items():
        em = ErrorModel(kind, prefix="conc_")
        assert em.kind == kind and em.param_names == expected
        assert repr(em).startswith(f"ErrorModel({kind!r}, prefix='conc_'")
    for alias, kind in ALIASES.items():
        assert ErrorModel(alias.upper()).kind == kind  # case-insensitive
    assert ErrorModel("combined2").init == {"a": 1.0, "b": 0.1}
    assert ErrorModel("exponential").init == {"sigma": 0.1}
    # init by bare or prefixed name
    assert ErrorModel("combined1", prefix="p_", init={"a": 2.0, "p_b": 0.3}).init == {
        "p_a": 2.0, "p_b": 0.3}


# ------------------------------------------------------------------------------ densities
@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_scale_residuals_match_hand_formulas(kind, x64):
    em = ErrorModel(kind, prefix="y_")
    p = _params(em)
    f, y = jnp.asarray(F), jnp.asarray(Y)
    d = em.dist(f, p)
    assert type(d) is (dist.LogNormal if kind == "exponential" else dist.Normal)
    assert d.batch_shape == F.shape
    # float64 throughout: agreement with scipy to rounding (1e-12 relative)
    np.testing.assert_allclose(d.log_prob(y), _logpdf_np(kind, Y, F), rtol=1e-12)
    np.testing.assert_allclose(em.scale(f, p), _scale_np(kind, F), rtol=1e-14)
    res = (np.log(Y) - np.log(F)) if kind == "exponential" else (Y - F)
    np.testing.assert_allclose(em.residuals(y, f, p), res / _scale_np(kind, F), rtol=1e-12)
    # a censored entry has no residual
    r = em.residuals(y, f, p, cens=np.array([True, False, False, False]))
    assert np.isnan(r[0]) and np.all(np.isfinite(r[1:]))
    # scale broadcasts a scalar parameter to f's shape
    assert em.scale(jnp.ones((2, 3)), p).shape == (2, 3)


def test_additive_dist_is_the_normal_saem_recognises():
    from numpyro_fed.saem.mstep import unwrap_normal

    em = ErrorModel("additive")
    d = em.dist(jnp.asarray(F), {"a": 0.5}).mask(jnp.array([True, True, False, True]))
    loc, scale, m = unwrap_normal(d, jnp.asarray(Y))
    np.testing.assert_allclose(loc, F, rtol=1e-6)
    np.testing.assert_allclose(scale, 0.5)
    assert m.tolist() == [True, True, False, True]


def test_exponential_is_on_the_observation_scale(x64):
    em = ErrorModel("exponential")
    p = {"sigma": 0.3}
    f = 2.5
    lp = jax.jit(lambda y: em.dist(f, p).log_prob(y))
    # -2LL on the observation scale: the log-scale Normal density of log y minus log y
    ys = np.array([0.3, 1.0, 2.5, 7.0])
    np.testing.assert_allclose(
        lp(ys), stats.norm.logpdf(np.log(ys), np.log(f), 0.3) - np.log(ys), rtol=1e-12)
    # a density of y: integrates to 1 over y > 0 (quad's error estimate is < 1e-8)
    total, err = integrate.quad(lambda y: float(np.exp(lp(y))), 0.0, np.inf, limit=200)
    assert abs(total - 1.0) < 1e-8 and err < 1e-8


def test_zero_scale_and_nonpositive_prediction():
    """Proportional error has g(0) = 0: refused when f is known, NaN under jit (documented;
    nothing floored silently); the combined models are finite and differentiable at f = 0."""
    f = jnp.array([0.0, 1.0])
    y = jnp.array([0.1, 1.1])
    prop = ErrorModel("proportional")
    with pytest.raises(ValueError, match=r"zero or NaN at 1 entries at index 0.*combined2"):
        prop.dist(f, {"b": 0.2})
    lp = jax.jit(lambda f: prop.dist(f, {"b": 0.2}).log_prob(y))(f)
    assert np.isnan(lp[0]) and np.isfinite(lp[1])
    with pytest.raises(ValueError, match=r"needs predictions f > 0.*at 1 entries at index 0"):
        ErrorModel("exponential").dist(f, {"sigma": 0.1})
    lp = jax.jit(lambda f: ErrorModel("exponential").dist(f, {"sigma": 0.1}).log_prob(1.1))(
        jnp.array([0.0, -1.0, 1.0]))
    assert lp[0] == -np.inf and np.isnan(lp[1]) and np.isfinite(lp[2])  # f = 0, f < 0
    for kind in ("additive", "combined1", "combined2"):
        em = ErrorModel(kind)
        p = _params(em)

        def total(f, p, em=em):
            return em.dist(f, p).log_prob(y).sum()

        assert np.all(np.isfinite(total(f, p)))
        g_f, g_p = jax.grad(total, argnums=(0, 1))(f, p)
        h = jax.jacfwd(jax.grad(total))(f, p)  # forward-over-reverse Hessian in f
        assert np.all(np.isfinite(g_f)) and np.all(np.isfinite(h))
        assert all(np.isfinite(v) for v in g_p.values())


@pytest.mark.parametrize("kind", ["proportional", "exponential"])
def test_padded_observation_slots_are_outside_the_prediction_checks(kind):
    """Phenobarb has 1-6 samples per subject: the shorter subjects' padded slots (time 0,
    before every dose: f = 0) were refused by the f = 0 checks of these error models (the
    fit raised on 199 padded "observations"), and would give NaN gradients. They are masked
    out: the model's log-density and its gradient are finite, and equal those of the real
    observations alone; a real observation at f = 0 is still refused."""
    from numpyro_fed import nlme

    data = nlme.load_phenobarb()
    assert not np.all(data.obs.mask)  # padded slots exist
    pk = nlme.PKModel(nlme.one_compartment(absorption=None),
                      params={"CL": nlme.Param(0.005), "V": nlme.Param(1.0)}, error=kind)
    kw = pk.arrays(data)
    tr = handlers.trace(handlers.seed(pk.model, 0)).get_trace(**kw)  # raised before
    values = {k: v["value"] for k, v in tr.items() if v["type"] in ("sample", "param")
              and not v.get("is_observed", False)}

    def lp(phi_cl):
        return log_density(pk.model, (), kw, {**values, "phi_CL": phi_cl})[0]

    val, grad = jax.value_and_grad(lp)(values["phi_CL"])
    assert np.isfinite(val) and np.all(np.isfinite(grad))
    # the padded slots' prediction is 1 (the real ones' are positive), and the observed
    # site's density is the real observations' alone, finite
    site = tr["dv"]
    m = np.asarray(kw["obs_mask"], bool)
    base = site["fn"].base_dist.base_dist  # Independent(Masked(Normal | LogNormal))
    f = np.asarray(base.loc if kind == "proportional" else np.exp(base.loc))
    assert np.all(f[~m] == 1.0) and np.all(f[m] > 0)
    per_entry = np.asarray(base.log_prob(site["value"]), np.float64)
    np.testing.assert_allclose(np.asarray(site["fn"].log_prob(site["value"])),
                               np.where(m, per_entry, 0.0).sum(1), rtol=1e-5)
    assert np.all(np.isfinite(per_entry[m]))
    # a real observation before the first dose (f = 0) is still refused, by name
    kw0 = dict(kw, obs_time=np.where(np.arange(m.shape[1]) == 0, -1.0,
                                     np.asarray(kw["obs_time"])).astype(np.float32))
    with pytest.raises(ValueError, match=r"at 59 entries at subject 1, row 1, "):
        handlers.trace(handlers.seed(pk.model, 0)).get_trace(**kw0)


# ------------------------------------------------------------------------------ simulation
@pytest.mark.parametrize("kind", KINDS)
def test_sample_moments(kind, x64):
    em = ErrorModel(kind)
    p = _params(em)
    n = 100_000
    f = jnp.full((n,), 3.0)
    y = np.asarray(em.sample(jax.random.PRNGKey(0), f, p))
    assert y.shape == (n,)
    g = float(_scale_np(kind, np.array([3.0]))[0])
    # standardised residuals eps ~ N(0, 1): the sample mean has Monte Carlo standard error
    # 1/sqrt(n), the sample variance sqrt(2/n); both must be within 4 standard errors
    # (a two-sided 6e-5 false-alarm probability each, for a fixed seed: deterministic).
    eps = (np.log(y) - np.log(3.0)) / g if kind == "exponential" else (y - 3.0) / g
    assert abs(eps.mean()) < 4 / np.sqrt(n)
    assert abs(eps.var() - 1.0) < 4 * np.sqrt(2 / n)
    if kind == "exponential":  # the observation-scale mean f exp(sigma^2/2)
        mean, sd = 3.0 * np.exp(g**2 / 2), 3.0 * np.sqrt((np.exp(g**2) - 1) * np.exp(g**2))
        assert abs(y.mean() - mean) < 4 * sd / np.sqrt(n)
        assert np.all(y > 0)


# ------------------------------------------------------------------------------ M3 censoring
@pytest.mark.parametrize("kind", KINDS)
def test_m3_mixture_matches_scipy(kind, x64):
    em = ErrorModel(kind)
    p = _params(em)
    cens = np.array([True, False, True, False])
    lloq = np.array([0.6, np.nan, 2.0, 0.0])  # read at censored entries only
    y = np.where(cens, 0.0, Y)  # BLQ rows often carry DV = 0: not used
    d = em.dist(jnp.asarray(F), p, cens=cens, lloq=lloq)
    assert type(d) is (CensoredLogNormal if kind == "exponential" else CensoredNormal)
    assert d.batch_shape == F.shape
    g = _scale_np(kind, F)
    if kind == "exponential":
        cdf = stats.norm.logcdf((np.log(np.where(cens, lloq, 1.0)) - np.log(F)) / g)
    else:
        cdf = stats.norm.logcdf((np.where(cens, lloq, 0.0) - F) / g)
    expected = np.where(cens, cdf, _logpdf_np(kind, np.where(cens, 1.0, Y), F))
    lp = d.log_prob(jnp.asarray(y))
    np.testing.assert_allclose(lp, expected, rtol=1e-12)
    # the gradient sees neither the unused DVs nor the unused LLOQs (no NaN leaks)
    g_f = jax.grad(lambda f: em.dist(f, p, cens=cens, lloq=lloq).log_prob(y).sum())(
        jnp.asarray(F))
    assert np.all(np.isfinite(g_f))
    # uncensored entries: exactly the plain distribution's log-density
    np.testing.assert_allclose(lp[~cens], em.dist(jnp.asarray(F), p).log_prob(Y)[~cens],
                               rtol=1e-14)


def test_m3_far_tail_is_finite_and_accurate(x64):
    f, a, lloq = 31.0, 1.0, 1.0  # z = (lloq - f)/a = -30: Phi(z) ~ 5e-198
    em = ErrorModel("additive")
    lp = lambda f: em.dist(f, {"a": a}, cens=True, lloq=lloq).log_prob(0.0)
    ref = stats.norm.logcdf(-30.0)  # -454.32...
    # log_ndtr's asymptotic series: relative error ~1e-15 in float64
    np.testing.assert_allclose(lp(f), ref, rtol=1e-12)
    # d/df log Phi((lloq - f)/a) = -phi(z)/Phi(z)/a: the inverse Mills ratio, ~ -z
    mills = np.exp(stats.norm.logpdf(-30.0) - ref)
    # (jax differentiates a truncated asymptotic series there: relative error 1.6e-10 seen)
    np.testing.assert_allclose(jax.grad(lp)(f), -mills, rtol=1e-9)
    # exponential: z = (log lloq - log f)/sigma = -30
    sigma = 0.1
    f_exp = np.exp(3.0)
    lpe = ErrorModel("exponential").dist(f_exp, {"sigma": sigma}, cens=True, lloq=1.0)
    np.testing.assert_allclose(lpe.log_prob(0.0), ref, rtol=1e-10)


def test_m3_far_tail_float32():
    lp = ErrorModel("additive").dist(31.0, {"a": 1.0}, cens=True, lloq=1.0).log_prob(0.0)
    assert lp.dtype == jnp.float32
    # float32 log_ndtr: relative error ~1e-6
    np.testing.assert_allclose(lp, stats.norm.logcdf(-30.0), rtol=1e-5)


@pytest.mark.parametrize("kind", ["combined2", "exponential"])
def test_m3_total_probability_is_one(kind, x64):
    """P(Y < lloq) (the censored entry's likelihood) + integral of the density above lloq
    = 1: the M3 likelihood is a proper distribution over the observation space."""
    em = ErrorModel(kind)
    p = _params(em)
    f, lloq = 1.3, 0.9
    mass = float(np.exp(em.dist(f, p, cens=True, lloq=lloq).log_prob(0.0)))
    dens = jax.jit(lambda y: em.dist(f, p, cens=False, lloq=lloq).log_prob(y))
    above, _ = integrate.quad(lambda y: float(np.exp(dens(y))), lloq, np.inf, limit=200)
    assert 0.1 < mass < 0.9  # a genuine split between the two parts
    # quad's error estimate is ~1e-8; the sum is 1 to ~1e-15 (measured)
    assert abs(mass + above - 1.0) < 1e-8


def test_m3_under_jit_vmap_grad_plate_and_mask(x64):
    em = ErrorModel("combined2", prefix="c_")
    p = _params(em)
    n_subj, n_obs = 3, 4
    f = jnp.asarray(np.linspace(0.2, 5.0, n_subj * n_obs).reshape(n_subj, n_obs))
    cens = np.zeros((n_subj, n_obs), bool)
    cens[:, -1] = True
    lloq = np.full((n_subj, n_obs), 0.5)
    y = jnp.asarray(np.asarray(f) * 1.1)

    def per_subject(f_i, c_i, q_i, y_i, p):
        return em.dist(f_i, p, cens=c_i, lloq=q_i).log_prob(y_i).sum()

    eager = sum(per_subject(f[i], cens[i], lloq[i], y[i], p) for i in range(n_subj))
    vm = jax.jit(jax.vmap(per_subject, in_axes=(0, 0, 0, 0, None)))(f, cens, lloq, y, p)
    np.testing.assert_allclose(vm.sum(), eager, rtol=1e-12)
    # grad in the parameters against central finite differences (step 1e-6: error ~1e-9)
    tot = jax.jit(lambda p: jax.vmap(per_subject, (0, 0, 0, 0, None))(
        f, cens, lloq, y, p).sum())
    grad = jax.grad(tot)(p)
    for k in p:
        h = 1e-6
        fd = (tot({**p, k: p[k] + h}) - tot({**p, k: p[k] - h})) / (2 * h)
        np.testing.assert_allclose(grad[k], fd, rtol=1e-6)
    hess = jax.jacfwd(jax.grad(tot))(p)
    assert all(np.isfinite(hess[i][j]) for i in p for j in p)

    # inside plates and handlers.mask: the site's log-likelihood is the masked sum
    keep = np.ones((n_subj, n_obs), bool)
    keep[1, :2] = False

    def model(y):
        pp = em.params()
        with numpyro.plate("id", n_subj, dim=-2), numpyro.plate("t", n_obs, dim=-1):
            with handlers.mask(mask=keep):
                numpyro.sample("y", em.dist(f, pp, cens=cens, lloq=lloq), obs=y)

    ll, _ = log_density(model, (y,), {}, p)
    full = em.dist(f, p, cens=cens, lloq=lloq).log_prob(y)
    np.testing.assert_allclose(ll, jnp.where(keep, full, 0.0).sum(), rtol=1e-12)
    # traced cens (boolean) works under jit as well
    jl = jax.jit(lambda c: em.dist(f, p, cens=c, lloq=lloq).log_prob(y).sum())(cens)
    np.testing.assert_allclose(jl, full.sum(), rtol=1e-12)


def test_censored_distribution_is_a_pytree_and_samples_uncensored():
    d = CensoredNormal(jnp.zeros(3), 2.0, 0.0, jnp.array([True, False, True]))
    leaves, tree = jax.tree_util.tree_flatten(d)
    d2 = jax.tree_util.tree_unflatten(tree, leaves)
    np.testing.assert_allclose(d2.log_prob(jnp.ones(3)), d.log_prob(jnp.ones(3)))
    assert d.sample(jax.random.PRNGKey(1), (5,)).shape == (5, 3)
    assert CensoredNormal.infer_shapes((3,), (), (), (2, 1)) == ((2, 3), ())
    assert CensoredLogNormal(0.0, 1.0, 1.0, False).support is constraints.positive
    assert d.expand((4, 3)).batch_shape == (4, 3)
    ln = CensoredLogNormal(jnp.zeros(4), 0.5, 0.5, jnp.array([True, False, False, False]))
    assert np.all(ln.sample(jax.random.PRNGKey(2), (100,)) > 0)


# ------------------------------------------------------------------------------ NumPyro model
def test_params_are_positive_numpyro_param_sites():
    em_c = ErrorModel("combined2", prefix="conc_", init={"a": 0.05})
    em_e = ErrorModel("exponential", prefix="eff_")
    t = jnp.array([0.5, 1.0, 2.0, 4.0])
    cens = jnp.array([False, False, False, True])

    def model(y_c=None, y_e=None):
        pc, pe = em_c.params(), em_e.params()
        f = 10.0 * jnp.exp(-0.3 * t)
        with numpyro.plate("obs", t.shape[0]):
            numpyro.sample("conc", em_c.dist(f, pc, cens=cens, lloq=3.5), obs=y_c)
            numpyro.sample("eff", em_e.dist(f, pe), obs=y_e)

    tr = handlers.trace(handlers.seed(model, 0)).get_trace()
    for name, init in (("conc_a", 0.05), ("conc_b", 0.1), ("eff_sigma", 0.1)):
        site = tr[name]
        assert site["type"] == "param"
        assert site["kwargs"]["constraint"] is constraints.positive
        np.testing.assert_allclose(site["value"], init, rtol=1e-7)
    assert isinstance(tr["conc"]["fn"], CensoredNormal)
    assert tr["conc"]["value"].shape == (4,) and tr["eff"]["value"].shape == (4,)
    assert np.all(tr["eff"]["value"] > 0)


# ------------------------------------------------------------------------------ errors
def test_unknown_kind_and_bad_arguments():
    with pytest.raises(ValueError, match="unknown kind 'gaussian'.*additive, proportional, "
                       "combined1, combined2, exponential.*'prop' -> 'proportional'"):
        ErrorModel("gaussian")
    with pytest.raises(ValueError, match="'combined' is ambiguous.*combined1.*combined2"):
        ErrorModel("combined")
    with pytest.raises(TypeError, match="`kind` must be a string"):
        ErrorModel(3)
    with pytest.raises(ValueError, match=r"unknown `init` key\(s\) \['c'\].*\['conc_a'\]"):
        ErrorModel("additive", prefix="conc_", init={"c": 1.0})
    with pytest.raises(ValueError, match="positive finite.*a=-1.0.*b=nan"):
        ErrorModel("combined1", init={"a": -1.0, "b": float("nan")})
    with pytest.raises(ValueError, match="positive finite.*sigma=0"):
        ErrorModel("exponential", init={"sigma": 0})
    with pytest.raises(ValueError, match="'p_a' twice"):
        ErrorModel("additive", prefix="p_", init={"a": 1.0, "p_a": 2.0})
    with pytest.raises(ValueError, match=r"`params` lacks \['b'\]"):
        ErrorModel("combined2").scale(1.0, {"a": 1.0})
    em = ErrorModel("additive")
    with pytest.raises(ValueError, match="`cens` given without `lloq`"):
        em.dist(1.0, {"a": 1.0}, cens=True)
    with pytest.raises(ValueError, match="`lloq` given without `cens`"):
        em.dist(1.0, {"a": 1.0}, lloq=0.1)
    with pytest.raises(ValueError, match="CENS = -1"):
        em.dist(jnp.ones(3), {"a": 1.0}, cens=np.array([0, -1, 1]), lloq=0.1)
    with pytest.raises(TypeError, match="traced array of dtype float32.*boolean"):
        jax.jit(lambda c: em.dist(jnp.ones(3), {"a": 1.0}, cens=c, lloq=0.1).log_prob(0.0))(
            jnp.zeros(3))
    with pytest.raises(ValueError, match="`lloq` is NaN or infinite at 1 censored"):
        em.dist(jnp.ones(2), {"a": 1.0}, cens=[True, True], lloq=[0.1, np.nan])


def test_check_observations_messages():
    exp = ErrorModel("exponential")
    dv = np.array([[1.0, 0.0, 2.0], [-0.5, 3.0, 4.0]])
    with pytest.raises(ValueError, match=r"dv > 0.*2 uncensored observation\(s\) are <= 0 "
                       r"at index \(row, column, \.\.\.\) \(0, 1\), \(1, 0\).*combined2.*M3"):
        exp.check_observations(dv)
    # censored or masked, they are fine (their DV is not used)
    exp.check_observations(dv, cens=dv <= 0, lloq=0.1)
    exp.check_observations(dv, mask=dv > 0)
    # labels name the rows
    with pytest.raises(ValueError, match="1 uncensored observation.*at ID 2 TIME 0"):
        exp.check_observations(dv, mask=dv != 0,
                               labels=np.array([[f"ID {i} TIME {j}" for j in range(3)]
                                                for i in (1, 2)]))
    add = ErrorModel("additive")
    add.check_observations(dv)  # non-positive DVs are fine for additive error
    with pytest.raises(ValueError, match=r"NaN or infinite at 1 uncensored.*index 2.*MDV"):
        add.check_observations(np.array([1.0, 2.0, np.nan]))
    add.check_observations(np.array([1.0, 2.0, np.nan]), cens=[0, 0, 1], lloq=0.5)
    add.check_observations(np.array([1.0, 2.0, np.nan]), mask=[1, 1, 0])
    with pytest.raises(ValueError, match="lloq <= 0 at 1 of them at index 0"):
        exp.check_observations(np.array([0.0, 2.0]), cens=[True, False], lloq=[0.0, 0.0])
    with pytest.raises(ValueError, match="lloq > 0"):  # also refused when building the dist
        exp.dist(jnp.ones(2), {"sigma": 0.1}, cens=np.array([True, False]), lloq=0.0)
    with pytest.raises(ValueError, match=r"marks 1 observation\(s\) below the LLOQ but `lloq`"):
        add.check_observations(np.array([1.0, 2.0]), cens=[True, False])
    with pytest.raises(ValueError, match="CENS = -1"):
        add.check_observations(np.array([1.0, 2.0]), cens=[-1, 0], lloq=0.1)
    with pytest.raises(ValueError, match="do not broadcast.*dv \\(3,\\).*cens \\(2,\\)"):
        add.check_observations(np.ones(3), cens=[True, False], lloq=0.1)
