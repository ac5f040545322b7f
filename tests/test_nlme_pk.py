"""Closed-form compartment models (``numpyro_fed.nlme.pk``) and ODE models
(``numpyro_fed.nlme.ode``): accuracy against each other and against hand formulas, steady
state against long dosing histories, masking, the ``KA = k`` singularity, derivatives
(grad, jacfwd, forward-over-reverse Hessian) against finite differences, vmap, errors.

Accuracy checks run in float64 (``jax.enable_x64(True)`` inside each test). Compilation is
most of the run time, so the tests share programs: predictions go through :func:`predict`,
one ``jit(vmap(model))`` per model object, always on 3 subjects x ``TIMES`` x ``D`` doses.
"""

from typing import Any, NamedTuple

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.nlme.ode import ode_model
from numpyro_fed.nlme.pk import compartment_model, one_compartment, two_compartment

D = 6  # doses per subject (padded)
TIMES = np.concatenate([[0.0, 0.3], np.geomspace(0.6, 72.0, 38)])  # T = 40, unequal
TRUE = dict(CL=3.0, V=20.0, KA=1.2, Q=4.0, V2=50.0, Q3=1.5, V3=120.0, TLAG=0.4, F=0.7)
MODELS = [(n, a) for n in (1, 2, 3) for a in ("first_order", None)]
JUNK = (-3.0, np.nan, 7.0, 9, True, -1.0)  # a padding row: must be ignored entirely


class Doses(NamedTuple):
    """Per-subject dosing record (the fields of numpyro_fed.nlme.data.Doses)."""

    time: Any
    amt: Any
    rate: Any
    cmt: Any
    ss: Any
    ii: Any
    mask: Any


def make_doses(rows, n=D, pad=None):
    """Doses from rows ``(time, amt, rate, cmt[, ss, ii])``, padded to ``n`` with masked
    rows (``pad``, default zeros)."""
    rows = [tuple(r) + (False, 0.0)[len(r) - 4 :] for r in rows]
    full = rows + [pad or (0.0, 0.0, 0.0, 1, False, 0.0)] * (n - len(rows))
    cols = list(zip(*full, strict=True))
    return Doses(
        time=np.array(cols[0], float),
        amt=np.array(cols[1], float),
        rate=np.array(cols[2], float),
        cmt=np.array(cols[3], np.int32),
        ss=np.array(cols[4], bool),
        ii=np.array(cols[5], float),
        mask=np.arange(n) < len(rows),
    )


def stack(doses):
    return Doses(*(np.stack(f) for f in zip(*doses, strict=True)))


_MODELS: dict = {}
_JIT: dict = {}


def model_for(n, absorption):
    """One model object per (n, absorption), so that its compiled programs are reused."""
    return _MODELS.setdefault((n, absorption), compartment_model(n, absorption))


def predict(model, params, doses, t=TIMES):
    """Predictions ``(len(doses), T)`` through one ``jit(vmap(model))`` per model, run on
    chunks of 3 subjects (the last one padded) so that every call reuses one program per
    (model, D, dtype). ``params``: scalars or per-subject arrays."""
    if id(model) not in _JIT:
        _JIT[id(model)] = (model, jax.jit(jax.vmap(model)))
    fn = _JIT[id(model)][1]
    k = len(doses)
    params = {key: np.broadcast_to(v, (k,)) for key, v in params.items()}
    out = []
    for i in range(0, k, 3):
        idx = [min(j, k - 1) for j in range(i, i + 3)]
        p = {key: v[idx] for key, v in params.items()}
        tt = np.broadcast_to(t, (3, len(t)))
        out.append(np.asarray(fn(p, tt, stack([doses[j] for j in idx]))))
    return np.concatenate(out)[:k]


def params_for(model, values=TRUE):
    return {k: np.float64(values[k]) for k in model.param_names + ("TLAG", "F")}


def linear_rhs(t, A, p):
    """Depot, central and two peripheral compartments (the 3-compartment oral model; Q = 0
    or Q3 = 0 remove a peripheral compartment)."""
    dep, c, p1, p2 = A
    k10, k12, k13 = p["CL"] / p["V"], p["Q"] / p["V"], p["Q3"] / p["V"]
    k21, k31 = p["Q"] / p["V2"], p["Q3"] / p["V3"]
    return jnp.stack([
        -p["KA"] * dep,
        p["KA"] * dep - (k10 + k12 + k13) * c + k21 * p1 + k31 * p2,
        k12 * c - k21 * p1,
        k13 * c - k31 * p2,
    ])


LINEAR_ODE = ode_model(
    linear_rhs, 4, central=2, param_names=("CL", "V", "KA", "Q", "V2", "Q3", "V3"),
    compartments={1: "depot", 2: "central", 3: "peripheral1", 4: "peripheral2"},
    solver=diffrax.Dopri8(), rtol=1e-10, atol=1e-12, dt0=1.0, max_steps=512,
)


