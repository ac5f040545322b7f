"""Diagnostics of multiple-dose fits (issue 29) and time-varying covariates.

- time after dose (TAD): hand-made records and Quinidine (``nlme/Quinidine``);
- the LOWESS trend line of the goodness-of-fit panels;
- the time grid of the individual fits (peaks between samples resolved);
- subjects selected by their ID in the tables and plots;
- time-varying covariates: the parameters in force at each record (LOCF), the amounts
  advanced record by record (``numpyro_fed.nlme.timevarying``) against the closed forms
  (constant parameters) and against an ODE solution (``diffrax``) with piecewise-constant
  parameters; no ``_mode`` column for a parameter without a random effect.

The fit shared by most tests is a short SAEM run on a simulated multiple-dose table (16
subjects, one steady-state dose then three doses, ``GLYCO`` changing within subjects);
matplotlib renders with the Agg backend.
"""

import diffrax
import jax
import jax.extend.core
import jax.numpy as jnp
import matplotlib
import numpy as np
import pandas as pd
import pytest

from numpyro_fed import nlme
from numpyro_fed.nlme.data import Doses
from numpyro_fed.nlme.pk import compartment_model
from numpyro_fed.nlme.timevarying import predict_piecewise
from numpyro_fed.saem import Schedule

matplotlib.use("Agg")

pytestmark = pytest.mark.xdist_group("nlme")

TRUE = {"mu_CL": np.log(4.0), "mu_V": np.log(40.0), "mu_KA": np.log(1.5),
        "beta_CL_GLYCO": -0.6, "beta_KA_WT": 0.5, "b": 0.1}
SAMPLES = (1.0, 2.0, 4.0, 12.0, 25.0, 26.5, 30.0, 36.0, 37.0, 40.0, 403.0)
DOSES = (0.0, 12.0, 24.0, 36.0, 400.0)


