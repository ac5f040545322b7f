"""Inter-occasion variability: simulated multiple-dose data with known truth, and the exact
marginal likelihood written independently of :mod:`numpyro_fed` (never imported here).

Design (:func:`design`): ``n`` subjects, ``occasions`` dosing periods of ``period`` hours,
one IV bolus at the start of each (100 or 200 mg) and samples at 0.5, 2, 6 and 12 h after
it; the amounts left from one period carry over into the next. Model: one compartment,

    log CL_ik = mu_CL + eta_CL_i + kappa_ik,  log V_i = mu_V + eta_V_i,
    eta ~ N(0, diag(omega_CL^2, omega_V^2)),  kappa_ik ~ N(0, omega_iov_CL^2),
    y = C + a eps,

the parameters of an occasion in force from its first record (its dose) until the first
record of the next one (NONMEM's and nlme's last-observation-carried-forward convention):
the interval between the last sample of a period and the next dose runs with the earlier
period's clearance. The predictions (:func:`predict`) propagate the amount analytically
from record to record (no matrix exponential, no superposition).

:func:`subject_loglik` integrates each subject's ``2 + occasions`` random effects by
adaptive Gauss--Hermite quadrature (the machinery of ``tests/saem_cases.py``: Newton mode,
Hessian, tensor rule in the Laplace coordinates), :func:`exact_mle` maximises the sum
(L-BFGS on the unconstrained parameters, the quadrature frame recomputed at every
evaluation). All in float64.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import saem_cases as sc
from jax.scipy.stats import norm

#: the truth of the simulated data sets
TRUTH = {"mu_CL": math.log(2.0), "mu_V": math.log(20.0), "omega_CL": 0.3, "omega_V": 0.2,
         "omega_iov_CL": 0.25, "a": 0.2}
#: sample times after each dose
SAMPLE_TIMES = (0.5, 2.0, 6.0, 12.0)
#: the order of the parameters in the unconstrained vector of :func:`exact_mle`
NAMES = ("mu_CL", "mu_V", "omega_CL", "omega_V", "omega_iov_CL", "a")
_POSITIVE = ("omega_CL", "omega_V", "omega_iov_CL", "a")


def design(n: int, occasions: int = 2, period: float = 24.0, seed: int = 0):
    """Records of one subject (the same for all) and the dose of each subject.

    :return: ``(records, amounts)``: ``records`` a list of ``(time, kind, occasion)``,
        kind ``"dose"`` or ``"obs"``, in record order; ``amounts`` ``(n,)``.
    """
    rec = []
    for k in range(occasions):
        rec.append((k * period, "dose", k))
        rec += [(k * period + s, "obs", k) for s in SAMPLE_TIMES]
    amounts = np.where(np.random.default_rng(seed + 1000).random(n) < 0.5, 100.0, 200.0)
    return rec, amounts


def predict(records, amt, cl, v):
    """Concentrations at the observation records, ``(..., n_obs)``.

    :param amt: dose amounts ``(...)`` (one per subject, every occasion).
    :param cl: clearance per occasion ``(..., occasions)``; ``v``: ``(...)``.
    """
    a = jnp.zeros_like(v)
    out = []
    prev_t, prev_occ = None, None
    for t, kind, occ in records:
        if prev_t is not None and t > prev_t:
            # the previous record's parameters govern the interval up to this record
            a = a * jnp.exp(-cl[..., prev_occ] / v * (t - prev_t))
        if kind == "dose":
            a = a + amt
        else:
            out.append(a / v)
        prev_t, prev_occ = t, occ
    return jnp.stack(out, -1)


def simulate(n: int = 40, occasions: int = 2, seed: int = 0, truth: dict | None = None):
    """A NONMEM-style table (``ID, TIME, DV, AMT, EVID, MDV, OCC``) simulated from the
    model, and the true random effects ``(eta (n, 2), kappa (n, occasions))``."""
    th = dict(TRUTH if truth is None else truth)
    rng = np.random.default_rng(seed)
    rec, amt = design(n, occasions, seed=seed)
    eta = rng.normal(size=(n, 2)) * np.array([th["omega_CL"], th["omega_V"]])
    kappa = rng.normal(size=(n, occasions)) * th["omega_iov_CL"]
    cl = np.exp(th["mu_CL"] + eta[:, :1] + kappa)
    v = np.exp(th["mu_V"] + eta[:, 1])
    with jax.enable_x64(True):
        c = np.asarray(predict(rec, jnp.asarray(amt), jnp.asarray(cl), jnp.asarray(v)))
    y = c + th["a"] * rng.normal(size=c.shape)
    rows = []
    for i in range(n):
        j = 0
        for t, kind, occ in rec:
            if kind == "dose":
                rows.append({"ID": i + 1, "TIME": t, "DV": np.nan, "AMT": amt[i], "EVID": 1,
                             "MDV": 1, "OCC": occ + 1})
            else:
                rows.append({"ID": i + 1, "TIME": t, "DV": y[i, j], "AMT": 0.0, "EVID": 0,
                             "MDV": 0, "OCC": occ + 1})
                j += 1
    df = pd.DataFrame(rows)
    return df, (eta, kappa)


def _arrays(df: pd.DataFrame):
    """Subjects' observations ``(n, n_obs)``, dose amounts ``(n,)`` and the design, read back
    from the table (every subject has the design of :func:`design`)."""
    ids = df["ID"].unique()
    obs = df[df["EVID"] == 0]
    y = np.stack([obs.loc[obs["ID"] == i, "DV"].to_numpy(np.float64) for i in ids])
    amt = np.asarray([df.loc[(df["ID"] == i) & (df["EVID"] == 1), "AMT"].iloc[0]
                      for i in ids], np.float64)
    first = df[df["ID"] == ids[0]]
    occ = first["OCC"].to_numpy()
    levels = np.unique(occ)
    rec = [(float(t), "dose" if e == 1 else "obs", int(np.searchsorted(levels, o)))
           for t, e, o in zip(first["TIME"], first["EVID"], occ, strict=True)]
    return y, amt, rec, len(levels)


def _case(df: pd.DataFrame, y32: bool = True):
    """A duck-typed case for ``saem_cases``' quadrature (``log_joint(theta, b)`` with ``b``
    ``(n, 2 + occasions)`` = ``eta_CL, eta_V, kappa_1..K`` around the typical values)."""
    y, amt, rec, K = _arrays(df)
    if y32:  # the data as the model sees them (float32)
        y = y.astype(np.float32).astype(np.float64)
    n = y.shape[0]

    def log_joint(th, b):
        eta_cl, eta_v, kap = b[:, 0], b[:, 1], b[:, 2:]
        cl = jnp.exp(th["mu_CL"] + eta_cl[:, None] + kap)
        v = jnp.exp(th["mu_V"] + eta_v)
        f = predict(rec, jnp.asarray(amt), cl, v)
        return (norm.logpdf(eta_cl, 0.0, th["omega_CL"]) + norm.logpdf(eta_v, 0.0,
                                                                        th["omega_V"])
                + jnp.sum(norm.logpdf(kap, 0.0, th["omega_iov_CL"]), -1)
                + jnp.sum(norm.logpdf(jnp.asarray(y), f, th["a"]), -1))

    return SimpleNamespace(n_subjects=n, n_re=2 + K, log_joint=log_joint,
                           re_init=lambda th: jnp.zeros((n, 2 + K)))


def _theta(params: dict) -> dict:
    return {k: jnp.asarray(float(params[k]), jnp.float64) for k in NAMES}


def subject_loglik(df: pd.DataFrame, params: dict, num_nodes: int = 7) -> np.ndarray:
    """Per-subject exact log-likelihood (AGQ, ``num_nodes`` per axis) at ``params``
    (``mu_CL, mu_V, omega_CL, omega_V, omega_iov_CL, a``)."""
    with jax.enable_x64(True):
        case = _case(df)
        th = _theta(params)
        mode, Lc = sc._laplace_frame(case, th)
        nodes, logw = sc._gh_rule(case.n_re, num_nodes)
        return np.asarray(sc._quad(case, th, mode, Lc, jnp.asarray(nodes), jnp.asarray(logw)))


def m2ll(df: pd.DataFrame, params: dict, num_nodes: int = 7) -> float:
    """Exact -2 log-likelihood at ``params``."""
    return float(-2 * np.sum(subject_loglik(df, params, num_nodes)))


def exact_mle(df: pd.DataFrame, start: dict | None = None, num_nodes: int = 5) -> dict:
    """Maximum of the exact likelihood (L-BFGS-B on ``mu``, ``log`` of the scales; the
    quadrature frame at the current point). Returns the estimates and ``"m2ll"``."""
    from scipy.optimize import minimize

    start = dict(TRUTH if start is None else start)
    with jax.enable_x64(True):
        case = _case(df)
        nodes, logw = (jnp.asarray(x) for x in sc._gh_rule(case.n_re, num_nodes))

        def theta_of(u):
            return {k: (jnp.exp(u[i]) if k in _POSITIVE else u[i])
                    for i, k in enumerate(NAMES)}

        frame = jax.jit(lambda th: sc._laplace_frame(case, th))

        @jax.jit
        def vg(u, mode, Lc):
            return jax.value_and_grad(
                lambda w: -2 * jnp.sum(sc._quad(case, theta_of(w), mode, Lc, nodes, logw)))(u)

        def fun(u):
            u = jnp.asarray(u)
            val, g = vg(u, *frame(theta_of(u)))
            return float(val), np.asarray(g, np.float64)

        u0 = np.asarray([math.log(start[k]) if k in _POSITIVE else start[k] for k in NAMES])
        res = minimize(fun, u0, jac=True, method="L-BFGS-B",
                       options={"maxiter": 500, "gtol": 1e-7, "ftol": 1e-13})
        est = {k: float(v) for k, v in theta_of(jnp.asarray(res.x)).items()}
    est["m2ll"] = float(res.fun)
    est["converged"] = bool(res.success)
    return est


def standard_errors(df: pd.DataFrame, est: dict, num_nodes: int = 5) -> dict:
    """Standard errors at ``est`` from the exact observed information (the Hessian of the
    quadrature sum, its frame fixed at ``est``), on the scale of each parameter (the scales
    by the delta method from their logarithms)."""
    with jax.enable_x64(True):
        case = _case(df)
        nodes, logw = (jnp.asarray(x) for x in sc._gh_rule(case.n_re, num_nodes))

        def theta_of(u):
            return {k: (jnp.exp(u[i]) if k in _POSITIVE else u[i])
                    for i, k in enumerate(NAMES)}

        u = jnp.asarray([math.log(est[k]) if k in _POSITIVE else est[k] for k in NAMES])
        mode, Lc = sc._laplace_frame(case, theta_of(u))
        H = jax.hessian(lambda w: -jnp.sum(sc._quad(case, theta_of(w), mode, Lc, nodes,
                                                    logw)))(u)
        cov = np.linalg.inv(np.asarray(H, np.float64))
    se = np.sqrt(np.diag(cov))
    return {k: float(se[i] * (est[k] if k in _POSITIVE else 1.0)) for i, k in enumerate(NAMES)}


#: the simulated data set of the stored reference (``tests/data/nlme_iov_reference.json``)
STORED = {"n": 30, "occasions": 2, "seed": 0}


def main(argv: list[str] | None = None) -> dict:
    """``python tests/nlme_iov_reference.py --write``: the exact maximum and standard errors
    of the stored simulated data set, to ``tests/data/nlme_iov_reference.json``."""
    import json
    import sys
    import time
    from pathlib import Path

    argv = sys.argv[1:] if argv is None else argv
    df, _ = simulate(STORED["n"], STORED["occasions"], seed=STORED["seed"])
    t0 = time.perf_counter()
    mle = exact_mle(df)
    other = exact_mle(df, start={**TRUTH, "mu_CL": 0.3, "mu_V": 2.5, "omega_iov_CL": 0.5})
    if abs(other["m2ll"] - mle["m2ll"]) > 1e-4:
        raise RuntimeError(f"two starts disagree: {mle} {other}")
    out = {**STORED, "truth": TRUTH, "mle": mle, "se": standard_errors(df, mle),
           "m2ll_truth": m2ll(df, TRUTH, 5), "num_nodes": 5,
           "m2ll_at_mle_7_nodes": m2ll(df, mle, 7),
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out, indent=1))
    if "--write" in argv:
        path = Path(__file__).resolve().parent / "data" / "nlme_iov_reference.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys_path = __import__("sys").path
    sys_path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    main()