def mm_rhs(t, A, p):
    """One compartment, first-order absorption, Michaelis-Menten elimination."""
    c = A[1] / p["V"]
    return jnp.stack([-p["KA"] * A[0], p["KA"] * A[0] - p["VM"] * c / (p["KM"] + c)])


# fixed steps (16 per interval between events): a numerical solution that is smooth in the
# parameters, so that finite differences of its gradient can check its Hessian to 1e-5 (an
# adaptive solve has kinks where its step sequence changes: ~1e-9 relative noise in the
# gradient, x 1 / (2 h) = 5e4 in finite differences)
MM_ODE = ode_model(
    mm_rhs, 2, central=2, param_names=("V", "KA", "VM", "KM"),
    compartments={1: "depot", 2: "central"}, solver=diffrax.Dopri8(),
    stepsize_controller=diffrax.ConstantStepSize(), dt0=1.0 / 16, max_steps=16,
)


def oral_cases(n, pad=None):
    """Subjects for a model with a depot (cmt 1 depot, 2 central, 3/4 peripheral)."""
    cases = [
        [(1.0, 100.0, 0.0, 1), (9.5, 60.0, 0.0, 1), (26.0, 80.0, 0.0, 1)],  # oral
        [(2.0, 100.0, 50.0, 1), (30.0, 40.0, 0.0, 2), (33.0, 90.0, 9.0, 1)],  # depot inf., IV
        [(0.5, 120.0, 30.0, 2), (40.0, 50.0, 0.0, 1)]  # central infusion, oral
        + ([(20.0, 30.0, 0.0, 3)] if n > 1 else [])  # bolus into peripheral 1
        + ([(50.0, 40.0, 20.0, 4)] if n > 2 else []),  # infusion into peripheral 2
    ]
    return [make_doses(c, pad=pad) for c in cases]


def iv_cases(n, pad=None):
    """Subjects for a model without depot (cmt 1 central, 2/3 peripheral)."""
    cases = [
        [(1.0, 100.0, 0.0, 1), (9.5, 60.0, 0.0, 1), (26.0, 80.0, 0.0, 1)],  # IV boluses
        [(0.5, 120.0, 30.0, 1), (24.0, 80.0, 80.0, 1), (24.5, 10.0, 0.0, 1)],  # infusions
        [(3.0, 50.0, 0.0, 1)]
        + ([(20.0, 30.0, 0.0, 2)] if n > 1 else [])
        + ([(50.0, 40.0, 20.0, 3)] if n > 2 else []),
    ]
    return [make_doses(c, pad=pad) for c in cases]


def rel_err(a, ref, floor=1e-8):
    """Max relative error where |ref| > floor * max|ref| (per subject)."""
    a, ref = np.asarray(a), np.asarray(ref)
    keep = np.abs(ref) > floor * np.max(np.abs(ref), axis=-1, keepdims=True)
    assert keep.sum() > 0.5 * keep.size
    return float(np.max(np.abs(a - ref)[keep] / np.abs(ref)[keep]))


# ----------------------------------------------------------------------------- accuracy
def test_analytic_models_match_the_ode_solution():
    """All 6 closed-form models, every route (oral, depot infusion, IV bolus, central and
    peripheral infusion, peripheral bolus), unequal intervals, padding, TLAG and F, against
    the ODE solution (Dopri8, rtol 1e-10): 1e-6 relative where the concentration exceeds
    1e-8 of its max (measured: <= 4e-11, the ODE's own error). The ODE against the hand
    formula of the 1-compartment oral model: 1e-6 (measured ~1e-11)."""
    with jax.enable_x64(True):
        errors = {}
        for n, a in MODELS:
            model = model_for(n, a)
            cases = oral_cases(n) if a else iv_cases(n)
            pred = predict(model, params_for(model), cases)
            # the same subjects for LINEAR_ODE: compartments shifted past its depot without
            # absorption, F folded into the amounts of doses into compartment 1 (F1; an
            # infusion keeps its rate, so it lasts F amt / rate in both)
            ode_cases = [
                c._replace(cmt=c.cmt + (0 if a else 1),
                           amt=np.where(c.cmt == 1, TRUE["F"] * c.amt, c.amt))
                for c in cases
            ]
            ode_p = dict(TRUE, Q=TRUE["Q"] * (n > 1), Q3=TRUE["Q3"] * (n > 2), F=1.0)
            ode = predict(LINEAR_ODE, ode_p, ode_cases)
            errors[(n, a)] = rel_err(pred, ode)
            assert np.all(pred[:, 0] == 0.0)  # before the first dose (t = 0 < 0.4)
            if (n, a) == (1, "first_order"):  # hand formula, oral boluses (first subject)
                d = cases[0]
                k, ka = TRUE["CL"] / TRUE["V"], TRUE["KA"]
                dt = TIMES[:, None] - (d.time + TRUE["TLAG"])[None, :]
                one = np.exp(-k * np.maximum(dt, 0)) - np.exp(-ka * np.maximum(dt, 0))
                one *= TRUE["F"] * d.amt * ka / (TRUE["V"] * (ka - k))
                hand = np.sum(np.where((dt >= 0) & d.mask, one, 0.0), axis=1)
                assert rel_err(ode[0], hand) < 1e-6
                assert rel_err(pred[0], hand) < 1e-9
        print("max relative error vs ODE:", errors)
        assert max(errors.values()) < 1e-6, errors