def _table(n: int = 16, seed: int = 0, dv=None) -> pd.DataFrame:
    """A multiple-dose oral design: a steady-state dose (II 12) at 0, doses at 12, 24, 36
    and, much later, 400 (a long history: the peaks are narrow on its time scale);
    samples at SAMPLES (the one at 12 and at 36 recorded before the dose at that time: a
    trough); GLYCO changes at 24 h (at the dose record) within each subject; WT constant."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        g0 = float(rng.uniform(0.6, 1.4))
        g1 = g0 + float(rng.uniform(0.4, 1.0))
        wt = float(rng.uniform(50, 90))
        ev = [(s, 0) for s in SAMPLES] + [(d, 1) for d in DOSES]
        ev.sort(key=lambda e: (e[0], e[1]))  # a sample before a dose at the same time
        for t, is_dose in ev:
            rows.append({"ID": 101 + 3 * i, "TIME": t, "DV": 0.0 if is_dose else 1.0,
                         "AMT": 200.0 if is_dose else 0.0, "EVID": is_dose, "MDV": is_dose,
                         "CMT": 1 if is_dose else 2, "SS": int(is_dose and t == 0),
                         "II": 12.0 if (is_dose and t == 0) else 0.0,
                         "GLYCO": g0 if t < 24 else g1, "WT": wt})
    df = pd.DataFrame(rows)
    if dv is not None:
        df.loc[df.EVID == 0, "DV"] = dv
    return df


def _pk(tv: bool = True):
    """The model of the simulation (``tv``: GLYCO, time-varying, on CL), or the same
    without GLYCO (closed forms: fast, for the diagnostics tests)."""
    return nlme.PKModel(
        nlme.one_compartment("first_order"),
        params={"CL": nlme.Param(3.0, covariates={"GLYCO": "linear"} if tv else {}),
                "V": nlme.Param(30.0),
                "KA": nlme.Param(1.0, random=False, covariates={"WT": "power"})},
        error="proportional")


def _simulate(seed: int = 1):
    """DV from the model at TRUE (omega 0.3 on CL and V), through the layer's own
    predictions (those are checked against the ODE solution below)."""
    data = nlme.PKDataset.from_dataframe(_table(), covariates=["GLYCO", "WT"])
    pk = _pk()
    a = pk.arrays(data)
    b = a["binding"]
    rng = np.random.default_rng(seed)
    n = data.n_subjects
    covs = {"WT": jnp.asarray(a["cov_WT"])}
    th = dict(TRUE)
    phi = {"CL": TRUE["mu_CL"] + 0.3 * rng.normal(size=n),
           "V": TRUE["mu_V"] + 0.3 * rng.normal(size=n),
           "KA": np.asarray(pk.typical("KA", covs, th, binding=b))}
    doses = Doses(*(jnp.asarray(a[k]) for k in ("dose_time", "dose_amt", "dose_rate",
                                                "dose_cmt", "dose_ss", "dose_ii",
                                                "dose_mask")))

    @jax.jit  # compiled: dispatched op by op, the piecewise prediction takes 3-4x longer
    def predict(phi, tvo, tvd, th):
        at = pk.record_parameters(phi, tvo, tvd, th, binding=b)
        return pk.predict(None, jnp.asarray(a["obs_time"]), doses, a["doses_before"],
                          binding=b, at_records=at)

    f = np.asarray(predict({k: jnp.asarray(v) for k, v in phi.items()},
                           {"GLYCO": jnp.asarray(a["tvo_GLYCO"])},
                           {"GLYCO": jnp.asarray(a["tvd_GLYCO"])}, th))
    m = np.asarray(data.obs.mask)
    y = f * (1 + TRUE["b"] * rng.normal(size=f.shape))
    return nlme.PKDataset.from_dataframe(_table(dv=y[m]), covariates=["GLYCO", "WT"])


@pytest.fixture(scope="module")
def md_fit():
    """A fast fit for the diagnostics: the model without the GLYCO effect."""
    return _pk(tv=False).fit(_simulate(), jax.random.key(0),
                             schedule=Schedule(num_iters=100, num_exploration=60))


# ----------------------------------------------------------------------------- TAD
def test_time_after_dose_by_hand():
    """Record order (a trough before a dose at the same time counts from the dose
    before), a steady-state dose (its implied doses precede it), a sample before every
    dose (negative), a subject without doses (its times), padding (NaN)."""
    df = pd.DataFrame({
        "ID":   [1, 1, 1, 1, 1, 1, 1, 2, 2],
        "TIME": [0.0, 1.0, 4.0, 13.0, 13.0, 14.5, 41.0, 1.0, 2.0],
        "DV":   [0.1, 0, 2.0, 1.0, 0, 3.0, 0.5, 1.0, 2.0],
        "AMT":  [0, 100, 0, 0, 100, 0, 0, 0, 0],
        "EVID": [0, 1, 0, 0, 1, 0, 0, 0, 0],
        "SS":   [0, 1, 0, 0, 0, 0, 0, 0, 0],
        "II":   [0, 12, 0, 0, 0, 0, 0, 0, 0],
    })
    data = nlme.PKDataset.from_dataframe(df)
    tad = nlme.time_after_dose(data)
    np.testing.assert_allclose(tad[0], [-1.0, 3.0, 12.0, 1.5, 28.0])
    # subject 1's pre-dose sample is recorded before the dose at 13: doses_before says so
    assert data.doses_before[0].tolist() == [0, 1, 1, 2, 2]
    np.testing.assert_allclose(tad[1, :2], [1.0, 2.0])
    assert np.all(np.isnan(tad[1, 2:]))


def test_time_after_dose_quinidine():
    """Quinidine (136 subjects, 1028 doses, 361 samples): TAD recomputed row by row from
    the raw table, the dose rows before each sample in the file's order."""
    data = nlme.load_quinidine(np.float64)
    assert (data.n_subjects, data.n_obs, data.n_doses) == (136, 361, 1028)
    assert "GLYCO" in data.time_varying
    tad = nlme.time_after_dose(data)
    raw = nlme.data._quinidine_frame()
    expect = {}
    for sid, g in raw.groupby("ID", sort=True):
        last = None
        out = []
        for _, r in g.iterrows():
            if r.EVID == 1:
                last = r.TIME
            elif r.EVID == 0:
                out.append(r.TIME - last)
        expect[sid] = out
    for i, sid in enumerate(data.ids):
        m = data.obs.mask[i]
        np.testing.assert_allclose(tad[i][m], expect[sid], atol=1e-9)
    assert np.nanmin(tad) > 0 and np.nanmax(tad) <= 72


# ----------------------------------------------------------------------------- LOWESS
def _lowess_loop(x, y, at, frac, iterations):
    n = len(x)
    k = int(np.ceil(frac * n))

    def fit1(x0, rw):
        d = np.abs(x - x0)
        h = np.sort(d)[k - 1] * (1 + 1e-12)
        w = np.clip(1 - (d / h) ** 3, 0, None) ** 3 * rw
        c = np.polyfit(x, y, 1, w=np.sqrt(w))
        return np.polyval(c, x0)

    rw = np.ones(n)
    for _ in range(iterations - 1):
        r = y - np.array([fit1(v, rw) for v in x])
        s = np.median(np.abs(r))
        rw = np.clip(1 - (r / (6 * s)) ** 2, 0, None) ** 2
    return np.array([fit1(v, rw) for v in at])


def test_lowess():
    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(0, 10, 200))
    # a straight line is reproduced exactly (local linear fits), an outlier is ignored by
    # the robustness steps
    y = 2.0 - 0.3 * x
    y_out = y.copy()
    y_out[100] += 50.0
    xs, ys = nlme.lowess(x, y_out)
    np.testing.assert_allclose(ys, 2.0 - 0.3 * xs, atol=1e-8)
    # a smooth curve under noise sd 0.2, away from the edges (where a local line is biased):
    # the local fits over 1/3 of 400 points average ~130 values (noise sd ~0.03, x5) and a
    # curvature bias up to ~0.1 at the extrema: 0.15 max
    x = np.sort(rng.uniform(0, 2 * np.pi, 400))
    y = np.sin(x) + 0.2 * rng.normal(size=400)
    xs, ys = nlme.lowess(x, y, frac=1 / 3)
    inner = (xs > 1.0) & (xs < 2 * np.pi - 1.0)
    assert np.max(np.abs(ys - np.sin(xs))[inner]) < 0.15
    # the same as Cleveland's algorithm written point by point (np.polyfit, weights)
    np.testing.assert_allclose(ys, _lowess_loop(x, y, xs, 1 / 3, 3), atol=1e-9)
    assert len(nlme.lowess([1.0, 1.0, 1.0], [1, 2, 3])[0]) == 0
    with pytest.raises(ValueError, match="frac=0"):
        nlme.lowess(x, x, frac=0)