def test_steady_state_matches_many_doses():
    """An SS dose (bolus or infusion, into the depot or the central compartment, with a lag
    in the first ii) equals 200 doses every ii before it; doses recorded before an SS dose
    stop at its time (NONMEM SS=1 reset) and later ones add. 1e-6 relative (measured 7e-9
    for 3 compartments: the truncated sum misses e^{-lam_3 200 ii} ~ 9e-9 of the level;
    3e-16 for 1 compartment)."""
    with jax.enable_x64(True):
        ii, n_rep = 12.0, 200
        t = np.linspace(100.0, 150.0, 40)  # SS dose at 100, a later dose at 130
        for n, a, routes in ((3, "first_order", [(0.0, 1), (40.0, 1), (0.0, 2), (25.0, 2)]),
                             (1, None, [(0.0, 1), (40.0, 1)])):
            model = model_for(n, a)
            ss_doses, ref_doses = [], []
            for rate, cmt in routes:
                ss_doses.append(make_doses([
                    (50.0, 70.0, 0.0, cmt),  # reset by the SS dose at 100
                    (100.0, 100.0, rate, cmt, True, ii),
                    (130.0, 60.0, 0.0, cmt),
                ]))
                train = [(100.0 - ii * m, 100.0, rate, cmt) for m in range(n_rep)][::-1]
                ref_doses.append(make_doses(train + [(130.0, 60.0, 0.0, cmt)], n=n_rep + 2))
            p = params_for(model, dict(TRUE, TLAG=1.5))
            ss = predict(model, p, ss_doses, t)
            ref = predict(model, p, ref_doses, t)
            assert rel_err(ss, ref) < 1e-6, (n, a, rel_err(ss, ref))


def test_depot_and_compartment_amounts_match_the_ode_solution():
    """An observation of the depot (``cmt=1`` with first-order absorption) is predicted as
    NONMEM does without a scale S1: the depot amount. Every first-order model, every route
    of ``oral_cases`` (depot bolus and infusion, central and peripheral doses), TLAG and F,
    against the ODE's depot state (the ODE predicting each observation's compartment: its
    amount, or ``observe`` for the central one); 1e-8 of the peak amount (measured <= 6e-12,
    the ODE's own error: rtol 1e-10, atol 1e-12). ``cmt`` 0 or central is the central
    concentration, bit for bit; a mix per observation picks each; a compartment the closed
    form does not compute is NaN. The depot at steady state (bolus, infusion; lag; reset by
    the SS dose, a later dose added) equals 200 doses every ii (1e-9 relative)."""
    with jax.enable_x64(True):
        t = jnp.asarray(TIMES)
        ones = jnp.ones(t.shape, jnp.int32)
        for n in (1, 2, 3):
            model = model_for(n, "first_order")
            p = params_for(model)
            ode_p = dict(TRUE, Q=TRUE["Q"] * (n > 1), Q3=TRUE["Q3"] * (n > 2))
            for d in oral_cases(n):
                dep = np.asarray(model(p, t, d, cmt=ones))
                ref = np.asarray(LINEAR_ODE(ode_p, t, d, cmt=ones))
                # the depot empties fast: relative to its peak (the ODE's atol is 1e-12)
                err = np.max(np.abs(dep - ref)) / np.max(np.abs(ref))
                assert err < 1e-8, (n, err)
                assert np.all(dep[TIMES < 1.4] == 0.0) and np.all(dep >= 0)
                central = np.asarray(model(p, t, d))
                np.testing.assert_array_equal(np.asarray(model(p, t, d, cmt=0 * ones)), central)
                np.testing.assert_array_equal(np.asarray(model(p, t, d, cmt=2 * ones)), central)
                mix = np.asarray(model(p, t, d, cmt=jnp.where(jnp.arange(40) % 2 == 0, 1, 2)))
                np.testing.assert_array_equal(mix[::2], dep[::2])
                np.testing.assert_array_equal(mix[1::2], central[1::2])
                assert np.all(np.isnan(np.asarray(model(p, t, d, cmt=3 * ones))))
                # the ODE's own central compartment: observe (A_central / V)
                np.testing.assert_array_equal(
                    np.asarray(LINEAR_ODE(ode_p, t, d, cmt=2 * ones)),
                    np.asarray(LINEAR_ODE(ode_p, t, d)))
        model = model_for(1, "first_order")
        p = params_for(model, dict(TRUE, TLAG=1.5))
        ii, n_rep = 12.0, 200
        tt = jnp.asarray(np.linspace(100.0, 150.0, 40))
        for rate in (0.0, 40.0):
            ss = make_doses([(50.0, 70.0, 0.0, 1), (100.0, 100.0, rate, 1, True, ii),
                             (130.0, 60.0, 0.0, 1)])
            train = [(100.0 - ii * m, 100.0, rate, 1) for m in range(n_rep)][::-1]
            ref = make_doses(train + [(130.0, 60.0, 0.0, 1)], n=n_rep + 2)
            c = jnp.ones(tt.shape, jnp.int32)
            assert rel_err(model(p, tt, ss, cmt=c), model(p, tt, ref, cmt=c)) < 1e-9