# ----------------------------------------------------------------------------- piecewise
def _doses(ncmt, rates=(0.0, 25.0, 0.0, 0.0, 20.0, 0.0, 0.0), ss_ii=6.0):
    return Doses(time=np.array([0.0, 2.0, 5.0, 12.0, 15.0, 25.0, 0.0]),
                 amt=np.array([100.0, 50.0, 80.0, 60.0, 40.0, 70.0, 0.0]),
                 rate=np.asarray(rates), cmt=np.array([1, ncmt, 1, 1, 1, 1, 1]),
                 ss=np.array([0, 0, 0, 1, 0, 0, 0], bool),
                 ii=np.array([0, 0, 0, ss_ii, 0, 0, 0]),
                 mask=np.array([1, 1, 1, 1, 1, 1, 0], bool))


P = {"CL": 3.0, "V": 20.0, "KA": 1.2, "Q": 4.0, "V2": 50.0, "Q3": 1.5, "V3": 120.0, "F": 0.7}
T_OBS = np.array([0.5, 1.0, 3.0, 8.0, 12.0, 14.0, 20.0, 30.0, 30.0, 30.0])


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("absorption", ["first_order", None])
def test_piecewise_equals_closed_form_for_constant_parameters(n, absorption):
    """With the same parameters at every record, advancing the amounts record by record
    is the closed-form superposition (boluses, infusions, a steady-state bolus and a
    steady-state infusion, F): float64 round-off, 1e-12 relative."""
    with jax.enable_x64(True):
        m = compartment_model(n, absorption)
        p = {k: jnp.asarray(P[k]) for k in (*m.param_names, "F")}
        po = {k: jnp.full(len(T_OBS), v) for k, v in p.items()}
        pd_ = {k: jnp.full(7, v) for k, v in p.items()}
        ncmt = len(m.compartments)
        for d in (_doses(ncmt), _doses(ncmt, rates=(0.0, 25.0, 0.0, 30.0, 20.0, 0.0, 0.0))):
            d = d._replace(cmt=np.where(np.arange(7) == 3, ncmt if d.rate[3] else 1,
                                        d.cmt))
            # compiled (dispatching the operations one by one compiles each: 3-4x slower)
            ref = np.asarray(jax.jit(lambda p, d=d: m(p, jnp.asarray(T_OBS), d))(p))
            out = np.asarray(jax.jit(lambda po, pd_, d=d: predict_piecewise(
                m, po, pd_, T_OBS, d))(po, pd_))
            np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)


def _ode_piecewise(n, absorption, t_obs, doses, p_at):
    """Independent reference: diffrax (Tsit5, rtol 1e-11) from event to event, the
    parameters of the last record in force (``p_at(k)``, k the index of the record in the
    merged, time-sorted list), boluses as jumps, infusions as inputs; then C = A_c / V."""
    m = compartment_model(n, absorption)
    S = n + (absorption is not None)
    c = int(absorption is not None)
    recs = sorted([(float(t), 1, j) for j, t in enumerate(t_obs)]
                  + [(float(doses.time[k]), 0, k) for k in range(len(doses.time))
                     if doses.mask[k]])
    # an infusion into compartment 1 lasts F amt / rate (F in force at its record)
    f_at = {j: p_at(i).get("F", 1.0) if doses.cmt[j] == m.default_dose_cmt else 1.0
            for i, (_, kind, j) in enumerate(recs) if kind == 0}
    infs = [(doses.time[k], doses.time[k] + f_at[k] * doses.amt[k] / doses.rate[k],
             doses.rate[k], doses.cmt[k] - 1) for k in range(len(doses.time))
            if doses.mask[k] and doses.rate[k] > 0]

    def rhs(t, A, q):
        k10, M = q["CL"] / q["V"], jnp.zeros((S, S))
        M = M.at[c, c].add(-k10)
        for j, (qq, vv) in enumerate((("Q", "V2"), ("Q3", "V3"))[: n - 1]):
            a1, a2 = q[qq] / q["V"], q[qq] / q[vv]
            M = M.at[c, c].add(-a1).at[c + 1 + j, c].add(a1).at[c, c + 1 + j].add(a2)
            M = M.at[c + 1 + j, c + 1 + j].add(-a2)
        if c:
            M = M.at[0, 0].add(-q["KA"]).at[c, 0].add(q["KA"])
        u = jnp.zeros(S)
        for s0, s1, r, cm in infs:
            u = u.at[cm].add(jnp.where((t >= s0) & (t < s1), r, 0.0))
        return M @ A + u

    term = diffrax.ODETerm(rhs)
    A = jnp.zeros(S)
    t_prev, q_prev = recs[0][0], p_at(0)
    out = np.zeros(len(t_obs))
    for idx, (t, kind, j) in enumerate(recs):
        if t > t_prev:
            cuts = sorted({t_prev, t} | {float(e) for s0, e, *_ in infs if t_prev < e < t})
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                # times and parameters as arrays: Python floats are static to diffrax's
                # filter_jit, which would compile the solve again for every interval
                sol = diffrax.diffeqsolve(
                    term, diffrax.Tsit5(), jnp.asarray(a), jnp.asarray(b), jnp.asarray(0.01),
                    A, args={k: jnp.asarray(v) for k, v in q_prev.items()},
                    stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-13),
                    max_steps=100000)
                A = sol.ys[-1]
        q = p_at(idx)
        if kind == 0 and doses.rate[j] == 0:
            amt = doses.amt[j] * (q.get("F", 1.0) if doses.cmt[j] == m.default_dose_cmt
                                  else 1.0)
            A = A.at[doses.cmt[j] - 1].add(amt)
        elif kind == 1:
            out[j] = float(A[c] / q["V"])
        t_prev, q_prev = t, q
    return out