def test_padding_and_times_before_the_first_dose():
    """Padding doses (mask False) add exactly 0, whatever their fields hold (NaN included);
    before the first dose (+ lag) the prediction is exactly 0. (Derivatives with junk
    padding: the finite-difference tests.)"""
    with jax.enable_x64(True):
        model = model_for(2, "first_order")
        clean, junk = oral_cases(2), oral_cases(2, pad=JUNK)
        a = predict(model, params_for(model), clean)
        b = predict(model, params_for(model), junk)
        np.testing.assert_array_equal(a, b)
        first = np.array([1.0, 2.0, 0.5]) + TRUE["TLAG"]
        assert np.all((a == 0.0) == (TIMES[None, :] < first[:, None]))


def test_michaelis_menten_ode_runs_differentiates_and_reduces_to_linear():
    """A nonlinear ODE: finite, differentiable (grad and Hessian = jacfwd(grad) through
    DirectAdjoint, compared with finite differences), and with KM huge (VM/KM = CL) equal to
    the linear 1-compartment model."""
    with jax.enable_x64(True):
        d = make_doses([(0.0, 100.0, 0.0, 1), (12.0, 100.0, 0.0, 1), (24.0, 50.0, 25.0, 1)])
        t = TIMES[::4]
        names = ("V", "KA", "VM", "KM")

        def conc(v):
            return MM_ODE(dict(zip(names, jnp.exp(v), strict=True)), t, d)

        v0 = np.log([20.0, 1.2, 30.0, 2.0])  # saturating: C ~ 1-5 vs KM = 2
        derivs = _check_derivatives(conc, v0, tol=1e-5, jac=False)
        km = 1e9
        mm_lin = derivs(np.log([20.0, 1.2, 3.0 * km, km]), np.zeros(t.size))[1]
        lin = jax.jit(one_compartment())({"CL": 3.0, "V": 20.0, "KA": 1.2}, t, d)
        # the difference is C / KM ~ 1e-9 relative, the fixed-step ODE's error ~1e-8
        assert rel_err(mm_lin, lin) < 1e-6


def _check_derivatives(conc, v0, tol, jac=True):
    """grad, jacfwd (of the concentrations) and Hessian (jacfwd of grad: forward over
    reverse) of a Gaussian log-likelihood through ``conc`` (data: 1.1 x the prediction at
    ``v0``) are finite and match central finite differences (step 1e-5 in log-parameters:
    truncation ~1e-10, rounding ~1e-11 relative) to ``tol`` relative (max-norm). Returns
    the compiled ``derivs(v, y) -> (loglik, conc, grad, jacobian, hessian)``."""

    def loglik(v, y):
        c = conc(v)
        return -0.5 * jnp.sum(((y - c) / 0.1) ** 2), c

    def grad_conc(v, y):
        (value, c), grad = jax.value_and_grad(loglik, has_aux=True)(v, y)  # one model call
        return ((grad, c) if jac else grad), (value, c, grad)

    @jax.jit
    def derivs(v, y):  # one program, for the data and at the finite-difference points
        # jacfwd of (grad, conc): the Hessian (= jax.hessian) and the Jacobian of the
        # concentrations (forward mode) in one pass
        out, (value, c, grad) = jax.jacfwd(grad_conc, has_aux=True)(v, y)
        hess, jacobian = out if jac else (out, jnp.zeros((c.size, v.size)))
        return value, c, grad, jacobian, hess

    y = 1.1 * np.asarray(derivs(v0, np.zeros(conc_size(conc, v0)))[1])
    value, c, grad, jacobian, hess = (np.asarray(a) for a in derivs(v0, y))
    assert all(np.all(np.isfinite(a)) for a in (value, c, grad, jacobian, hess))
    h = 1e-5
    fd = [derivs(v0 + h * e, y) for e in np.eye(len(v0))]
    bd = [derivs(v0 - h * e, y) for e in np.eye(len(v0))]

    def diff(i):
        return np.stack([(f[i] - b[i]) / (2 * h) for f, b in zip(fd, bd, strict=True)], -1)

    checks = [("grad", grad, diff(0)), ("hessian", hess, diff(2))]
    checks += [("jacfwd", jacobian, diff(1))] if jac else []
    for name, a, ref in checks:
        err = np.max(np.abs(a - ref)) / np.max(np.abs(ref))
        assert err < tol, (name, err)
    np.testing.assert_allclose(hess, hess.T, rtol=1e-8, atol=1e-8 * np.max(np.abs(hess)))
    return derivs