@pytest.mark.parametrize("n,absorption", [(1, "first_order"),
                                          pytest.param(2, None, marks=pytest.mark.slow)])
def test_piecewise_parameters_against_an_ode_solution(n, absorption):
    """Parameters changing at the records (CL, V and KA differ at every record: the
    interval after record k uses those of k; an observation the V in force at it):
    predict_piecewise against the diffrax solution, 1e-8 relative (the ODE tolerance)."""
    with jax.enable_x64(True):
        m = compartment_model(n, absorption)
        ncmt = len(m.compartments)
        d = _doses(ncmt, rates=(0.0, 25.0, 0.0, 0.0, 20.0, 0.0, 0.0))
        d = d._replace(ss=np.zeros(7, bool))
        t_obs = np.array([0.5, 1.0, 3.0, 8.0, 14.0, 20.0, 30.0])
        recs = sorted([(float(t), 1, j) for j, t in enumerate(t_obs)]
                      + [(float(d.time[k]), 0, k) for k in range(6)])
        rng = np.random.default_rng(3)
        scale = {k: np.exp(0.4 * rng.normal(size=len(recs))) for k in P}
        names = (*m.param_names, "F")

        def p_at(idx):
            return {k: P[k] * scale[k][idx] for k in names}

        po = {k: np.zeros(len(t_obs)) for k in names}
        pd_ = {k: np.full(7, P[k]) for k in names}
        for idx, (_, kind, j) in enumerate(recs):
            for k in names:
                (po if kind else pd_)[k][j] = p_at(idx)[k]
        out = np.asarray(jax.jit(lambda po, pd_: predict_piecewise(m, po, pd_, t_obs, d))(
            {k: jnp.asarray(v) for k, v in po.items()},
            {k: jnp.asarray(v) for k, v in pd_.items()}))
        ref = _ode_piecewise(n, absorption, t_obs, d, p_at)
        np.testing.assert_allclose(out, ref, rtol=1e-8)
        # the closed form at the first record's parameters is not it (the check has teeth)
        const = np.asarray(jax.jit(lambda p: m(p, jnp.asarray(t_obs), d))(
            {k: jnp.asarray(v) for k, v in p_at(0).items()}))
        assert np.max(np.abs(const / ref - 1)) > 0.05


#: LAPACK-backed primitives (jaxlib's CPU kernels split big batches over XLA's own thread
#: pool and wait inside it: two at once on a 2-thread pool deadlock).
_LAPACK = {"lu", "triangular_solve", "cholesky", "eigh", "eig", "qr", "svd", "schur",
           "hessenberg", "tridiagonal", "householder_product", "lu_pivots_to_permutation"}


def _primitives(jaxpr):
    yield from (eqn.primitive.name for eqn in jaxpr.eqns)
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _primitives(sub)


@pytest.mark.parametrize("n,absorption", [(1, "first_order"), (2, "first_order"), (3, None)])
def test_piecewise_prediction_calls_no_lapack(n, absorption):
    """The batched prediction (subjects x draws, with infusions and steady-state doses), its
    gradient and Hessian contain no LAPACK call: the 136-subject Quinidine fit with
    time-varying covariates stalled forever at 0% CPU, every worker of XLA's pool waiting in
    ``lapack_strsm_ffi`` (the steady-state solve batched over 136 x 40 doses). A deadlock
    cannot be tested for directly (it needs concurrent thunks, and is not deterministic); its
    cause can: before the fix this jaxpr held ``lu`` and ``triangular_solve``."""
    m = compartment_model(n, absorption)
    ncmt = len(m.compartments)
    d = _doses(ncmt, rates=(0.0, 25.0, 0.0, 30.0, 20.0, 0.0, 0.0))
    names = (*m.param_names, "F")

    def f(scale):
        po = {k: jnp.full(len(T_OBS), P[k]) * scale for k in names}
        pd_ = {k: jnp.full(7, P[k]) * scale for k in names}
        return jnp.sum(predict_piecewise(m, po, pd_, T_OBS, d))

    batched = jax.vmap(jax.vmap(jax.hessian(f)))
    prims = set(_primitives(jax.make_jaxpr(batched)(jnp.ones((3, 4))).jaxpr))
    assert not prims & _LAPACK, sorted(prims & _LAPACK)