def conc_size(conc, v0):
    """The shape of ``conc(v0)`` (traced, not run)."""
    return jax.eval_shape(conc, v0).shape


@pytest.mark.parametrize("n, absorption, ka_tie", [(1, "first_order", 0), (2, None, None),
                                                   (3, "first_order", 1)])
def test_derivatives_match_finite_differences(n, absorption, ka_tie):
    """grad, jacfwd and hessian through the closed forms (1, 2, 3 compartments; depot and
    IV routes; infusions; TLAG and F estimated; NaN in the padding) match finite
    differences to 1e-5, also at KA = k (1 compartment) and KA = lam_2 (3 compartments),
    where the textbook formulas divide by zero."""
    with jax.enable_x64(True):
        model = model_for(n, absorption)
        d = (oral_cases(n, pad=JUNK) if absorption else iv_cases(n, pad=JUNK))[1]
        names = model.param_names + ("TLAG", "F")
        values = dict(TRUE)
        if ka_tie is not None:
            lam = model._eigen({k: jnp.asarray(TRUE[k]) for k in model.param_names})[0]
            values["KA"] = float(lam[ka_tie])
        v0 = np.log([values[k] for k in names])
        t = TIMES[::2]

        def conc(v):
            return model(dict(zip(names, jnp.exp(v), strict=True)), t, d)

        _check_derivatives(conc, v0, tol=1e-5)


def test_ka_equal_to_an_eigenvalue():
    """KA = k (= CL/V, or any eigenvalue of 2-3 compartments): finite, continuous with
    KA = k (1 +- 1e-4), equal to the limit form D k t e^{-k t} / V for one compartment;
    value and gradient finite and continuous in float32 too. (Gradients and Hessians at
    ties in float64: the finite-difference tests.)"""
    d = [make_doses([(0.0, 100.0, 0.0, 1), (6.0, 100.0, 40.0, 1)])] * 3
    with jax.enable_x64(True):
        for n in (1, 2, 3):
            model = model_for(n, "first_order")
            p = params_for(model)
            lam = np.asarray(model._eigen({k: jnp.asarray(p[k]) for k in model.param_names})[0])
            for lam_i in lam:
                v = predict(model, dict(p, KA=lam_i * np.array([1.0, 1 + 1e-4, 1 - 1e-4])), d)
                assert np.all(np.isfinite(v))
                # a relative change of 1e-4 in KA moves C by <~1e-4 relative
                assert np.max(np.abs(v[0] - v[1:])) < 1e-3 * np.max(v)
        k = TRUE["CL"] / TRUE["V"]
        single = [make_doses([(0.0, 100.0, 0.0, 1)])]
        one = model_for(1, "first_order")
        v = predict(one, dict(params_for(one), KA=k, TLAG=0.0, F=1.0), single)
        assert rel_err(v[0], 100.0 * k * TIMES * np.exp(-k * TIMES) / TRUE["V"]) < 1e-12

    # float32: value and gradient at the tie and next to it
    one = one_compartment()
    k = np.float32(TRUE["CL"] / TRUE["V"])
    p = {"CL": np.full(3, TRUE["CL"], np.float32), "V": np.full(3, TRUE["V"], np.float32),
         "KA": k * np.array([1.0, 1 + 1e-4, 1 - 1e-4], np.float32)}
    t32 = TIMES.astype(np.float32)
    dd = Doses(*(np.asarray(a, np.float32) if a.dtype == np.float64 else a for a in d[0]))

    def value_grad(p):
        return jax.value_and_grad(lambda p: jnp.sum(one(p, t32, dd)))(p)

    v, g = jax.jit(jax.vmap(value_grad))(p)
    assert v.dtype == jnp.float32
    assert np.all(np.isfinite(v)) and all(np.all(np.isfinite(x)) for x in g.values())
    for key, x in g.items():
        x = np.asarray(x)
        assert np.max(np.abs(x[0] - x[1:])) < 2e-3 * np.max(np.abs(x)), key


def test_float32_close_to_float64():
    """float32 predictions agree with float64 to ~1e-5 relative, late (small) concentrations
    after infusions included (no cancellation)."""
    model = model_for(3, "first_order")
    cases = oral_cases(3)
    with jax.enable_x64(True):
        ref = predict(model, params_for(model), cases)
    p32 = {k: np.float32(v) for k, v in params_for(model).items()}
    c32 = [Doses(*(a.astype(np.float32) if a.dtype == np.float64 else a for a in c))
           for c in cases]
    out = predict(model, p32, c32, TIMES.astype(np.float32))
    assert out.dtype == np.float32
    assert rel_err(out, ref) < 2e-5


def test_vmap_matches_a_loop():
    """vmap over 3 subjects (different parameters and doses) equals one call per subject."""
    with jax.enable_x64(True):
        model = model_for(2, "first_order")
        cases = oral_cases(2)
        p = {k: v * np.array([1.0, 1.3, 0.8]) for k, v in params_for(model).items()}
        out = predict(model, p, cases)
        single = jax.jit(model)
        for i in range(3):
            one = single({k: v[i] for k, v in p.items()}, TIMES, cases[i])
            np.testing.assert_allclose(out[i], one, rtol=1e-13, atol=0)


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="n_compartments=4"):
        compartment_model(4)
    with pytest.raises(TypeError, match="n_compartments"):
        compartment_model(2.0)
    with pytest.raises(ValueError, match="absorption='zero_order'"):
        compartment_model(1, "zero_order")
    model = two_compartment()
    d = make_doses([(0.0, 100.0, 0.0, 1)])
    p = params_for(model)
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['CLL'\]"):
        model(dict(p, CLL=1.0), TIMES, d)
    with pytest.raises(ValueError, match=r"lacks the required parameter\(s\) \['Q', 'V2'\]"):
        model({k: v for k, v in p.items() if k not in ("Q", "V2")}, TIMES, d)
    with pytest.raises(ValueError, match="must be scalars.*'CL'"):
        model(dict(p, CL=np.ones(3)), TIMES, d)
    no_ss = type("D", (), {f: np.zeros(1) for f in ("time", "amt", "rate", "cmt", "mask")})()
    with pytest.raises(TypeError, match=r"doses lacks the field\(s\) \['ss', 'ii'\]"):
        model(p, TIMES, no_ss)
    # check_doses: an unknown compartment, for one subject and for a batch
    model.check_doses(d)
    bad = make_doses([(0.0, 100.0, 0.0, 1), (5.0, 10.0, 0.0, 4)])
    with pytest.raises(ValueError, match=r"index \(1,\).*cmt=4.*valid compartments: \{1: "
                       r"'depot', 2: 'central', 3: 'peripheral'\}"):
        model.check_doses(bad)
    with pytest.raises(ValueError, match=r"index \(1, 1\).*cmt=4"):
        model.check_doses(stack([d, bad]))
    model.check_doses(make_doses([(0.0, 100.0, 0.0, 1)], pad=JUNK))  # padding is ignored
    # inside jit the same doses cannot raise: the subject's predictions are NaN instead
    with jax.enable_x64(True):  # (the programs compiled by the tests above)
        out = predict(model_for(2, "first_order"), params_for(model), [d, bad])
        assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))
        ss_dose = make_doses([(0.0, 100.0, 0.0, 1, True, 12.0)])
        out = predict(LINEAR_ODE, dict(TRUE, F=1.0), [d, ss_dose])
        assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))
    with pytest.raises(ValueError, match="ss=True with ii=0"):
        model.check_doses(make_doses([(0.0, 100.0, 0.0, 1, True, 0.0)]))
    with pytest.raises(ValueError, match="duration amt/rate=10 longer than its interval ii=8"):
        model.check_doses(make_doses([(0.0, 100.0, 10.0, 2, True, 8.0)]))
    with pytest.raises(ValueError, match="rate=-1 < 0"):
        model.check_doses(make_doses([(0.0, 100.0, -1.0, 2)]))
    # ODE models: no steady state, compartments and arguments checked
    with pytest.raises(ValueError, match="steady-state doses are not supported"):
        MM_ODE.check_doses(make_doses([(0.0, 100.0, 0.0, 1, True, 12.0)]))
    with pytest.raises(ValueError, match=r"cmt=3 .*valid compartments: \{1: 'depot', 2: "
                       r"'central'\}"):
        MM_ODE.check_doses(make_doses([(0.0, 100.0, 0.0, 3)]))
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['CL'\]"):
        MM_ODE(dict(V=1.0, KA=1.0, VM=1.0, KM=1.0, CL=1.0), TIMES, d)
    with pytest.raises(ValueError, match="volume='V' is not among param_names"):
        ode_model(mm_rhs, 2, param_names=("KA", "VM", "KM"))
    with pytest.raises(ValueError, match="central=3 is not a compartment"):
        ode_model(mm_rhs, 2, central=3, param_names=("V", "KA", "VM", "KM"))
    with pytest.raises(ValueError, match="needs dt0="):
        ode_model(mm_rhs, 2, param_names=("V", "KA", "VM", "KM"),
                  stepsize_controller=diffrax.ConstantStepSize())
    bad_rhs = ode_model(lambda t, A, p: A[:1], 2, param_names=("V",))
    with pytest.raises(ValueError, match=r"must return dA/dt of shape \(2,\)"):
        bad_rhs({"V": 1.0}, TIMES, d)