def test_expm_small_against_scipy():
    """expm_small against scipy's expm: rate matrices of 1 to 3 compartments with a depot
    and their Van Loan augmentations (an infusion), 1-norms from 1e-4 to 1e6, and a general
    matrix with complex eigenvalues. Error relative to max(1, largest entry) (the entries of
    e^{Mt} are at most 1): float64 1e-11 (measured 5e-12 at 2e4 time units, 20 squarings);
    float32 5e-5 (measured 1.7e-5; jax.scipy.linalg.expm, the same Padé with LAPACK, reaches
    2.5e-5 on these). NaN past MAX_SQUARINGS, not a wrong number."""
    import scipy.linalg

    from numpyro_fed.nlme.timevarying import MAX_SQUARINGS, expm_small, rate_matrix

    expm = jax.jit(expm_small)
    rng = np.random.default_rng(0)
    mats = []
    for n in (1, 2, 3):
        for t in (1e-4, 0.3, 5.0, 80.0, 2e4):
            q = {k: jnp.asarray(P[k] * np.exp(0.5 * rng.normal())) for k in P}
            M = np.asarray(rate_matrix(q, n, True), np.float64)
            A = np.zeros((n + 2, n + 2))
            A[:-1, :-1], A[1, -1] = M, 25.0
            mats += [M * t, A * t]
    mats.append(rng.normal(size=(4, 4)) * 3.0)  # complex eigenvalues
    for dtype, tol in ((jnp.float64, 1e-11), (jnp.float32, 5e-5)):
        with jax.enable_x64(dtype == jnp.float64):
            for A in mats:
                ref = scipy.linalg.expm(A)
                out = np.asarray(expm(jnp.asarray(A, dtype)))
                np.testing.assert_allclose(out, ref, rtol=0,
                                           atol=tol * max(1.0, np.abs(ref).max()))
    big = jnp.asarray([[-(2.0 ** (MAX_SQUARINGS + 4))]])
    assert np.isnan(np.asarray(expm_small(big))).all()