# ----------------------------------------------------------------------------- specialisation
# subjects whose doses use a few routes each; in float64 the specialised model (the same
# operations on the same values, less the statically-zero terms) equals the general one to
# round-off: measured <= 2e-16 relative (values), <= 6e-15 (gradients)
ROUTE_CASES = {
    (1, None): [[(1.0, 100.0, 0.0, 1), (9.5, 60.0, 0.0, 1), (26.0, 80.0, 0.0, 1)]] * 3,
    (1, "first_order"): [[(1.0, 100.0, 0.0, 1), (9.5, 60.0, 0.0, 1)], [(2.0, 80.0, 0.0, 1)],
                         [(0.5, 50.0, 0.0, 1), (30.0, 40.0, 0.0, 1)]],
    (2, None): [[(0.5, 120.0, 30.0, 1), (24.0, 80.0, 80.0, 1)], [(3.0, 50.0, 10.0, 2)],
                [(1.0, 100.0, 40.0, 1), (20.0, 30.0, 5.0, 2)]],
    (3, "first_order"): [
        [(5.0, 70.0, 0.0, 1), (20.0, 100.0, 40.0, 1, True, 12.0), (40.0, 60.0, 0.0, 2)],
        [(2.0, 90.0, 0.0, 2, True, 8.0), (30.0, 50.0, 0.0, 1)],
        [(10.0, 40.0, 0.0, 1, True, 24.0)],
    ],
}
ROUTES = {
    (1, None): ({("bolus", 1)}, False),
    (1, "first_order"): ({("bolus", 1)}, False),
    (2, None): ({("infusion", 1), ("infusion", 2)}, False),
    (3, "first_order"): ({("bolus", 1), ("infusion", 1), ("bolus", 2)}, True),
}


def test_specialised_models_equal_the_general_one():
    """for_doses on data with IV boluses (Phenobarb's route), oral doses (Theophylline's),
    infusions into the central and peripheral compartments (2 compartments), and steady
    state (boluses and an infusion into the depot, central boluses; 3 compartments): the
    routes found, and predictions equal to the general model's to 1e-13 relative, with
    TLAG and F estimated and (one compartment) without them -- then their code is not
    traced -- against the general model with TLAG = 0, F = 1; gradients too (1e-12)."""
    with jax.enable_x64(True):
        for (n, a), rows in ROUTE_CASES.items():
            general = model_for(n, a)
            cases = [make_doses(r, pad=JUNK) for r in rows]
            special = general.for_doses(stack(cases))
            assert (set(special.routes), special.steady_state) == ROUTES[(n, a)]
            assert special.is_specialized and not general.is_specialized
            p = params_for(general)
            ref = predict(general, p, cases)
            np.testing.assert_allclose(predict(special, p, cases), ref, rtol=1e-13, atol=0)
            if n == 1:  # no TLAG, no F
                bare = {k: v for k, v in p.items() if k in general.param_names}
                neutral = dict(p, TLAG=0.0, F=1.0)
                np.testing.assert_allclose(predict(special, bare, cases),
                                           predict(general, neutral, cases), rtol=1e-13, atol=0)
        # gradients (oral, F and TLAG estimated; the padding holds NaN)
        general = model_for(1, "first_order")
        d = make_doses(ROUTE_CASES[(1, "first_order")][0], pad=JUNK)
        special = general.for_doses(d)
        names = general.param_names + ("TLAG", "F")
        v0 = np.log([TRUE[k] for k in names])

        def grad(model):
            def loglik(v):
                return jnp.sum(jnp.log1p(model(dict(zip(names, jnp.exp(v), strict=True)),
                                               TIMES, d)))

            return jax.jit(jax.grad(loglik))(v0)

        np.testing.assert_allclose(grad(special), grad(general), rtol=1e-12)


def test_specialised_models_refuse_other_routes():
    """A specialised model refuses the doses of other routes: check_doses raises (naming the
    dose, its route, the routes it computes and how to rebuild), inside jit the subject's
    predictions are NaN; specialize checks its routes."""
    with jax.enable_x64(True):
        general = model_for(1, "first_order")
        cases = [make_doses(r, pad=JUNK) for r in ROUTE_CASES[(1, "first_order")]]
        oral = general.for_doses(stack(cases))
        oral.check_doses(stack(cases))  # its own data pass
        infusion = make_doses([(0.0, 100.0, 0.0, 1), (5.0, 50.0, 10.0, 1)])
        with pytest.raises(ValueError, match=r"index \(1,\).*an infusion into compartment 1 "
                           r"\('depot'\) is not a route of .*specialised by for_doses to the "
                           r"routes \[bolus into 1\] without steady state.*Rebuild the "
                           r"structural model with model.for_doses\(doses\)"):
            oral.check_doses(infusion)
        iv = make_doses([(0.0, 100.0, 0.0, 2)])
        with pytest.raises(ValueError, match=r"index \(1, 0\).*a bolus into compartment 2 "
                           r"\('central'\)"):
            oral.check_doses(stack([cases[0], iv]))
        steady = make_doses([(0.0, 100.0, 0.0, 1, True, 12.0)])
        with pytest.raises(ValueError, match=r"a steady-state bolus into compartment 1.*without "
                           r"steady state"):
            oral.check_doses(steady)
        with pytest.raises(ValueError, match=r"cmt=3 is not a compartment"):  # as the general
            oral.check_doses(make_doses([(0.0, 100.0, 0.0, 3)]))
        with pytest.raises(ValueError, match=r"cmt=3 is not a compartment"):
            general.for_doses(make_doses([(0.0, 100.0, 0.0, 3)]))
        # inside jit: NaN for the subjects with a route not computed, the others unchanged
        out = predict(oral, params_for(general), [cases[0], infusion, iv, steady])
        assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1:]))
        # rebuilt for the new data (from the specialised model too)
        rebuilt = oral.for_doses(stack([cases[0], infusion, iv, steady]))
        assert rebuilt.routes == {("bolus", 1), ("infusion", 1), ("bolus", 2)}
        assert rebuilt.steady_state
    with pytest.raises(ValueError, match=r"kind 'oral' is not one of \['bolus', 'infusion'\]"):
        general.specialize([("oral", 1)])
    with pytest.raises(ValueError, match=r"cmt=4 is not a compartment"):
        general.specialize([("bolus", 4)])
    with pytest.raises(TypeError, match=r"\(kind, cmt\) pairs"):
        general.specialize(["bolus"])
    with pytest.raises(TypeError, match="steady_state must be a bool"):
        general.specialize([("bolus", 1)], steady_state="yes")


def test_specialised_models_keep_the_contract():
    """The specialised model keeps the attributes of the structural-function contract, is
    built once per set of routes (the same object: compiled programs are reused), rebuilds
    from a specialised model, and predicts 0 without any real dose; the Phenobarb data are
    IV boluses into compartment 1 only."""
    from numpyro_fed.nlme.data import load_phenobarb

    general = two_compartment(absorption=None)
    pheno = general.for_doses(load_phenobarb().doses)
    assert pheno.routes == {("bolus", 1)} and not pheno.steady_state
    for attr in ("param_names", "optional_params", "compartments", "default_dose_cmt",
                 "observed_cmt", "n_compartments", "absorption", "supports_steady_state"):
        assert getattr(pheno, attr) == getattr(general, attr), attr
    assert isinstance(pheno, type(general)) and callable(pheno.check_doses)
    assert repr(pheno) == ("compartment_model(n_compartments=2, absorption=None)"
                           ".specialize([('bolus', 1)], steady_state=False)")
    d = make_doses([(0.0, 100.0, 0.0, 1), (5.0, 50.0, 0.0, 1)])
    assert general.for_doses(d) is pheno and pheno.for_doses(d) is pheno
    assert general.specialize([("bolus", 1)]) is pheno
    ss = pheno.for_doses(make_doses([(0.0, 100.0, 0.0, 1, True, 12.0)]))
    assert ss.steady_state and ss.routes == {("bolus", 1)} and ss is not pheno
    every = [(k, c) for k in ("bolus", "infusion") for c in (1, 2)]
    assert pheno.specialize(every, steady_state=True) is general
    # no real dose: no route, a prediction of 0 (padding only, NaN in it)
    empty = make_doses([], pad=JUNK)
    none = general.for_doses(empty)
    assert none.routes == frozenset()
    out = none({"CL": 3.0, "V": 20.0, "Q": 4.0, "V2": 50.0}, TIMES[:3], empty)
    np.testing.assert_array_equal(out, np.zeros(3))