def test_solve_small_against_numpy():
    """The unrolled elimination against numpy's LU, float64 1e-12 relative: the
    steady-state matrices I - e^{M II} (1 to 3 compartments with a depot; II from 0.05 to
    500), and general matrices that need the row exchanges (a zero leading pivot), with
    vector and matrix right-hand sides."""
    from numpyro_fed.nlme.timevarying import expm_small, rate_matrix, solve_small

    rng = np.random.default_rng(1)
    expm = jax.jit(expm_small)
    with jax.enable_x64(True):
        cases = []
        for n in (1, 2, 3):
            for ii in (0.05, 2.0, 24.0, 500.0):
                q = {k: jnp.asarray(P[k] * np.exp(0.5 * rng.normal())) for k in P}
                cases.append((np.eye(n + 1)
                              - np.asarray(expm(rate_matrix(q, n, True) * ii)),
                              rng.uniform(1, 100, size=n + 1)))
        for n in (2, 3, 5):
            A = rng.normal(size=(n, n))
            A[0, 0] = 0.0
            cases += [(A, rng.normal(size=n)), (A, rng.normal(size=(n, 3)))]
        solve = jax.jit(solve_small)
        for A, b in cases:
            out = np.asarray(solve(jnp.asarray(A), jnp.asarray(b)))
            np.testing.assert_allclose(out, np.linalg.solve(A, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,kii,rtol", [(1, 1e-9, 1e-4), (1, 1e-4, 1e-4), (2, 1e-4, 5e-3)])
def test_steady_state_with_slow_elimination_is_finite(n, kii, rtol):
    """A draw with a small CL and a large V: the steady state (``k II`` = 1e-9 below
    float32's resolution of 1 - e^{-k II}) and its derivatives are finite and match float64.
    Before, ``I - e^{M II}`` was 0 in float32, the steady state infinite and every derivative
    NaN (Quinidine with time-varying covariates: the SA-Newton score NaN at iteration 0 on
    seed 0). Reference: the same function in float64. One compartment: float32 within 1e-4
    at any k (measured 4e-7, derivatives 3e-7 of their largest). Two: ``I - e^{M II}`` has
    condition ``~1 / (k II)`` (the slow mode), so float32 keeps about ``eps / (k II)``: 5e-3
    at 1e-4 (measured 1.1e-3, derivatives 2.3e-3); at 1e-9 it is singular in float32 (a
    known limit: the E-step rejects a proposal there, as any non-finite one)."""
    m = compartment_model(n, "first_order")
    d = _doses(len(m.compartments))
    d = d._replace(rate=np.zeros(7), cmt=np.ones(7, int),
                   ss=np.array([0, 0, 0, 1, 0, 0, 0], bool))
    names = (*m.param_names, "F")

    def pred(logcl, dtype):
        p = {k: jnp.full((), P[k], dtype) for k in names}
        p["CL"] = jnp.exp(logcl).astype(dtype)
        po = {k: jnp.full(len(T_OBS), v) for k, v in p.items()}
        pd_ = {k: jnp.full(7, v) for k, v in p.items()}
        return predict_piecewise(m, po, pd_, T_OBS.astype(dtype), d)

    value_grad = jax.jit(lambda x, dtype: (pred(x, dtype), jax.jacfwd(pred)(x, dtype)),
                         static_argnums=1)
    logcl = np.log(kii * P["V"] / 6.0)  # k = CL / V, II = 6
    f32, g32 = map(np.asarray, value_grad(jnp.float32(logcl), jnp.float32))
    with jax.enable_x64(True):
        f64, g64 = map(np.asarray, value_grad(jnp.float64(logcl), jnp.float64))
    assert np.all(np.isfinite(f32)) and np.all(np.isfinite(g32))
    np.testing.assert_allclose(f32, f64, rtol=rtol)
    np.testing.assert_allclose(g32, g64, rtol=10 * rtol, atol=rtol * np.abs(g64).max())


def test_pkmodel_uses_the_covariate_in_force():
    """A covariate that changes within a subject: PKModel's predictions are those of the
    parameters in force at each record (LOCF), not of the first value."""
    data = nlme.PKDataset.from_dataframe(_table(n=3), covariates=["GLYCO", "WT"])
    pk = _pk()
    a = pk.arrays(data)
    assert a["binding"].time_varying == ("GLYCO",)
    th = dict(TRUE)
    phi = {"CL": jnp.full(3, TRUE["mu_CL"]), "V": jnp.full(3, TRUE["mu_V"]),
           "KA": jnp.full(3, TRUE["mu_KA"])}
    g_o, g_d = np.asarray(a["tvo_GLYCO"]), np.asarray(a["tvd_GLYCO"])
    ref = float(np.median(np.concatenate([g_o[data.obs.mask], g_d[data.doses.mask]])))
    assert dict(a["binding"].references)["GLYCO"] == pytest.approx(ref)
    at = pk.record_parameters(phi, {"GLYCO": jnp.asarray(g_o)}, {"GLYCO": jnp.asarray(g_d)},
                              th, binding=a["binding"])
    cl_o = np.asarray(at[0]["CL"])
    np.testing.assert_allclose(cl_o, 4.0 * np.exp(-0.6 * (g_o - ref)), rtol=1e-5)
    d = Doses(*(jnp.asarray(a[k]) for k in ("dose_time", "dose_amt", "dose_rate",
                                            "dose_cmt", "dose_ss", "dose_ii", "dose_mask")))
    f = np.asarray(pk.predict(None, jnp.asarray(a["obs_time"]), d, a["doses_before"],
                              binding=a["binding"], at_records=at))
    # before 24 h the value in force is the first one: the closed form with those values
    cf = nlme.one_compartment("first_order")
    i = 0
    early = np.asarray(data.obs.time[i]) < 24
    p0 = {"CL": float(cl_o[i, 0]), "V": 40.0, "KA": 1.5}
    np.testing.assert_allclose(f[i][early], np.asarray(cf(p0, jnp.asarray(
        data.obs.time[i][early]), jax.tree.map(lambda x: x[i], d))), rtol=1e-5)
    # after it, the prediction differs from the first value's (CL changed by 30-60 %)
    late = data.obs.mask[i] & ~early
    f0 = np.asarray(cf(p0, jnp.asarray(data.obs.time[i]), jax.tree.map(lambda x: x[i], d)))
    assert np.all(np.abs(f[i][late] / f0[late] - 1) > 0.02)
    with pytest.raises(ValueError, match="at_records"):
        pk.predict({"CL": phi["CL"]}, jnp.asarray(a["obs_time"]), d, binding=a["binding"])


def test_time_varying_refusals():
    data = nlme.PKDataset.from_dataframe(_table(n=2), covariates=["GLYCO", "WT"])
    lag = nlme.PKModel(nlme.one_compartment("first_order"),
                       params={"CL": nlme.Param(3.0, covariates={"GLYCO": "linear"}),
                               "V": 30.0, "KA": 1.0, "TLAG": 0.2})
    with pytest.raises(ValueError, match="lag time TLAG"):
        lag.arrays(data)

    def plain(p, t, doses):
        return jnp.zeros_like(t)

    plain.param_names = ("CL",)
    pk = nlme.PKModel(plain, params={"CL": nlme.Param(3.0, covariates={"GLYCO": "linear"})})
    with pytest.raises(ValueError, match="only the compartment"):
        pk.arrays(data)


# ----------------------------------------------------------------------------- the fit
@pytest.mark.slow
def test_fit_with_a_time_varying_covariate(tmp_path):
    """The GLYCO effect on CL is estimated (true -0.6; 16 subjects x 10 samples, a short
    schedule: within 0.25), and the predictions follow the data (IPRED closer than
    PRED); the diagnostics run on the time-varying path (the grid of the individual fits
    carries the covariate forward). Slow: ~100 s on 2 cores, most of it compiling the
    record-by-record propagation and its derivatives."""
    # started near the truth: SAEM's Newton step on the effects outside the latent means
    # (beta_CL_GLYCO, and KA without random effect) overshoots from afar on 16 subjects
    pk = nlme.PKModel(
        nlme.one_compartment("first_order"),
        params={"CL": nlme.Param(4.0, covariates={"GLYCO": "linear"}),
                "V": nlme.Param(40.0),
                "KA": nlme.Param(1.5, random=False, covariates={"WT": "power"})},
        error="proportional")
    fit = pk.fit(_simulate(), jax.random.key(0),
                 schedule=Schedule(num_iters=150, num_exploration=100))
    assert float(fit.params["beta_CL_GLYCO"]) == pytest.approx(-0.6, abs=0.25)
    pr = fit.predictions()
    assert np.mean(np.log(pr.DV / pr.IPRED) ** 2) < np.mean(np.log(pr.DV / pr.PRED) ** 2)
    assert np.std(np.log(pr.DV / pr.IPRED)) < 0.2  # proportional error 0.1
    fig = fit.plot_individual_fits(tmp_path / "ind.png", subjects=[101, 104])
    y = fig.axes[0].get_lines()[0].get_data()[1]
    assert np.all(np.isfinite(y)) and y.max() > 0
    fit.plot_goodness_of_fit(tmp_path / "gof.png")
    assert len(fit.vpc_table(jax.random.key(1), num_sims=50)) > 0


def test_no_mode_column_for_a_parameter_without_random_effect(md_fit):
    """KA has no random effect: no conditional mode, mean, sd or eta (issue 29: the table
    listed a ``KA_mode`` column, the typical value, as if it were an EBE); its per-subject
    value (population value with the subject's covariates) is individual_parameters
    ("typical")."""
    fit = md_fit
    ind = fit.individual_estimates()
    assert {"CL_mode", "V_mode", "CL_mean", "V_sd", "eta_CL", "eta_V"} <= set(ind.columns)
    assert not [c for c in ind.columns if "KA" in c], list(ind.columns)
    wt = np.asarray(fit.data.covariates["WT"], np.float64)
    ref = fit.pk.references["WT"]
    expect = np.exp(float(fit.params["mu_KA"])) * (wt / ref) ** float(fit.params["beta_KA_WT"])
    np.testing.assert_allclose(fit.individual_parameters("typical")["KA"], expect, rtol=1e-5)


def test_subjects_by_id(md_fit, tmp_path):
    fit = md_fit
    ids = list(fit.data.ids)
    assert ids[:3] == [101, 104, 107]
    ind = fit.individual_estimates(subjects=[107, 101])
    assert list(ind.index) == [107, 101]
    pr = fit.predictions(subjects=104)
    assert set(pr.ID) == {104} and len(pr) == len(SAMPLES)
    assert list(fit.individual_estimates(positions=[2, 0]).index) == [107, 101]
    fig = fit.plot_individual_fits(tmp_path / "ind.png", subjects=[104, 146])
    assert [a.get_title() for a in fig.axes[:2]] == ["ID 104", "ID 146"]
    # one subject, one panel (no empty columns of the default 4)
    fig = fit.plot_individual_fits(tmp_path / "one.png", subjects=[107])
    assert [a.get_title() for a in fig.axes] == ["ID 107"]
    for call in (lambda s: fit.plot_individual_fits(subjects=s),
                 lambda s: fit.individual_estimates(subjects=s),
                 lambda s: fit.predictions(subjects=s),
                 lambda s: fit.plot_goodness_of_fit(subjects=s)):
        with pytest.raises(ValueError, match=r"no subject with ID\(s\) \[0, 1\]"):
            call([0, 1, 101])
    with pytest.raises(ValueError, match="selected twice"):
        fit.predictions(subjects=[101, 101])
    with pytest.raises(ValueError, match="not both"):
        fit.predictions(subjects=[101], positions=[0])
    with pytest.raises(IndexError, match="out of range"):
        fit.predictions(positions=[16])


def test_individual_fit_grid_resolves_the_peaks(md_fit, tmp_path):
    """After every dose the drawn IPRED curve reaches the individual prediction's maximum
    on that dosing interval (1 %): the maximum over 20 000 points of the interval (the true
    maximum to 1e-5: the curve is smooth between doses). The peaks lie between samples
    (26.5 and 30 h after the 24 h dose, 400 and 403 h). The old 200-point even grid over
    0-423 h (2.1 h apart) missed them by 1-10 %."""
    fit = md_fit
    pos = [0, 5]
    fig = fit.plot_individual_fits(tmp_path / "ind.png", positions=pos)
    a = fit._arrays
    for k, i in enumerate(pos):
        line = [ln for ln in fig.axes[k].get_lines() if ln.get_label() == "IPRED"][0]
        x, y = (np.asarray(v, np.float64) for v in line.get_data())
        sub = {kk: np.asarray(v)[[i]] if np.ndim(v) and np.shape(v)[0] == 16 else v
               for kk, v in a.items()}
        phi = {kk: np.asarray(v)[[i]] for kk, v in fit._phi("mode").items()}
        for lo, hi in ((0, 12), (12, 24), (24, 36), (36, 48), (400, 420)):
            dense = np.linspace(lo, hi, 20_000, endpoint=False)[None, :].astype(np.float32)
            true = fit._predict_phi(phi, sub, dense)[0]
            drawn = y[(x >= lo) & (x < hi)]
            assert drawn.max() == pytest.approx(true.max(), rel=0.01), (lo, hi)
        assert x.max() >= 403.0 and np.all(np.diff(x) >= 0)


def test_default_axis_and_trend_lines(md_fit, tmp_path):
    fit = md_fit
    pr = fit.predictions()
    np.testing.assert_allclose(pr.TAD.to_numpy()[:len(SAMPLES)],
                               [1, 2, 4, 12, 1, 2.5, 6, 12, 1, 4, 3], atol=1e-5)
    fig = fit.plot_goodness_of_fit(tmp_path / "gof.png")
    xl = [a.get_xlabel() for a in fig.axes]
    assert xl.count("time after dose") == 2 and "time" not in xl
    for a in fig.axes:
        assert any(ln.get_label() == "LOWESS" for ln in a.get_lines())
    assert "time" in [a.get_xlabel() for a in fit.plot_goodness_of_fit(x="time").axes]
    vpc = fit.vpc_table(jax.random.key(1), num_sims=50, bins=4)
    assert set(vpc.axis) == {"tad"} and vpc.x.max() <= 12.0
    assert set(fit.vpc_table(jax.random.key(1), num_sims=50, x="time").axis) == {"time"}
    fit.plot_vpc(jax.random.key(2), tmp_path / "vpc.png", num_sims=50, bins=4)
    assert (tmp_path / "vpc.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="x='dose'"):
        fit.vpc_table(jax.random.key(1), x="dose")
    # single-dose data: time
    assert nlme.diagnostics._x_axis(None, nlme.load_theophylline()) == "time"


def test_diagnostics_reuse_their_programs(md_fit, tmp_path):
    """Issue 29 (diagnostics 21.6 s and plots 18.9 s on nlme::Quinidine, mostly compiling):
    the predictions, the CWRES linearisation and the simulations are compiled programs kept
    by content, so the goodness-of-fit plot (which recomputes ``predictions()``) compiles
    nothing new, and the NPDE's and the VPC's simulations share one program (chunks of
    ``SIM_CHUNK`` replicates, the last one padded). A chunked simulation is reproducible and
    the padded chunk's rows are real draws."""
    from compile_count import Compiles

    from numpyro_fed.nlme import diagnostics as dg

    fit = md_fit
    pr = fit.predictions()
    with Compiles() as c:
        fit.plot_goodness_of_fit(tmp_path / "gof.png")
    assert not c.names, c.names
    fit.npde(jax.random.key(3), num_sims=dg.SIM_CHUNK)
    with Compiles() as c:
        fit.vpc_table(jax.random.key(4), num_sims=dg.SIM_CHUNK)
    assert not c.names, c.names
    R = dg.SIM_CHUNK + 7  # one full chunk, one padded
    a = fit.simulate(jax.random.key(5), num_replicates=R)
    b = fit.simulate(jax.random.key(5), num_replicates=R)
    m = a["mask"]
    assert a["f"].shape[0] == a["dv"].shape[0] == R
    np.testing.assert_array_equal(a["dv"], b["dv"])
    # on a design where one subject has fewer samples, its padding is NaN (not a
    # prediction at a padded time), every observation finite
    df = _table()
    drop = df.index[(df.ID == df.ID.iloc[0]) & (df.EVID == 0)][-2:]
    short = nlme.PKDataset.from_dataframe(df.drop(drop), covariates=["GLYCO", "WT"])
    s = fit.simulate(jax.random.key(7), short, num_replicates=2)
    ms = s["mask"]
    assert not ms.all() and ms[1:].all()
    for v in (s["f"], s["dv"]):
        assert np.all(np.isnan(v[:, ~ms])) and np.all(np.isfinite(v[:, ms]))
    # the last 7 replicates are distinct draws, not copies of the padding row
    last = a["f"][-7:][:, m]
    assert np.all(np.isfinite(last)) and len({float(x.sum()) for x in last}) == 7
    # keeping the EBEs, every replicate's structural prediction is IPRED
    sim = fit.simulate(jax.random.key(6), num_replicates=3, new_subjects=False)
    np.testing.assert_allclose(sim["f"][:, m], np.broadcast_to(pr.IPRED.to_numpy(),
                                                               (3, int(m.sum()))),
                               rtol=1e-5)
