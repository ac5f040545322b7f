"""The result of an MCMC-SAEM fit (:class:`SAEMResult`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.scipy.stats import norm

from numpyro_fed import _programs
from numpyro_fed._validation import check_int, check_positive_float
from numpyro_fed.errors import ConvergenceWarning, SingularFitWarning  # also re-exported
from numpyro_fed.saem import information as info_mod
from numpyro_fed.saem import likelihood as lik
from numpyro_fed.saem.model import (
    ModelInfo,
    SubjectLayout,
    centred_score_hess,
    jit_loop,
    jit_once,
    joint_layout,
    merge_data,
    split_data,
)
from numpyro_fed.saem.mstep import (
    VARIANCE_FLOOR,
    _mvn_rule_params,
    mvn_rule_covariance,
    unwrap_mvn,
    unwrap_normal,
)

__all__ = ["SAEMResult", "ConvergenceWarning", "SingularFitWarning", "StandardErrors",
           "boundary_collapse", "singular_coords", "missing_ratio"]


#: a coordinate whose distance to the boundary of its support fell below this fraction of
#: the largest distance it had before (from theta_0 on) is "heading to its boundary": three
#: orders of magnitude (a standard deviation of 1 becoming 0.001) is no longer a Monte Carlo
#: fluctuation of a well-defined estimate (those are a few percent in the final phase), and
#: NONMEM's own boundary test flags far smaller moves
BOUNDARY_RATIO = 1e-3

#: a coordinate that came within :data:`BOUNDARY_RATIO` of its boundary during the fit and
#: whose median over the last quarter is within this fraction of its largest distance also
#: ends at the boundary (a singular fit): sqrt(BOUNDARY_RATIO), a variance within 1e-3 of
#: its largest value. The interweaving cycle's Monte Carlo noise keeps a variance whose
#: maximum-likelihood value is 0 at a standard deviation of order sqrt(gamma_k) above its
#: floor, not at the floor (its score in the standard deviation has a noise term that does
#: not shrink with it): Dyestuff2's tau ended at 2.6e-3..1.2e-2 of its largest value on
#: seeds 0, 2, 3 and a 30-subject normal-normal model's omega at 2.1e-3 / 4.0e-3 (seeds
#: 0 / 7), each after coming within 6.4e-5 of it, and were not reported singular
BOUNDARY_SETTLED_RATIO = BOUNDARY_RATIO ** 0.5


#: how the message of a boundary (singular) fit begins (:meth:`SAEMResult.check_convergence`)
_SINGULAR_PREFIX = "SAEM: boundary (singular) fit: "

#: a random-effect standard deviation whose median over the last quarter of the fit is below
#: this fraction of its largest value gets the slope of the likelihood at 0
#: (:meth:`SAEMResult.boundary_slope`): at most :data:`BOUNDARY_SETTLED_RATIO` of it and a
#: slope <= 0, a boundary fit; above, a fit still approaching the boundary maximum at EM's
#: sublinear pace (normal-normal, 30 subjects, seeds 11 and 25 of 40: MLE 0, estimates
#: 0.047 and 0.22, no message before)
BOUNDARY_SLOPE_RATIO = 0.25

#: a full random-effect covariance whose correlation matrix has a smallest eigenvalue below
#: this at the estimate (a 2x2 correlation beyond +-0.98) gets the slope of the likelihood at
#: the singular covariance next to it (:meth:`SAEMResult.covariance_face_slope`): <= 0 there,
#: a boundary (singular) fit, as lme4 reports one. SAEM approaches a correlation of +-1 at
#: EM's sublinear pace: nlme::Relaxin (exact ML correlation +1) ended at 0.997-0.999 on seeds
#: 0-2, its Cholesky diagonal at 4-8% of its largest value, never near the variance floor;
#: datasets::ChickWeight's interior -0.95 (0.10) stays below it
COV_FACE_CORR = 0.02

#: fewest iterations of the final (decreasing-step) phase. The drift test compares means over
#: its quarters (12 iterations each at 50), and the averaging needs them: at gamma_k =
#: k^(-2/3), iteration 50 still carries sqrt(gamma/2) ~ 20% of one draw's Monte Carlo noise;
#: saemix's final phase is 100 iterations, SAEM's default 200
MIN_FINAL_ITERS = 50
#: fewest exploration iterations (when there is an exploration phase): the adaptive E-step
#: tunes its step sizes (dual averaging needs tens of iterations) and the variances are
#: annealed during it
MIN_EXPLORATION_ITERS = 20
#: an estimate moving across the last half of the final phase by more than this many of its
#: standard errors has not reached the maximum: its end point is then further from the
#: maximum than the targets of tests/test_saem_defaults.py (0.2 SE for fixed effects, 0.3 SE
#: for variances). Measured on default fits that meet those targets (the change along the
#: least-squares line, largest coordinate): dyestuff 0.061 / 0.043 (seeds 0 / 1),
#: sleepstudy 0.064, theoph_long 0.030 / 0.082 (seeds 0 / 2), cbpp 0.040, orthodont 0.084
#: (seed 3), loblolly 0.020, orange 0.017, epil 0.187 / 0.089 (seeds 0 / 1): the threshold
#: is 1.6 times the largest
DRIFT_SE = 0.3
#: lowest acceptance rate of the E-step (and fraction of consecutive latent draws that
#: differ) over the final phase: the adaptive MALA aims at 0.574; at 5%, the 200 draws at the
#: final theta hold about 10 distinct points -- too few for the Louis information or for the
#: likelihood's importance-sampling proposals
MIN_ACCEPT = 0.05


def _half_drift(seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Change of the mean between the two halves of ``seg`` (rows: iterations) and its Monte
    Carlo standard error, from batch means over ~10 iterations (the iterates are
    autocorrelated: batch means keep that in the error)."""
    h = len(seg) // 2
    a, b = seg[:h], seg[h:2 * h]
    nbm = max(h // 10, 2)

    def se_mean(x):
        m = len(x) // nbm
        bm = x[: m * nbm].reshape(nbm, m, -1).mean(1)
        return bm.std(0, ddof=1) / np.sqrt(nbm)

    return b.mean(0) - a.mean(0), np.sqrt(se_mean(a) ** 2 + se_mean(b) ** 2)


def _trend(seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares change of each column of ``seg`` (rows: iterations) across the segment,
    ``slope * len(seg)``, and its Monte Carlo standard error: the residuals of the line are
    autocorrelated (SA iterates), so their long-run variance is estimated by batch means
    (~10 batches) and carried into the slope's variance."""
    n = len(seg)
    t = np.arange(n, dtype=np.float64) - (n - 1) / 2.0
    stt = float(t @ t)
    xc = seg - seg.mean(0)
    slope = (t @ xc) / stt
    r = xc - np.outer(t, slope)
    nb = max(min(10, n // 5), 2)
    m = n // nb
    bm = r[: m * nb].reshape(nb, m, -1).mean(1)
    lrv = m * bm.var(0, ddof=1)  # long-run variance of one residual
    return slope * n, np.sqrt(lrv / stt) * n


def _boundary_coords(info) -> list[tuple[int, str, float, int]]:
    """``(flat constrained index, name, bound, sign)`` for every coordinate of theta whose
    support has a finite boundary: ``sign * (x - bound) > 0`` inside. Lower/upper bounds of
    elementwise constraints (``positive``, ``interval``, ...); the diagonal of covariance
    and Cholesky parameters (bound 0: a variance of the matrix collapsing)."""
    out = []
    for i, n in enumerate(info.param_names):
        c = info.param_constraints[n]
        off = int(info.param_offsets[i])
        size = int(info.param_offsets[i + 1]) - off
        names = info.theta_coord_names[off:off + size]
        lo, hi = getattr(c, "lower_bound", None), getattr(c, "upper_bound", None)
        if getattr(c, "event_dim", 0) == 0 and (lo is not None or hi is not None):
            for j in range(size):
                if lo is not None and np.all(np.isfinite(lo)):
                    out.append((off + j, names[j], float(np.reshape(lo, -1)[0]), 1))
                if hi is not None and np.all(np.isfinite(hi)):
                    out.append((off + j, names[j], float(np.reshape(hi, -1)[0]), -1))
        elif type(c).__name__ in ("_PositiveDefinite", "_LowerCholesky",
                                  "_ScaledUnitLowerCholesky", "_SoftplusLowerCholesky",
                                  "_PositiveSemiDefinite"):
            shape = np.shape(info.theta0_c[n])
            if len(shape) == 2 and shape[0] == shape[1]:
                for j in range(shape[0]):
                    k = j * shape[1] + j
                    out.append((off + k, names[k], 0.0, 1))
    return out


def boundary_collapse(info, theta_c: np.ndarray, theta0_c: np.ndarray | None = None):
    """The coordinate of theta heading fastest to the boundary of its support along the
    trajectory ``theta_c`` (rows: iterations, constrained flat coordinates), or ``None``.

    A coordinate heads to its boundary when its distance to it falls below
    :data:`BOUNDARY_RATIO` times the largest distance it had before (``theta0_c`` included):
    a variance whose maximum-likelihood estimate is 0 (a random effect the data do not
    show, every observation equal) goes there geometrically under EM.

    :return: ``None`` or a dict with ``name``, ``bound``, ``value`` (its value at
        ``iteration``, the 1-based row where the ratio is smallest), ``ratio`` and
        ``reference`` (the value it fell from).
    """
    rows = np.asarray(theta_c, np.float64)
    if theta0_c is not None:
        rows = np.concatenate([np.asarray(theta0_c, np.float64).reshape(1, -1), rows])
    first = 0 if theta0_c is None else 1
    best = None
    for j, name, bound, sign in _boundary_coords(info):
        d = sign * (rows[:, j] - bound)
        ok = np.isfinite(d)
        if ok.sum() < 2:
            continue
        d = np.where(ok, d, np.nan)
        run_max = np.fmax.accumulate(np.where(ok, d, -np.inf))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(ok & (run_max > 0), d / run_max, np.nan)
        ratio[: first + 1] = np.nan  # a row is compared with those before it
        if not np.any(np.isfinite(ratio)):
            continue
        k = int(np.nanargmin(ratio))
        r = float(ratio[k])
        if r < BOUNDARY_RATIO and (best is None or r < best["ratio"]):
            ref = int(np.nanargmax(np.where(ok[: k + 1], d[: k + 1], -np.inf)))
            best = {"name": name, "bound": bound, "value": float(rows[k, j]),
                    "iteration": k - first + 1, "ratio": r, "reference": float(rows[ref, j])}
    return best


def singular_coords(info, theta_c: np.ndarray, theta0_c: np.ndarray | None = None) -> list:
    """Indices (flat constrained) of the coordinates of theta that *end* at the boundary of
    their support: over the last quarter of the trajectory ``theta_c`` (rows: iterations)
    their largest distance to the bound is below :data:`BOUNDARY_RATIO` times the largest
    distance they had (``theta0_c`` included) -- a variance held at the M-step's floor
    (:data:`~numpyro_fed.saem.mstep.VARIANCE_FLOOR`), whose maximum-likelihood value is 0 --
    or, for a coordinate whose distance fell below :data:`BOUNDARY_RATIO` times the largest
    it had so far at some iteration, whose median distance over the last quarter is below
    :data:`BOUNDARY_SETTLED_RATIO` times the largest (the Monte Carlo noise around the floor
    of a variance whose MLE is 0: dyestuff2 seed 3 reached the boundary maximum, its tail's
    median at 0.010 of the largest and single iterates up to 0.033, above the threshold)."""
    rows = np.asarray(theta_c, np.float64)
    if rows.ndim != 2 or len(rows) < 2:
        return []
    allr = rows if theta0_c is None else np.concatenate(
        [np.asarray(theta0_c, np.float64).reshape(1, -1), rows])
    tail = rows[-max(len(rows) // 4, 1):]
    out = []
    for j, _, bound, sign in _boundary_coords(info):
        d_all, d_tail = sign * (allr[:, j] - bound), sign * (tail[:, j] - bound)
        if not (np.all(np.isfinite(d_tail)) and np.any(np.isfinite(d_all))):
            continue
        ref = np.nanmax(d_all)
        if not ref > 0:
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            low = np.nanmin(d_all / np.fmax.accumulate(np.where(np.isfinite(d_all), d_all,
                                                                 -np.inf)))
        if np.max(d_tail) < BOUNDARY_RATIO * ref:
            out.append(j)
        elif (low < BOUNDARY_RATIO and np.median(d_tail) < BOUNDARY_SETTLED_RATIO * ref
              and not _climbing(d_tail, ref)):
            out.append(j)
    return out


#: a coordinate near its bound is coming back from it (not singular) when the least-squares
#: line of its log-distance to the bound rises across the last quarter by more than this
#: factor, significantly (3 Monte Carlo SE)
CLIMB_FACTOR = 2.0


def _climbing(d_tail: np.ndarray, ref: float) -> bool:
    """Whether the distances to the bound ``d_tail`` (the last quarter) climb away from it:
    an interior variance that fell near its floor during exploration and is recovering
    (nlme's Assay, seed 3: tau_block fell to 2e-4 of its largest value, then rose through
    the last quarter from 0.009 to 0.027 of it, a factor 3, towards its interior MLE at 0.04
    -- reported singular with no SE before). The Monte Carlo noise of a variance whose MLE is
    0 shrinks with the steps instead: its tail's second half sits at 0.3-1.0 times its first
    half (Dyestuff2 seeds 0-3, the normal-normal model's seeds 0 and 7, Assay's boundary
    variance on seeds 0 and 3)."""
    if len(d_tail) < 10:
        return False
    logd = np.log(np.maximum(d_tail, 1e-30 * ref))[:, None]
    diff, se = _trend(logd)
    return bool(diff[0] > np.log(CLIMB_FACTOR) and diff[0] > 3.0 * se[0])


#: a coordinate "ran off" when it moved from theta_0 by more than this many units of
#: ``1 + |start|`` (a location) or by a factor e^RUNOFF towards or away from its bound (a
#: scale): a factor 20 in a few iterations is not an estimate settling
RUNOFF = 3.0


def run_off(info, theta_c: np.ndarray, theta0_c: np.ndarray, top: int = 2) -> list[dict]:
    """The coordinates of theta that moved furthest from ``theta0_c`` by the last row of
    ``theta_c`` (constrained flat), when beyond :data:`RUNOFF`: ``[{name, start, value}]``,
    the furthest first. Bounded coordinates are measured on the log of their distance to
    the bound, the others relative to ``1 + |start|``."""
    rows = np.asarray(theta_c, np.float64)
    if rows.ndim != 2 or not len(rows):
        return []
    last, start = rows[-1], np.asarray(theta0_c, np.float64).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.abs(last - start) / (1.0 + np.abs(start))
        for j, _, bound, sign in _boundary_coords(info):
            score[j] = abs(np.log(sign * (last[j] - bound)) - np.log(sign * (start[j] - bound)))
    score = np.where(np.isfinite(score), score, 0.0)
    order = [int(j) for j in np.argsort(-score) if score[j] > RUNOFF][:top]
    names = info.theta_coord_names
    return [{"name": names[j], "start": float(start[j]), "value": float(last[j])}
            for j in order]


def _draw_mean_and_se(d, T: int, C: int) -> tuple[float, float]:
    """Mean of a per-draw quantity ``d`` (``T * C`` values: T draws of C chains) and its Monte
    Carlo SE, from batch means over the draws (10 batches: the draws are autocorrelated)."""
    d = np.asarray(d, np.float64).reshape(T, C).mean(1)
    B = min(10, T)
    bm = np.array([b.mean() for b in np.array_split(d, B)])
    se = float(np.std(bm, ddof=1) / np.sqrt(B)) if B > 1 else float("nan")
    return float(d.mean()), se


def _matrix_diagonal(info, name: str) -> bool:
    """Whether the constrained coordinate ``name`` is a diagonal entry of a covariance or
    Cholesky matrix parameter (its boundary 0: the matrix singular, not one random effect
    absent)."""
    for n in info.param_names:
        shape = np.shape(info.theta0_c[n])
        if len(shape) == 2 and shape[0] == shape[1] and name.startswith(f"{n}["):
            return True
    return False


def boundary_advice(b: dict, info=None) -> str:
    """What to do about a parameter at the boundary of its support."""
    if info is not None and _matrix_diagonal(info, b["name"]):
        return (f"the maximum-likelihood covariance is probably singular ('{b['name']}', a "
                "diagonal entry of its factor, at 0: a correlation of +-1, or a variance 0, "
                "the random effects linearly dependent across groups). A diagonal "
                "covariance or fewer random effects may describe the data as well (compare "
                "the -2LL); estimates and standard errors at a boundary are not regular")
    return (f"the maximum-likelihood estimate of '{b['name']}' is probably its boundary "
            f"{b['bound']:g} (a variance or scale the data do not support: every subject "
            "alike, all observations equal, a random effect or error term with nothing to "
            "describe). Remove that random effect or error term from the model (or fix "
            f"'{b['name']}'), or check the data; estimates and standard errors at a boundary "
            "are not regular")


#: largest relative Monte Carlo error of a standard error, estimated from the Louis
#: information's missing part (:func:`missing_ratio`), before :meth:`SAEMResult.
#: standard_errors` warns that it is uncertain
SE_MC_REL = 0.1
#: relative Monte Carlo error of a standard error beyond which it is reported NaN: the value
#: could be anything from 0 to twice its size (grouseticks' three nested intercepts, Louis on
#: 400 draws: a missing information 3214x the variance, an SE of 0.0035 against the exact
#: 0.239)
SE_MC_MAX = 1.0
#: most draws per chain that the Louis precision warning advises (``num_draws``): beyond, a
#: fit cannot reasonably run them (``num_draws`` is at most
#: :data:`~numpyro_fed.saem.schedule.MAX_ITERATIONS`) and it advises the marginal
#: likelihood's Hessian instead (grouseticks' nested intercepts: 258,311,773 was advised)
LOUIS_MAX_ADVISED_DRAWS = 100_000

#: most latent coordinates per group for the importance-sampling information
#: (``fisher_information(method="is")``, chosen by ``"auto"`` between the Gauss--Hermite
#: limit and this): a multivariate-t proposal's effective sample size falls with the
#: dimension; beyond it the Louis identity on the fit's MCMC draws is used
IS_MAX_LATENTS = 10
#: importance draws per group of ``fisher_information(method="is")`` (4 times as many when
#: the Monte Carlo error of a standard error is above SE_MC_REL with these). Measured on
#: cbpp_olre (5 latents per herd): 4000 draws, batch error up to 17%, SE ratios 0.955 /
#: 0.967; 16000: up to 2%, 0.968 / 0.986
IS_NUM_SAMPLES = 4000


def missing_ratio(obs: np.ndarray, miss: np.ndarray) -> np.ndarray:
    r"""Per coordinate of theta (unconstrained), how many times its variance
    :math:`(I_{obs}^{-1})_{kk}` its part from the missing information is,
    :math:`r_k = (I_{obs}^{-1} I_{miss} I_{obs}^{-1})_{kk} / (I_{obs}^{-1})_{kk}`: the Louis
    estimate :math:`I_{obs} = I_{complete} - I_{miss}` carries the Monte Carlo error of
    :math:`I_{miss}` (relative ~ :math:`\sqrt{2/S}` from S draws) multiplied by :math:`r_k`
    into the variance of coordinate k, so its standard error has a relative error of about
    :math:`r_k / \sqrt{2S}`. NaN where :math:`I_{obs}` is not invertible.

    Measured (SE ours / exact, 400 draws): Orthodont's slope variance, r = 14-22: SE ratios
    0.47-0.79 on seeds 0-1 (0.88-1.19 with 4000 draws); Dyestuff, sleepstudy, Theophylline:
    ratios 0.94-1.02."""
    try:
        C = np.linalg.inv(obs)
    except np.linalg.LinAlgError:
        return np.full(obs.shape[0], np.nan)
    v = np.diag(C)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(v > 0, np.diag(C @ miss @ C) / v, np.nan)


def _signature(tree) -> tuple:
    """The structure and the abstract type (shape, dtype, weak type) of every leaf: a
    compiled program runs exactly on arguments of one signature."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(jax.typeof(x) for x in leaves)


def _abstract(x) -> jax.ShapeDtypeStruct:
    t = jax.typeof(x)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type)


def _jacobian(phi: Callable, theta: jax.Array, hessian: bool = False):
    """The Jacobian of the coordinate map ``phi`` at ``theta`` (and its Hessian with
    ``hessian``) as float64 host arrays, from one compiled program (content-keyed, see
    :mod:`numpyro_fed._programs`): evaluated op by op, the derivatives of a model's
    coordinate maps dispatched about a thousand operations, 0.3 s of a Theophylline
    ``parameter_table()``."""
    def coordinate_derivatives(t):
        J = jax.jacfwd(phi)(t)
        return (J, jax.hessian(phi)(t)) if hessian else J

    out = jit_once(coordinate_derivatives)(theta)
    return jax.tree.map(lambda a: np.asarray(a, np.float64), out)


def warm_programs(result_fields: dict, busy: Callable[[], bool]) -> dict:
    """Trace and compile, while ``busy()`` (the fit's loop still runs), the programs that the
    standard errors of a result with these fields would compile, in the order the default
    path needs them: the conditional modes, the Gaussianity check, then the information of
    the method ``"auto"`` picks for a model that is not linear Gaussian (Gauss--Hermite up
    to :data:`~numpyro_fed.saem.information.GH_MAX_LATENTS` latents per group, importance
    sampling up to :data:`IS_MAX_LATENTS`, else the Louis identity).

    Nothing runs: each step runs abstractly (under :func:`jax.eval_shape`: an eager
    operation would wait for the running loop, XLA:CPU executing in order), its programs
    are traced on the abstract types of their arguments (the outputs of a program are zeros
    of its output types) and compiled into the content-keyed cache
    (:mod:`numpyro_fed._programs`). The compiled loop runs on XLA's threads while this one
    traces and compiles, so these overlap the iterations instead of following them. It
    stops between two programs once the loop is done, so a fit whose standard errors are
    never asked for waits for at most one program.

    :param result_fields: ``info, layout, ids, args, kwargs`` of the result, ``theta``
        (flat unconstrained, zeros), ``z_draws`` (``(T, C, d_z)`` zeros), ``centring``.
    :return: ``{program key: (argument signature, compiled runner)}`` for
        :attr:`SAEMResult._warm` -- used by the fit's own convergence check when the
        signature matches, then dropped.
    """
    shadow = SAEMResult.__new__(SAEMResult)
    shadow.__dict__.update(result_fields)
    shadow.__dict__.update(
        _programs={}, _warm=None, _compiled={}, _mode_cache=None, _exact_cache=None,
        singular_params=[], _fisher={})
    lay = shadow.layout if shadow.layout is not None else joint_layout(shadow.info)
    steps = [shadow._modes,
             lambda: shadow._gaussian_exact(random.key(0), jnp.asarray(shadow.z_draws))]
    if lay.q <= info_mod.GH_MAX_LATENTS:
        steps.append(lambda: shadow._node_information("gq"))
    elif lay.q <= IS_MAX_LATENTS:
        steps.append(lambda: shadow._node_information(
            "is", num_samples=IS_NUM_SAMPLES, rng_key=random.key(0)))
    else:
        steps.append(shadow._louis_information)
    for step in steps:
        if not busy():
            break
        try:
            jax.eval_shape(lambda step=step: (step(), None)[1])
        except Exception:  # noqa: BLE001
            # a speculative compilation only: the fit's own path traces the same program
            # again and raises there if it must (as without warming); the suite re-raises
            if _programs.VERIFY_TRACE_KEYS:
                raise
            break
    return shadow._compiled


def _slope_message(kind: str, name: str, value: float, ratio: float, slope: str) -> str:
    """What the likelihood's slope at 0 says of a random-effect scale ending near 0
    (:meth:`SAEMResult.check_convergence`): ``settled`` (a boundary fit), ``short`` (a
    boundary maximum not reached yet), ``refuted`` (a collapse, not a maximum)."""
    if kind == "settled":
        return (f"{_SINGULAR_PREFIX}'{name}' ends at {value:.3g} ({ratio:.2g} of its largest "
                "value over the last quarter) and the log-likelihood decreases away from 0 "
                f"along it ({slope}): its maximum-likelihood value is 0 and the estimates are "
                "the maximum on the boundary, the -2LL that of the fit (lme4 reports such a "
                "fit as 'boundary (singular) fit').")
    if kind == "short":
        return (f"SAEM: '{name}' ends at {value:.3g}, but the log-likelihood decreases away "
                f"from 0 along it ({slope}): 0 is a maximum along it, probably the maximum (a "
                "boundary fit), which the fit was still approaching at EM's slow pace near a "
                "boundary. Lengthen the final phase (Schedule(num_iters=...)) or compare the "
                "-2LL with that variance fixed at 0.")
    return (f"SAEM: '{name}' ends at {value:.3g}, near 0, but the log-likelihood increases "
            f"away from 0 along it ({slope}): 0 is not its maximum, the variance collapsed on "
            "the way; refit with a larger initial value (init_params) or a longer exploration "
            "phase.")


def _face_message(site: str, f: dict) -> str:
    """What :meth:`SAEMResult.covariance_face_slope` says of a full covariance ending nearly
    singular (:meth:`SAEMResult._covariance_faces`)."""
    corr = f["correlation"]
    rho = (f", correlation {corr[1, 0]:+.4f}" if corr.shape == (2, 2) else "")
    slope = (f"d log L / d variance along its smallest eigenvector = {f['slope']:.3g}, Monte "
             f"Carlo SE {f['se']:.2g}")
    if f["kind"] == "face":
        return (f"{_SINGULAR_PREFIX}the covariance of '{site}' ends nearly singular (smallest "
                f"eigenvalue of its correlation matrix {f['min_corr_eigenvalue']:.2g}{rho}) and "
                "the log-likelihood decreases away from the singular covariance next to it "
                f"({slope}): the maximum-likelihood covariance is singular (a correlation of "
                f"+-1, or a variance 0) and the estimates approach it ({f['names']} towards "
                "0), the -2LL that of the fit (lme4 reports such a fit as 'boundary (singular) "
                "fit'). A diagonal covariance or fewer random effects may describe the data "
                "as well (compare the -2LL); estimates and standard errors at a boundary are "
                "not regular.")
    return (f"SAEM: {f['names']} end near 0, but the log-likelihood increases away from the "
            f"singular covariance of '{site}' ({slope}): it is not the maximum, the covariance "
            "collapsed on the way; refit with larger initial values (init_params) or a longer "
            "exploration phase.")


class StandardErrors(dict):
    """``{coordinate: standard error}`` with the fit's convergence verdict as attributes
    ``converged`` and ``convergence_messages`` (see :meth:`SAEMResult.check_convergence`)."""

    converged: bool = True
    convergence_messages: list = []


def _exact_tolerance(ll_i):
    """Largest departure of a subject's integrand from its quadratic expansion that is
    rounding (:func:`~numpyro_fed.saem.likelihood.gaussian_exact`): 1e-3 absolute plus 1e-5 of
    the subject's log-likelihood (float32 sums of the log-density terms)."""
    return 1e-3 + 1e-5 * np.abs(np.nan_to_num(np.asarray(ll_i), nan=np.inf))


class SAEMResult:
    """Result of :meth:`SAEM.run <numpyro_fed.saem.SAEM.run>`.

    Attributes: ``params`` (dict of constrained estimates), ``theta`` (flat unconstrained),
    ``trajectory`` (pandas DataFrame, one row per iteration: constrained coordinates, step
    size :math:`\\gamma_k`, acceptance rate), ``idata`` (ArviZ InferenceData of the latent
    draws at the final :math:`\\theta`), ``mstep`` (which M-step ran), ``settings`` (what the
    defaults resolved to: chains, prior proposals, subjects, ...), ``num_params``.
    """

    def __init__(self, *, model, info: ModelInfo, layout: SubjectLayout | None, ids, theta,
                 thetas_u, gammas, accs, zs, accept_final, centring, mstep, args, kwargs,
                 num_exploration, settings, programs: dict | None = None,
                 theta0=None) -> None:
        import pandas as pd

        self.model = model
        self.info, self.layout, self.ids = info, layout, ids
        self.args, self.kwargs = args, kwargs
        self.theta = np.asarray(theta)
        self.params = {n: np.asarray(v) for n, v in info.constrain_theta(
            jnp.asarray(self.theta)).items()}
        tc = np.asarray(jax.vmap(info.theta_c_flat)(jnp.asarray(thetas_u)))
        df = pd.DataFrame(tc, columns=info.theta_coord_names)
        df.insert(0, "gamma", np.asarray(gammas)[: len(df)])
        df["accept_rate"] = accs
        df.index = pd.RangeIndex(1, len(df) + 1, name="iteration")
        self.trajectory = df
        self.z_draws = np.asarray(zs)  # (T, C, d_z) unconstrained
        self.accept_rate_final = accept_final
        #: centring design of the fit (``None``: standard errors were not asked for)
        self.centring = centring
        self._fisher: dict = {}
        self.fisher_method: str | None = None
        self.fisher_mc_error: np.ndarray | None = None
        self._fisher_num_samples: int | None = None
        self.mstep = mstep
        self.num_params = info.dim_theta
        self.num_exploration = int(num_exploration)
        self.settings = dict(settings)
        self._ll: dict = {}
        #: conditional modes and Hessians at theta (see :meth:`_modes`), computed once
        self._mode_cache = None
        #: closed-form per-group values and Gaussianity checks (see :meth:`_gaussian_exact`)
        self._exact_cache = None
        #: the same in float64, when the log-likelihood is reported (:meth:`_gaussian_exact64`)
        self._exact64_cache = None
        #: constrained flat theta_0 (the start of the trajectory), for the boundary check
        self.theta0_c = (None if theta0 is None else
                         np.asarray(info.theta_c_flat(jnp.asarray(theta0))))
        #: what :meth:`check_convergence` found at the end of the fit (empty: converged)
        self.convergence_messages: list[str] = []
        #: names of the coordinates that end at the boundary of their support (a boundary,
        #: or singular, fit: lme4's "boundary (singular) fit"); see :attr:`singular`
        self.singular_params: list[str] = []
        # compiled likelihood programs, shared by every fit of the same structure (the data
        # are arguments), so that a repeated fit does not recompile them
        self._programs = {} if programs is None else programs
        #: programs traced and compiled for this result's data while its fit's loop ran
        #: (:func:`warm_programs`), used by the fit's own convergence check and then dropped
        #: (a later call traces afresh, as every call does); ``None``: compile-only mode of
        #: the shadow result that :func:`warm_programs` drives
        self._warm: dict | None = {}

    def _program(self, name: str, build):
        """A compiled ``f(arrays, ids, *args)`` of ``build(args, kwargs)``, cached per
        structure and name."""
        arrays, static = split_data(self.args, self.kwargs, self.info.static_data)
        key = (name, repr(static))
        prog = self._programs.get(key)
        if prog is None:
            def f(arrays, ids, *a):
                args, kwargs = merge_data(arrays, static)
                return build(args, kwargs, ids)(*a)

            prog = self._programs[key] = jit_loop(f)
        warm = getattr(self, "_warm", {})
        if warm is None:  # the shadow of warm_programs: compile, return zeros of the outputs
            def compile_only(*a):
                full = (arrays, self.ids, *a)
                runner = prog.compiled(*jax.tree.map(_abstract, full))
                self._compiled[key] = (_signature(full), runner)
                # host zeros: a device array would wait for the running loop
                return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                    runner.compiled.out_info)

            return compile_only

        def call(*a):
            full = (arrays, self.ids, *a)
            hit = warm.get(key)
            if hit is not None and hit[0] == _signature(full):
                prog.note(hit[1], *full)  # as if prepared here (a replayed run prepares it)
                return hit[1](*full)
            return prog(*full)

        return call

    # -- estimates ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.info.theta_coord_names)

    def estimates(self) -> dict[str, float]:
        """Flat, named constrained estimates ``{"omega[0]": ..., ...}``."""
        flat = np.asarray(self.info.theta_c_flat(jnp.asarray(self.theta)))
        return dict(zip(self.names, flat.tolist(), strict=True))

    def fisher_information(self, method: str = "auto", *, num_samples: int | None = None,
                           num_nodes: int | None = None,
                           rng_key: jax.Array | None = None) -> np.ndarray:
        """Observed information at :math:`\\hat\\theta` in unconstrained coordinates, minus
        the Hessian of :math:`\\log p(y\\mid\\theta)` (see :mod:`~numpyro_fed.saem.
        information`). The method that ran is :attr:`fisher_method`; the estimated relative
        Monte Carlo error of each unconstrained coordinate's standard error (0 for the
        deterministic methods) is :attr:`fisher_mc_error`.

        :param method:

            - ``"exact"``: the Hessian of the closed-form marginal likelihood of a linear
              Gaussian model (any number of crossed or nested grouping factors; the model is
              checked to be linear Gaussian as for ``log_likelihood(method="exact")``, a
              ``ValueError`` when it is not);
            - ``"gq"``: the Hessian of the adaptive Gauss--Hermite quadrature of each
              group's likelihood, nodes fixed at :math:`\\hat\\theta` (at most
              :data:`~numpyro_fed.saem.information.GH_MAX_LATENTS` latents per group);
            - ``"is"``: the same with ``num_samples`` independent importance draws per group
              (multivariate-t proposals from the conditional moments of the draws): the
              Louis identity under importance weights, its Monte Carlo error estimated from
              8 independent batches of the draws;
            - ``"louis"``: the Louis identity on the fit's MCMC draws at the final
              :math:`\\theta`, :math:`-(\\bar H + \\overline{gg^\\top} - \\bar g\\bar
              g^\\top)` (Louis 1982; Delyon, Lavielle & Moulines 1999, Sec. 6), in the
              centred coordinates of the fit (:func:`~numpyro_fed.saem.model.
              centring_design`); its Monte Carlo error is :func:`missing_ratio`'s estimate
              (independent draws assumed: an underestimate for autocorrelated chains);
            - ``"auto"`` (default): ``"exact"`` for a linear Gaussian model, else ``"gq"``
              with at most 3 latents per group, else ``"is"`` with at most
              :data:`IS_MAX_LATENTS`, else ``"louis"``.

            Why not the Louis identity by default: for a weakly identified variance the
            complete and missing information nearly cancel, and the Monte Carlo error of
            the missing part (a few hundred autocorrelated draws) becomes the error of the
            standard error (Orthodont's slope variance: SE 0.47-0.69 of the exact one).
        :param num_samples: importance draws per group for ``"is"``; default
            :data:`IS_NUM_SAMPLES`, and 4 times as many when the Monte Carlo error of a
            standard error is then above :data:`SE_MC_REL` (the information is kept with
            whichever is larger; it warns, through :meth:`standard_errors`, if still above).
        :param num_nodes: Gauss--Hermite nodes per axis for ``"gq"`` (default 20, 12, 8 for
            1, 2, 3 latents).
        :param rng_key: key of the importance draws (default ``random.key(0)``).
        """
        if method not in ("auto", "exact", "gq", "is", "louis"):
            raise ValueError(
                f"fisher_information(method={method!r}): use 'auto', 'exact', 'gq', 'is' or "
                "'louis'.")
        num_samples = check_int("num_samples", num_samples, minimum=16, allow_none=True,
                                hint=" The importance draws are split in 8 batches.")
        num_nodes = check_int("num_nodes", num_nodes, minimum=1, allow_none=True)
        if self.centring is None:
            raise ValueError("Standard errors need SAEM(..., fisher=True).")
        if not isinstance(getattr(self, "_fisher", None), dict):
            self._fisher = {}
        lay = self.layout if self.layout is not None else joint_layout(self.info)
        requested = method
        if method in ("auto", "exact"):
            if "exact" not in self._fisher:
                ll_i, _, disc = self._gaussian_exact(random.key(0), jnp.asarray(self.z_draws))
                self._fisher["exact"] = (None if not np.all(disc <= _exact_tolerance(ll_i))
                                         else self._exact_information())
            if self._fisher["exact"] is not None:
                method = "exact"
            elif method == "exact":
                raise ValueError(
                    "fisher_information(method='exact'): the model is not linear Gaussian in "
                    "its latents (log p(y, z | theta) is not quadratic in z), so its marginal "
                    "likelihood has no closed form; use method='gq' (at most "
                    f"{info_mod.GH_MAX_LATENTS} latents per group; this model has {lay.q}), "
                    "'is' or 'louis'.")
            else:
                method = ("gq" if lay.q <= info_mod.GH_MAX_LATENTS else
                          "is" if lay.q <= IS_MAX_LATENTS else "louis")
        if method == "gq" and lay.q > info_mod.GH_MAX_LATENTS:
            raise ValueError(
                f"fisher_information(method='gq'): {lay.q} latent coordinates per group (at "
                f"most {info_mod.GH_MAX_LATENTS}); use method='is' or 'louis'.")
        key = (method, num_nodes) if method == "gq" else (
            (method, num_samples, None if rng_key is None else
             tuple(np.asarray(random.key_data(rng_key)).ravel().tolist()))
            if method == "is" else method)
        if key not in self._fisher:
            if method == "louis":
                self._fisher[key] = self._louis_information()
            elif method == "gq":
                self._fisher[key] = self._node_information("gq", num_nodes=num_nodes)
            elif method == "is":
                rk = random.key(0) if rng_key is None else rng_key
                S = IS_NUM_SAMPLES if num_samples is None else num_samples
                out = self._node_information("is", num_samples=S, rng_key=rk)
                if num_samples is None and not np.all(out[1] <= SE_MC_REL):
                    S = 4 * IS_NUM_SAMPLES
                    out = self._node_information("is", num_samples=S, rng_key=rk)
                self._fisher[key] = (*out, S)
        info_u, mc, grad_u = self._fisher[key][:3]
        if method == "is":
            self._fisher_num_samples = self._fisher[key][3]
        if not np.all(np.isfinite(info_u)) and requested == "auto" and method != "louis":
            # a quadrature or importance sum that overflowed: the Louis identity
            if "louis" not in self._fisher:
                self._fisher["louis"] = self._louis_information()
            method = "louis"
            info_u, mc, grad_u = self._fisher["louis"]
        #: which information the standard errors come from (see :meth:`fisher_information`)
        self.fisher_method = method
        #: gradient of the log-likelihood at the estimate, unconstrained coordinates, from the
        #: same method (0 at an exact maximum; the standard errors use it to take the
        #: curvature in the coordinates they report, see :meth:`_information_in`)
        self.fisher_score = np.asarray(grad_u, np.float64)
        #: estimated relative Monte Carlo error of the standard error of each unconstrained
        #: coordinate of theta (0: a deterministic method)
        self.fisher_mc_error = np.asarray(mc, np.float64)
        return np.array(info_u, np.float64)

    def _centring_for_se(self) -> np.ndarray:
        """The centring design the information is differentiated along (the model's own
        coordinates, M = 0, for a singular fit)."""
        M = np.asarray(self.centring)
        if getattr(self, "singular_params", None):
            # a singular fit: the centred coordinates move the latents of a variance at
            # its floor with the other params, which puts that variance's prior curvature
            # 1/omega^2 (~1e10) into their complete-data information, cancelled only up to
            # its Monte Carlo error by the missing information (Dyestuff2: SE of mu 2e-4
            # instead of 0.667). The model's own coordinates (M = 0) hold no such term
            M = np.zeros_like(M)
        return M

    def _exact_information(self):
        """Minus the Hessian of the closed-form log-likelihood (a linear Gaussian model)."""
        info, layout = self.info, self.layout
        zm = self._modes()[0]

        def build(args, kwargs, ids):
            def f(theta_u, zm):
                lay = layout if layout is not None else joint_layout(info)
                return info_mod.gaussian_hessian(info, lay, ids, theta_u, zm, args, kwargs)

            return f

        _, g, H = self._program("info_exact", build)(jnp.asarray(self.theta), zm)
        H = np.asarray(H, np.float64)
        return -(H + H.T) / 2.0, np.zeros(H.shape[0]), np.asarray(g, np.float64)

    def _node_information(self, kind: str, num_nodes=None, num_samples=4000, rng_key=None):
        """Minus the Hessian of the node sum (Gauss--Hermite nodes or importance draws fixed
        at the estimate; :func:`~numpyro_fed.saem.information.node_hessian`), and the
        relative Monte Carlo error of each coordinate's standard error (importance draws:
        the spread of the 8 batch estimates over sqrt(8))."""
        info, layout = self.info, self.layout
        zs = jnp.asarray(self.z_draws)
        M = jnp.asarray(self._centring_for_se(), zs.dtype)
        B = 8 if kind == "is" else 1

        def build(args, kwargs, ids):
            lay = layout if layout is not None else joint_layout(info)

            def f(theta_u, around, M, key):
                if kind == "gq":  # the nodes at the result's conditional modes
                    nodes, logw = info_mod.gh_nodes(lay, *around, num_nodes)
                else:
                    nodes, logw = info_mod.is_nodes(lay, around, key, num_samples)
                return info_mod.node_hessian(info, lay, ids, theta_u, nodes, logw, M, args,
                                             kwargs, num_batches=B)

            return f

        name = ("info_gq", num_nodes) if kind == "gq" else ("info_is", num_samples)
        key = random.key(0) if rng_key is None else rng_key
        # the conditional modes of the likelihood, the importance sampler and the EBEs:
        # computed once per result, not again inside this program
        around = self._modes()[:2] if kind == "gq" else zs
        _, g, H, Hb = self._program(name, build)(jnp.asarray(self.theta), around, M, key)
        H = np.asarray(H, np.float64)
        info_u = -(H + H.T) / 2.0
        mc = np.zeros(H.shape[0])
        if Hb is not None:
            Hb = np.asarray(Hb, np.float64)
            se_b = []
            for h in Hb:
                try:
                    v = np.diag(np.linalg.inv(-(h + h.T) / 2.0))
                except np.linalg.LinAlgError:
                    v = np.full(H.shape[0], np.nan)
                se_b.append(np.sqrt(np.where(v > 0, v, np.nan)))
            se_b = np.asarray(se_b)
            try:
                v = np.diag(np.linalg.inv(info_u))
                se = np.sqrt(np.where(v > 0, v, np.nan))
            except np.linalg.LinAlgError:
                se = np.full(H.shape[0], np.nan)
            with np.errstate(invalid="ignore", divide="ignore"):
                # a batch whose information is not positive definite: an error of 100%
                mc = np.where(np.all(np.isfinite(se_b), 0),
                              np.std(se_b, 0, ddof=1) / np.sqrt(B) / se, 1.0)
        return info_u, mc, np.asarray(g, np.float64)

    def _louis_information(self):
        """The Louis information from the fit's draws (see :meth:`fisher_information`) and
        :func:`missing_ratio`'s relative Monte Carlo error of each standard error."""
        info = self.info

        def build(args, kwargs, ids):
            def f(theta, zs, M):
                def one(zf):
                    g, H = centred_score_hess(info, theta, zf[None], args, kwargs, M)
                    return g[0], H[0]

                # batches of B draws, B a divisor of the number of draws (one copy of
                # the Hessian in the program: lax.map compiles a remainder separately),
                # at most 32: the memory of a batch is B forward-over-reverse passes of
                # the whole model (256 took 10 GB on nlme::Quinidine, densely evaluated)
                S = zs.shape[0]
                B = max(b for b in range(1, min(S, 32) + 1) if S % b == 0)
                return jax.lax.map(one, zs, batch_size=B)

            return f

        zs = jnp.asarray(self.z_draws).reshape(-1, self.z_draws.shape[-1])
        M = self._centring_for_se()
        g, H = self._program("louis", build)(jnp.asarray(self.theta), zs,
                                               jnp.asarray(M, zs.dtype))
        g, H = np.asarray(g, np.float64), np.asarray(H, np.float64)
        gm = g.mean(0)
        miss = (g.T @ g) / g.shape[0] - np.outer(gm, gm)
        info_u = -(H.mean(0) + miss)
        info_u = (info_u + info_u.T) / 2.0
        self.louis_missing_ratio = missing_ratio(info_u, (miss + miss.T) / 2.0)
        self.louis_num_draws = int(g.shape[0])
        return info_u, self.louis_missing_ratio / np.sqrt(2.0 * g.shape[0]), gm

    @property
    def singular(self) -> bool:
        """Whether the fit is a boundary (singular) fit: a variance ends at 0, its
        maximum-likelihood value (:attr:`singular_params` names them;
        :meth:`check_convergence` says so with a :class:`SingularFitWarning`). Its estimates
        are the maximum on the boundary; a boundary fit is not ``converged`` in the regular
        sense -- its standard errors at the boundary are not regular."""
        return bool(self.singular_params)

    @property
    def converged(self) -> bool:
        """Whether :meth:`check_convergence` found nothing at the end of the fit."""
        return not self.convergence_messages

    def _warn_unconverged(self, what: str) -> None:
        """Warn (:class:`ConvergenceWarning`) that ``what`` comes from a fit that has not
        converged, quoting why; for a fit whose only message is its boundary (singular) fit,
        a :class:`SingularFitWarning` saying what ``what`` is on the boundary."""
        msgs = self.convergence_messages
        if msgs and all(m.startswith(_SINGULAR_PREFIX) for m in msgs):
            # a boundary fit and nothing else: its estimates are the maximum on the boundary
            # (not "a fit that has not converged"); say what that means for ``what``
            meaning = ("their standard errors are NaN and the others' are on the face of the "
                       "boundary, as lme4 reports them" if what == "standard errors" else
                       "it is the maximum on the boundary (a model without those terms has the "
                       "same likelihood there), as lme4 reports it")
            warnings.warn(
                f"SAEM: {what} of a boundary (singular) fit: {self.singular_params} end at the "
                f"boundary of their support, where the maximum likelihood is; {meaning} (see "
                f"SAEMResult.singular). {msgs[0]}",
                SingularFitWarning, stacklevel=3)
        elif msgs:
            why = " | ".join(msgs)
            warnings.warn(
                f"SAEM: {what} of a fit that has not converged are not to be trusted: {why}",
                ConvergenceWarning, stacklevel=3)

    def _face_inverse(self, info_u: np.ndarray) -> np.ndarray:
        """Inverse of the information; for a singular fit, on the face of the boundary (as
        lme4 reports one): the coordinates at their boundary (:attr:`singular_params`) are
        held there -- their rows and columns dropped (0 here; their standard errors are
        reported NaN) -- and the other
        coordinates get the inverse of their own block (the information of the model with
        the boundary variance fixed at 0)."""
        sing = set(getattr(self, "singular_params", []))
        if not sing:
            return np.linalg.inv(info_u)
        info = self.info
        drop = np.zeros(info_u.shape[0], bool)
        names = list(info.theta_coord_names)
        for i in range(len(info.param_names)):
            o, o1 = int(info.param_offsets[i]), int(info.param_offsets[i + 1])
            u, u1 = int(info.param_offsets_u[i]), int(info.param_offsets_u[i + 1])
            if o1 - o != u1 - u:  # a matrix param (Cholesky): no elementwise map
                continue
            for j in range(o, o1):
                if names[j] in sing:
                    drop[u + j - o] = True
        cov = np.zeros_like(info_u)
        keep = np.nonzero(~drop)[0]
        cov[np.ix_(keep, keep)] = np.linalg.inv(info_u[np.ix_(keep, keep)])
        return cov

    def _se_array(self) -> np.ndarray | None:
        """Standard errors of the constrained coordinates (NaN where the information is not
        positive definite), or ``None`` without the information; no warning."""
        if getattr(self, "centring", None) is None:
            return None
        try:
            cov_c = self._cov_constrained(self.fisher_information())
        except (np.linalg.LinAlgError, ValueError, FloatingPointError):
            return None
        se = np.sqrt(np.where(np.diag(cov_c) > 0, np.diag(cov_c), np.nan))
        return self._nan_singular(se)

    def _model_coords(self, tu: jax.Array) -> jax.Array:
        """The coordinates :meth:`standard_errors` takes the curvature in: the constrained
        values of every elementwise parameter (a standard deviation as the model writes it,
        a rate, a location), the unconstrained coordinates of a matrix parameter (a
        Cholesky factor has more entries than free coordinates)."""
        info = self.info
        tc = info.theta_c_flat(tu)
        parts = []
        for i in range(len(info.param_names)):
            o, o1 = int(info.param_offsets[i]), int(info.param_offsets[i + 1])
            u, u1 = int(info.param_offsets_u[i]), int(info.param_offsets_u[i + 1])
            parts.append(tc[o:o1] if o1 - o == u1 - u else tu[u:u1])
        return jnp.concatenate(parts)

    def _information_in(self, info_u: np.ndarray, *coords: Callable | tuple) -> np.ndarray:
        r"""The information of :meth:`fisher_information` (unconstrained :math:`u`) turned
        into the curvature in the reported coordinates :math:`\phi = \phi(u)`: the first of
        ``coords`` (maps :math:`u \mapsto \phi`, or their ``(Jacobian, Hessian)`` at the
        estimate) that is one to one with :math:`u` at the estimate. Returns
        :math:`A = I_u + \sum_k g_{\phi,k}\nabla_u^2\phi_k`, :math:`g_\phi =
        J^{-\top} g_u` (:attr:`fisher_score`), so that the delta method
        :math:`J A^{-1} J^\top` is exactly the inverse of minus the Hessian of the
        log-likelihood in :math:`\phi` (:math:`\nabla_u^2\ell = J^\top\nabla_\phi^2\ell\,J
        + \sum_k g_{\phi,k}\nabla_u^2\phi_k`), the observed information saemix and
        Monolix invert for the SE of a variance. At an exact maximum :math:`g = 0` and
        nothing changes; at a stochastic estimate the gradient term is first order in its
        distance to the maximum and, for a weakly identified variance, not small against
        the curvature: OrchardSprays' var(col) (crossed, seed 0), the log-sd curvature
        carried to the variance by the delta method gave an SE 1.34x the exact one at the
        same estimate. ``info_u`` unchanged when no coordinates qualify."""
        g = np.asarray(getattr(self, "fisher_score", np.zeros(0)), np.float64)
        theta = jnp.asarray(self.theta)
        if g.shape != (info_u.shape[0],) or not np.all(np.isfinite(g)):
            return info_u
        for phi in coords:
            # a coordinate map, or its (Jacobian, Hessian) at the estimate (computed already)
            J, T = phi if isinstance(phi, tuple) else _jacobian(phi, theta, hessian=True)
            if J.shape != info_u.shape or not np.all(np.isfinite(J)):
                continue
            if not np.linalg.cond(J) < 1e12:
                continue
            g_phi = np.linalg.solve(J.T, g)
            A = info_u + np.einsum("k,kij->ij", g_phi, T)
            return (A + A.T) / 2.0
        return info_u

    def _cov_constrained(self, info_u: np.ndarray) -> np.ndarray:
        """Covariance of the constrained flat coordinates (delta method from the curvature in
        :meth:`_model_coords`)."""
        cov_u = self._face_inverse(self._information_in(info_u, self._model_coords))
        jac = _jacobian(self.info.theta_c_flat, jnp.asarray(self.theta))
        return jac @ cov_u @ jac.T

    def _nan_singular(self, se: np.ndarray) -> np.ndarray:
        """NaN for the coordinates at their boundary (a singular fit: no regular SE) and for
        those whose standard error has a Monte Carlo error above :data:`SE_MC_MAX`."""
        drop = set(getattr(self, "singular_params", [])) | self._imprecise()
        return np.where([n in drop for n in self.names], np.nan, se)

    def _imprecise(self) -> set[str]:
        """The coordinates (constrained names) whose standard error has an estimated
        relative Monte Carlo error above :data:`SE_MC_MAX` (:attr:`fisher_mc_error`, per
        unconstrained coordinate: mapped one to one when every param is elementwise)."""
        rel = getattr(self, "fisher_mc_error", None)
        if rel is None or len(rel) != len(self.names):
            return set()
        return {n for n, r in zip(self.names, rel, strict=True)
                if np.isfinite(r) and r > SE_MC_MAX}

    def _warn_se_precision(self) -> None:
        """Warn when the estimated relative Monte Carlo error of a standard error
        (:attr:`fisher_mc_error`: importance-sampling batches, or :func:`missing_ratio` for
        the Louis identity) exceeds :data:`SE_MC_REL`, naming the coordinates and the
        number of draws that would bring it to SE_MC_REL."""
        rel = getattr(self, "fisher_mc_error", None)
        if rel is None or not rel.size:
            return
        bad = np.isfinite(rel) & (rel > SE_MC_REL)
        if not np.any(bad):
            return
        # names of the unconstrained coordinates: those of the params (flat, same order)
        names = self.info.theta_coord_names if len(self.names) == len(rel) else [
            f"theta_u[{k}]" for k in range(len(rel))]
        worst = float(np.max(rel[bad]))
        if self.fisher_method == "louis":
            r = self.louis_missing_ratio
            S = self.louis_num_draws
            need = int(np.ceil(S * (worst / SE_MC_REL) ** 2))
            per_chain = -(-need // max(int(self.z_draws.shape[1]), 1))
            hessian = ("fisher_information(method='is') / 'gq' (the marginal likelihood's "
                       "Hessian)")
            if per_chain <= LOUIS_MAX_ADVISED_DRAWS:
                fix = (f"For {SE_MC_REL:.0%}, use SAEM(..., num_draws={per_chain}) (draws per "
                       f"chain at the final theta; weakly identified variances need many), or "
                       f"{hessian}.")
            else:  # no fit runs that many draws (num_draws is at most MAX_ITERATIONS)
                fix = (f"{SE_MC_REL:.0%} would take {per_chain:,} draws per chain at the "
                       f"final theta, more than a fit can run: use {hessian} instead.")
            warnings.warn(
                "SAEM: the Louis standard errors of "
                + ", ".join(f"'{n}' (missing information {x:.0f}x its variance)" for n, x, b
                            in zip(names, r, bad, strict=True) if b)
                + f" rest on a missing-information term estimated from {S} latent draws: "
                f"their Monte Carlo error is about {worst:.0%} (r / sqrt(2 S), more for "
                f"autocorrelated draws){self._nan_note()}. " + fix, stacklevel=3)
        else:
            S = int(self._fisher_num_samples or 0)
            need = int(np.ceil(S * (worst / SE_MC_REL) ** 2 / 1000.0)) * 1000
            warnings.warn(
                "SAEM: the standard errors of "
                + ", ".join(f"'{n}'" for n, b in zip(names, bad, strict=True) if b)
                + f" (method={self.fisher_method!r}, {S} importance draws per group) have a "
                f"Monte Carlo error of about {worst:.0%} (the spread of 8 independent "
                f"batches){self._nan_note()}. For {SE_MC_REL:.0%}, use "
                f"standard_errors(num_samples={need}).",
                stacklevel=3)

    def _nan_note(self) -> str:
        """The part of the precision warning that names the SEs reported NaN."""
        noisy = sorted(self._imprecise(), key=list(self.names).index)
        if not noisy:
            return ""
        return (f"; those of {noisy} (above {SE_MC_MAX:.0%}) are reported NaN: any value "
                "from 0 to twice the one computed is within their error")

    def standard_errors(self, method: str = "auto", **kwargs) -> dict[str, float]:
        """Standard errors of the constrained estimates, named by coordinate (the model's own
        parameters: a standard deviation ``omega`` gets the SE of ``omega``; see
        :meth:`parameter_table` for variances and RSE), by the delta method on the observed
        information in unconstrained coordinates (:meth:`fisher_information` with
        ``method`` and ``kwargs``: by default the Hessian of the exact or quadrature
        marginal likelihood where one exists). Warns when their estimated Monte Carlo error
        is above :data:`SE_MC_REL`; above :data:`SE_MC_MAX` they are NaN. A fit that has not
        converged (:attr:`converged` false) warns :class:`ConvergenceWarning`; the returned
        dict then has ``converged`` false and the reasons in ``convergence_messages``
        (attributes)."""
        self._warn_unconverged("standard errors")
        info_u = self._information_in(self.fisher_information(method, **kwargs),
                                      self._model_coords)
        try:
            cov_u = self._face_inverse(info_u)
        except np.linalg.LinAlgError:
            cov_u = np.full_like(info_u, np.nan)
        var_u = np.diag(cov_u)
        if np.any(var_u < 0) or np.all(var_u <= 0):
            warnings.warn("The Louis information is not positive definite." if
                          self.fisher_method == "louis" else
                          f"The observed information (method={self.fisher_method!r}) is not "
                          "positive definite.", stacklevel=2)
        jac = _jacobian(self.info.theta_c_flat, jnp.asarray(self.theta))
        cov_c = jac @ cov_u @ jac.T
        se = self._nan_singular(np.sqrt(np.where(np.diag(cov_c) > 0, np.diag(cov_c), np.nan)))
        self._warn_se_precision()
        out = StandardErrors(zip(self.names, se.tolist(), strict=True))
        out.converged = self.converged
        out.convergence_messages = list(self.convergence_messages)
        return out

    def _table_rows(self, scale: str) -> list[tuple[str, object, list[int]]]:
        """``(row name, g(theta_c flat) -> scalar, constrained coordinates it uses)`` for
        the parameter table on ``scale``."""
        info = self.info
        names = self.names
        var = set(self.settings.get("variance_coords", []))
        rows, done = [], set()
        for i, n in enumerate(info.param_names):
            o, o1 = int(info.param_offsets[i]), int(info.param_offsets[i + 1])
            mvn = [m for m in self.settings.get("mvn_covariances", [])
                   if m[1] == "cholesky" and m[2] == [n]]
            shape = np.shape(info.theta0_c[n])
            if mvn and len(shape) == 2:
                q = shape[0]

                def cov(tc, i_=0, j_=0, o=o, q=q):
                    L = tc[o:o + q * q].reshape(q, q)
                    return (L @ L.T)[i_, j_]

                for a in range(q):
                    for b in range(a + 1):
                        if scale == "variance":
                            rows.append((f"cov({n})[{a},{b}]",
                                         lambda tc, a=a, b=b, f=cov: f(tc, a, b),
                                         list(range(o, o1))))
                        elif a == b:
                            rows.append((f"sd({n})[{a}]",
                                         lambda tc, a=a, f=cov: jnp.sqrt(f(tc, a, a)),
                                         list(range(o, o1))))
                        else:
                            rows.append((f"corr({n})[{a},{b}]",
                                         lambda tc, a=a, b=b, f=cov: f(tc, a, b) / jnp.sqrt(
                                             f(tc, a, a) * f(tc, b, b)),
                                         list(range(o, o1))))
                done.update(range(o, o1))
                continue
            for j in range(o, o1):
                if j in var and scale == "variance":
                    rows.append((f"{names[j]}^2", lambda tc, j=j: tc[j] ** 2, [j]))
                else:
                    rows.append((names[j], lambda tc, j=j: tc[j], [j]))
                done.add(j)
        return rows

    def parameter_table(self, scale: str = "variance", method: str = "auto", *,
                        standard_errors: bool = True, **kwargs):
        """The estimates with their standard errors and relative standard errors, as
        saemix and Monolix report them: a DataFrame indexed by parameter, columns
        ``estimate``, ``se``, ``rse_%`` (100 se / |estimate|) and ``singular`` (the
        coordinate ends at its boundary: no regular SE, NaN).

        :param scale: ``"variance"`` (default): the standard deviation of each Gaussian
            random effect or residual (a scale the closed-form M-step recognised) is
            reported as its variance, row ``"omega^2"`` (``"omega[1]^2"`` for an element),
            estimate :math:`\\hat\\omega^2` and SE :math:`2\\hat\\omega\\,SE(\\hat\\omega)`;
            a ``lower_cholesky`` covariance parameter ``L`` of a MultivariateNormal as the
            entries of :math:`LL^\\top` (rows ``"cov(L)[i,j]"``, ``i >= j``). ``"sd"``: the
            standard deviations as the model writes them (``"omega"``), and for a
            Cholesky parameter the standard deviations ``"sd(L)[i]"`` and correlations
            ``"corr(L)[i,j]"``. Every other parameter is reported as it is. Standard
            errors by the delta method from the unconstrained coordinates.
        :param method: and ``kwargs``: the information (:meth:`fisher_information`).
        :param standard_errors: ``False``: the estimates only (SE and RSE NaN).
        """
        import pandas as pd

        if scale not in ("variance", "sd"):
            raise ValueError(f"parameter_table(scale={scale!r}): use 'variance' (omega^2, as "
                             "saemix reports) or 'sd' (omega, the model's own scale).")
        rows = self._table_rows(scale)
        tc = jnp.asarray(self.info.theta_c_flat(jnp.asarray(self.theta)))
        vals = np.array([float(g(tc)) for _, g, _ in rows])
        sing = set(getattr(self, "singular_params", []))
        if self.centring is not None and standard_errors:
            self._warn_unconverged("standard errors")

            def rows_of_u(tu):
                tc_u = self.info.theta_c_flat(tu)  # once: each call traces the transforms
                return jnp.stack([g(tc_u) for _, g, _ in rows])

            # the curvature in the rows' own coordinates (omega^2, cov(L)[i,j], ...)
            jet = _jacobian(rows_of_u, jnp.asarray(self.theta), hessian=True)
            info_u = self._information_in(self.fisher_information(method, **kwargs),
                                          jet, self._model_coords)
            try:
                cov_u = self._face_inverse(info_u)
            except np.linalg.LinAlgError:
                cov_u = np.full_like(info_u, np.nan)
            J = jet[0]
            v = np.diag(J @ cov_u @ J.T)
            se = np.sqrt(np.where(v > 0, v, np.nan))
            self._warn_se_precision()
        else:
            se = np.full(len(rows), np.nan)
        on_bound = [any(self.names[j] in sing for j in used) for _, _, used in rows]
        noisy = self._imprecise() if self.centring is not None and standard_errors else set()
        se = np.where(on_bound, np.nan, se)
        se = np.where([any(self.names[j] in noisy for j in used) for _, _, used in rows],
                      np.nan, se)
        df = pd.DataFrame({"estimate": vals, "se": se},
                          index=pd.Index([r[0] for r in rows], name="parameter"))
        with np.errstate(divide="ignore", invalid="ignore"):
            df["rse_%"] = 100 * df["se"] / df["estimate"].abs()
        df["singular"] = on_bound
        df.attrs["converged"] = self.converged
        df.attrs["singular"] = self.singular
        df.attrs["convergence_messages"] = list(self.convergence_messages)
        df.attrs["scale"] = scale
        df.attrs["se_method"] = getattr(self, "fisher_method", None)
        return df

    def summary(self, scale: str = "variance", method: str = "auto", **kwargs):
        """The parameter table (:meth:`parameter_table`): estimates, standard errors,
        relative standard errors (%), variances as ``omega^2`` (``scale="sd"``: the standard
        deviations)."""
        return self.parameter_table(scale, method, **kwargs)

    # -- latents ------------------------------------------------------------------------------
    def latent_samples(self) -> dict[str, np.ndarray]:
        """Constrained latent draws at the final :math:`\\theta`, ``(chains, draws, ...)``."""
        info = self.info
        T, C, dz = self.z_draws.shape
        flat = jnp.asarray(self.z_draws).reshape(T * C, dz)
        zc = jax.vmap(lambda f: info.constrain_z(f)[0])(flat)
        return {
            n: np.moveaxis(np.asarray(v).reshape((T, C) + v.shape[1:]), 0, 1)
            for n, v in zc.items()
        }

    @property
    def idata(self):
        """ArviZ InferenceData with the latent draws at the final :math:`\\theta`."""
        import arviz as az

        return az.from_dict(posterior=self.latent_samples())

    def conditional_means(self) -> dict[str, np.ndarray]:
        """Per-subject conditional means :math:`E[z_i\\mid y;\\hat\\theta]` of each latent site."""
        return {n: v.mean(axis=(0, 1)) for n, v in self.latent_samples().items()}

    def conditional_modes(self) -> dict[str, np.ndarray]:
        """Per-subject conditional modes of the latent sites at :math:`\\hat\\theta`
        (empirical Bayes estimates), constrained: the modes of :math:`\\log p(y_i, z_i\\mid
        \\hat\\theta)` in the unconstrained latents (Jacobian included), by damped Newton
        from the mean of the final draws
        (:func:`numpyro_fed.saem.likelihood.conditional_modes`; computed once per result and
        shared with the likelihood and the standard errors)."""
        z = self._modes()[0]
        return {n: np.asarray(v) for n, v in self.info.constrain_z(z)[0].items()}

    # -- likelihood ---------------------------------------------------------------------------
    def log_likelihood(self, rng_key: jax.Array | None = None, *, method: str = "auto",
                       num_samples: int = 5000, df: float = 4.0, batch_size: int = 500,
                       max_samples: int | None = None, num_nodes: int | None = None,
                       data_transforms: dict | None = None) -> dict:
        """Marginal log-likelihood at :math:`\\hat\\theta` (see
        :mod:`~numpyro_fed.saem.likelihood`).

        :param method: ``"auto"`` (the default: ``"exact"`` where it applies, else ``"is"``;
            the returned ``method`` says which ran), ``"exact"`` (the closed form of a linear
            Gaussian model -- any number of crossed or nested grouping factors -- per subject
            or connected group: the Laplace value at the exact mode, after checking that each
            integrand is quadratic in the latents; a ``ValueError`` when it is not), ``"is"``
            (importance sampling per subject or connected group from a defensive mixture of
            two multivariate t: one at the conditional mode with the inverse Hessian there,
            one at the conditional mean and covariance of the draws (saemix's ``llis``); more
            rounds of draws while a group's Pareto :math:`\\hat k` exceeds 0.5 or its SE
            0.1, a :class:`~numpyro_fed.saem.likelihood.LikelihoodWarning` when some
            :math:`\\hat k` still exceeds 0.7), ``"gq"`` (adaptive Gauss--Hermite
            quadrature, at most 3 latent coordinates per subject) or ``"laplace"`` (Laplace
            at the conditional modes).
        :param num_samples: importance draws per group and round (default 5000).
        :param max_samples: at most this many draws per group over the rounds (default
            ``8 * num_samples``; ``num_samples`` for a single round).
        :param data_transforms: ``{site: T}`` for observed sites whose data are
            :math:`v = T^{-1}(y)` (e.g. ``ExpTransform()`` for an exponential error model
            written on :math:`\\log y`): the likelihood is then reported on the scale of
            :math:`y` (the Jacobian is added), so error models compare by AIC.
        :return: dict with ``loglik``, ``m2ll`` (:math:`-2\\ell`), ``m2ll_se`` (Monte Carlo
            standard error, 0 for the deterministic methods), ``aic``, ``bic`` (log of the
            number of subjects when there are subjects, else of the number of
            observations), ``method``, ``requested_method``, ``num_subjects``; for
            ``"is"`` also ``num_samples`` (draws per group), ``rounds`` and ``pareto_k``
            (the largest Pareto :math:`\\hat k` over the groups).
        """
        if method not in ("is", "gq", "laplace", "exact", "auto"):
            raise ValueError(
                f"method={method!r}: use 'auto', 'exact', 'is', 'gq' or 'laplace'.")
        # the importance sample is drawn in whole batches: num_samples=0 would draw one batch
        # and report 0 samples, so every size is checked
        num_samples = check_int("num_samples", num_samples, minimum=1,
                                hint=" Importance sampling needs draws (default 5000).")
        batch_size = check_int("batch_size", batch_size, minimum=1)
        df = check_positive_float("df", df)
        num_nodes = check_int("num_nodes", num_nodes, minimum=1, allow_none=True)
        max_samples = check_int("max_samples", max_samples, minimum=1, allow_none=True)
        if max_samples is not None and max_samples < num_samples:
            raise ValueError(
                f"`max_samples` ({max_samples}) must be at least `num_samples` "
                f"({num_samples}), the draws of one round.")
        info, layout = self.info, self.layout
        key = random.key(0) if rng_key is None else rng_key
        args, kwargs = self.args, self.kwargs
        theta_c = info.constrain_theta(jnp.asarray(self.theta))
        lay = layout if layout is not None else joint_layout(info)
        n = lay.n
        zs = jnp.asarray(self.z_draws)
        requested = method
        extra: dict = {}
        if method in ("exact", "auto"):
            ll_i, rest, disc = self._gaussian_exact(key, zs)
            worst = int(np.argmax(disc)) if disc.size else 0
            if np.all(disc <= _exact_tolerance(ll_i)):
                method = "exact"
            elif method == "exact":
                raise ValueError(
                    "log_likelihood(method='exact'): the model is not linear Gaussian in its "
                    "latents -- log p(y, z | theta) of "
                    + (f"subject (group) {worst}" if layout is not None else "the model")
                    + f" differs from its quadratic expansion by {float(disc[worst]):.3g} at "
                    "a check point, so no closed form applies; use method='is' (importance "
                    "sampling), 'gq' or 'laplace'."
                )
            else:
                method = "is"
        if method == "exact":
            ll_i, rest = self._gaussian_exact64(ll_i, rest)
            se = 0.0
        elif method == "is":
            ll_i, se, rest, extra = self._importance_sampling(
                key, zs, num_samples, df, batch_size, max_samples)
        else:
            z_init = jnp.mean(zs.reshape(-1, zs.shape[-1]), 0)
            fn = lik.gauss_hermite if method == "gq" else lik.laplace
            kw = {"num_nodes": num_nodes} if method == "gq" else {}
            prog = self._program(
                (method, num_nodes),
                lambda a, kwa, ids: lambda tc, z0: fn(info, layout, ids, tc, z0, a, kwa, **kw))
            ll_i, rest = prog(theta_c, z_init)
            se = 0.0
        ll_i = np.asarray(ll_i, np.float64)
        if not np.all(np.isfinite(ll_i)):
            bad = np.nonzero(~np.isfinite(ll_i))[0]
            raise FloatingPointError(
                f"log_likelihood(method={method!r}): non-finite value for subject(s) "
                f"{bad[:10].tolist()}; try method='is' with more samples."
            )
        self._warn_unconverged(f"the log-likelihood and -2LL (method={method!r})")
        ll = float(ll_i.sum() + float(rest))
        if data_transforms:
            zc, _ = info.constrain_z(zs[0, 0])
            ll += float(lik.observation_jacobian(info, theta_c, zc, args, kwargs,
                                                 data_transforms))
        p = self.num_params
        nb = n if layout is not None else info.n_obs
        out = {
            "loglik": ll, "m2ll": -2 * ll, "m2ll_se": se,
            "aic": -2 * ll + 2 * p, "bic": -2 * ll + math.log(nb) * p,
            "method": method, "num_subjects": int(n),
            "requested_method": requested,
            "converged": self.converged,
            "convergence_messages": list(self.convergence_messages),
            **extra,
        }
        self._ll[method] = out
        return out

    def _modes(self):
        """Conditional modes of the latents at :math:`\\hat\\theta` and the negative Hessian
        blocks there (:func:`~numpyro_fed.saem.likelihood.conditional_modes`, from the mean
        of the final draws), computed once per result: ``(z, H, val, rest)``."""
        if self._mode_cache is None:
            info, layout = self.info, self.layout
            zs = jnp.asarray(self.z_draws)
            z_init = jnp.mean(zs.reshape(-1, zs.shape[-1]), 0)
            prog = self._program(
                ("modes",),
                lambda a, kwa, ids: lambda tc, z0: lik.conditional_modes(
                    info, layout, ids, tc, z0, a, kwa))
            self._mode_cache = prog(info.constrain_theta(jnp.asarray(self.theta)), z_init)
        return self._mode_cache

    def _importance_sampling(self, key, zs, num_samples, df, batch_size, max_samples):
        """The adaptive defensive importance sampler
        (:func:`~numpyro_fed.saem.likelihood.adaptive_importance_sampling`): per-group
        estimates, the SE of -2LL, the latent-free terms and the extra output fields; warns
        :class:`~numpyro_fed.saem.likelihood.LikelihoodWarning` when some group's weights are
        too heavy-tailed for the estimate to be trusted."""
        info, layout = self.info, self.layout
        per_round = -(-num_samples // batch_size) * batch_size
        max_rounds = (lik.MAX_ROUNDS if max_samples is None
                      else max(1, max_samples // per_round))
        z, H, _, _ = self._modes()
        num_top = lik.num_top_weights(num_samples, batch_size)
        prog = self._program(
            ("is", num_samples, df, batch_size, num_top),
            lambda a, kw, ids: lambda tc, zs, z, H, k: lik.importance_round(
                info, layout, ids, tc, lik.is_proposals(layout, info, zs, z, H), a, kw, k,
                num_samples=num_samples, df=df, batch_size=batch_size, num_top=num_top))
        tc = info.constrain_theta(jnp.asarray(self.theta))
        r = lik.adaptive_importance_sampling(lambda k: prog(tc, zs, z, H, k), key, num_samples,
                                             batch_size, max_rounds=max_rounds)
        khat = r["khat"]
        kmax = float(np.nanmax(khat)) if np.any(np.isfinite(khat)) else float("nan")
        bad = np.nonzero(np.nan_to_num(khat, nan=0.0) > lik.PARETO_K_WARN)[0]
        if bad.size:
            warnings.warn(
                f"log_likelihood(method='is'): the importance weights of subject(s) (groups) "
                f"{bad[:10].tolist()} have Pareto k-hat up to {kmax:.2f} (> "
                f"{lik.PARETO_K_WARN}) after {r['num_samples']} draws each: the -2LL and its "
                "SE cannot be trusted there. Use method='gq' (at most 3 latents per group), "
                "more draws (max_samples), or check the fit (the draws at the estimate "
                "build the proposal).", lik.LikelihoodWarning, stacklevel=3)
        se = float(2 * np.sqrt(np.sum(np.asarray(r["var_i"], np.float64))))
        extra = {"num_samples": int(r["num_samples"]), "rounds": int(r["rounds"]),
                 "pareto_k": kmax}
        return r["ll_i"], se, r["rest"], extra

    def _gaussian_exact(self, key, zs):
        """The closed-form per-subject log-likelihoods and their Gaussianity discrepancies
        (:func:`~numpyro_fed.saem.likelihood.gaussian_exact_at_modes`), as host arrays;
        computed once per result (the check points are drawn from a fixed key, so that the
        verdict of ``method="auto"`` and the value of ``"exact"`` do not depend on
        ``rng_key``)."""
        if self._exact_cache is None:
            info, layout = self.info, self.layout
            z, H, val, rest = self._modes()
            prog = self._program(
                ("exact",),
                lambda a, kwa, ids: lambda tc, z, H, val, k: lik.gaussian_exact_at_modes(
                    info, layout, ids, tc, z, H, val, a, kwa, k))
            ll_i, disc = prog(info.constrain_theta(jnp.asarray(self.theta)), z, H, val,
                              random.key(17))
            self._exact_cache = (np.asarray(ll_i, np.float64), rest,
                                 np.asarray(disc, np.float64))
        return self._exact_cache

    def _gaussian_exact64(self, ll32, rest32):
        """The closed-form per-group values of :meth:`_gaussian_exact` evaluated again in
        float64 (``jax.enable_x64``; one Newton step from the float32 modes, exact on a
        quadratic integrand, and the gradient term of
        :func:`~numpyro_fed.saem.likelihood.gaussian_exact_at_modes`): in float32 the
        model's sum over thousands of observations rounds the value of a large group by
        several units of 1e-3 (``mlmRev::ScotsSec``, 3435 pupils crossed in 148 x 19
        schools: -2LL 0.005 off the float64 value), which an "exact" value with a standard
        error of 0 must not carry. Computed once per result. A model that cannot run in
        float64 keeps the float32 values, with a :class:`~numpyro_fed.saem.likelihood.
        LikelihoodWarning` giving their rounding."""
        if self._exact64_cache is None:
            info, layout = self.info, self.layout
            z = self._modes()[0]
            # at the reported (float32) estimates, as a user's float64 reference takes them
            tc = jax.tree.map(lambda v: np.asarray(v, np.float64),
                              info.constrain_theta(jnp.asarray(self.theta)))
            try:
                with jax.enable_x64(True):
                    prog = self._program(
                        ("exact64",),
                        lambda a, kwa, ids: lambda tc, z0, k: lik.gaussian_exact(
                            info, layout, ids, tc, z0, a, kwa, k, num_checks=1,
                            num_iters=1)[:2])
                    ll_i, rest = prog(jax.tree.map(jnp.asarray, tc),
                                      jnp.asarray(np.asarray(z, np.float64)),
                                      random.key(17))
                    ll_i = np.asarray(ll_i, np.float64)
                    rest = np.float64(rest)
                if not (np.all(np.isfinite(ll_i)) and np.isfinite(rest)):
                    raise FloatingPointError("a non-finite value")
            except Exception as e:  # noqa: BLE001 -- the model's own code, in float64
                tol = float(np.sum(_exact_tolerance(ll32)))
                warnings.warn(
                    "log_likelihood(method='exact'): the model could not be evaluated in "
                    f"float64 ({type(e).__name__}: {e}); the closed form is reported from "
                    f"float32 arithmetic, with a rounding error up to about {2 * tol:.2g} in "
                    "-2LL.", lik.LikelihoodWarning, stacklevel=4)
                ll_i, rest = np.asarray(ll32, np.float64), np.float64(rest32)
            self._exact64_cache = (ll_i, rest)
        return self._exact64_cache

    # -- diagnostics --------------------------------------------------------------------------
    def boundary_slope(self, name: str) -> tuple[float, float] | None:
        r"""The derivative of the log-likelihood :math:`\log p(y\mid\theta)` in the variance
        :math:`\omega^2` of the diagonal random-effect scale ``name`` (a flat constrained
        coordinate, e.g. ``"omega"`` or ``"omega[1]"``) at :math:`\omega = 0`, the other
        coordinates at the estimate, and its Monte Carlo standard error: ``(D, se)``, or
        ``None`` when ``name`` is not such a scale (the closed-form Gaussian M-step's
        diagonal sites only).

        With :math:`z_l = \mu_l + r_l\omega\eta_l` for the elements :math:`l` of that
        scale (standard normal :math:`\eta_l`, independent),
        :math:`\partial_{\omega^2} \log p(y\mid\theta)|_{\omega=0} = \tfrac12 \sum_l
        r_l^2\, E[(\partial_l \ell)^2 + \partial^2_l \ell]`, where :math:`\ell` is the
        complete-data log-density without those elements' own priors, evaluated at
        :math:`z_l = \mu_l`, and the expectation is over the other latents given the data --
        estimated from the final draws, where that variance sits at the M-step's floor (the
        diagonal of the Hessian by Rademacher probes: exact when, as usual, no term of the
        model holds two of those elements). ``D <= 0``: 0 is a maximum along it (a boundary
        fit); ``D > 0``: the likelihood increases away from 0, so an estimate held at 0 is
        not the maximum. No Monte Carlo error (``se = 0``) when no other latent enters."""
        spec = getattr(self, "_diag_scales", None)
        if spec is None or name not in self.names:
            return None
        sites, lat_g = spec
        j = self.names.index(name)
        sel = np.asarray(lat_g) == j
        if not np.any(sel):
            return None
        info = self.info
        zs = np.asarray(self.z_draws)
        T, C = zs.shape[:2]
        signs = np.where(np.random.default_rng(0).random((T * C, sel.size)) < 0.5, -1.0, 1.0)

        def build(args, kwargs, ids):
            def f(theta_u, zs, signs):
                tc = info.constrain_theta(theta_u)
                tflat = info.theta_c_flat(theta_u)
                t1 = info._unravel_theta_c(tflat.at[j].set(1.0))
                m = jnp.asarray(sel)

                def one(zf, sg):
                    zc, _ = info.constrain_z(zf)
                    sizes = [int(np.size(zc[n])) for n in sites]

                    def split(x):
                        out, o = dict(zc), 0
                        for n, k in zip(sites, sizes, strict=True):
                            out[n] = x[o:o + k].reshape(jnp.shape(zc[n]))
                            o += k
                        return out

                    tr = info.trace_at(tc, zc, args, kwargs)
                    parts = [unwrap_normal(tr[n]["fn"], tr[n]["value"]) for n in sites]
                    loc = jnp.concatenate([p[0].reshape(-1) for p in parts])
                    sc = jnp.concatenate([p[1].reshape(-1) for p in parts])
                    zl = jnp.concatenate([zc[n].reshape(-1) for n in sites])
                    x0 = jnp.where(m, loc, zl)
                    r = jnp.where(m, sc / tflat[j], 0.0)
                    rr = jnp.where(m, r, 1.0)

                    def ell(x):
                        # the complete-data log-density at omega = 1 (a scale at its floor
                        # would put -1/omega^2 in the curvature) minus those elements' own
                        # priors, N(loc, r^2) there: exact at x = loc up to rounding
                        lj = info.log_joint_c(t1, split(x), args, kwargs)
                        return lj - jnp.sum(jnp.where(m, norm.logpdf(x, loc, rr), 0.0))

                    g = jax.grad(ell)(x0)
                    v = sg * r
                    hv = jax.jvp(jax.grad(ell), (x0,), (v,))[1]
                    return 0.5 * (jnp.sum((r * g) ** 2) + jnp.dot(v, hv))

                return jax.vmap(one)(zs, signs)

            return f

        d = self._program(("boundary_slope", name), build)(
            jnp.asarray(self.theta), jnp.asarray(zs.reshape(T * C, -1)),
            jnp.asarray(signs, zs.dtype))
        return _draw_mean_and_se(d, T, C)

    def _mvn_covariance(self, site: str):
        """``(rule, param names, covariance (q, q) float64)`` of the full random-effect
        covariance of ``site`` at the estimate, or ``None``."""
        hit = [m for m in (getattr(self, "_mvn_sites", None) or ()) if m[0] == site]
        if not hit:
            return None
        _, rule, pnames = hit[0]
        tc = self.info.constrain_theta(jnp.asarray(self.theta))
        return rule, list(pnames), np.asarray(mvn_rule_covariance(rule, pnames, tc), np.float64)

    def covariance_face_slope(self, site: str) -> dict | None:
        r"""The derivative of the log-likelihood at the singular covariance next to the
        estimate of a full random-effect covariance :math:`\hat\Omega` (the
        MultivariateNormal latent ``site`` whose covariance the closed-form M-step updates),
        along its smallest eigenvector :math:`v`: with :math:`\Omega_0 = \hat\Omega -
        \lambda_{min} vv^\top` (rank deficient: a correlation of +-1 when q = 2),
        :math:`D = \partial_t \log p(y\mid\Omega_0 + t\,vv^\top)|_{t=0} = \tfrac12
        \sum_i E[(v^\top\nabla_{b_i}\ell)^2 + v^\top\nabla^2_{b_i}\ell\,v]`, the
        expectation over the latents given the data at :math:`\Omega_0`, :math:`\ell` the
        complete-data log-density without the site's own prior, each group's :math:`b_i`
        projected onto the face (:math:`b_i - vv^\top(b_i - \mu_i)`) -- the multivariate
        form of :meth:`boundary_slope`, estimated from the final draws (Rademacher probes for
        the Hessian term; the prior's part is removed exactly, the density evaluated at
        :math:`\Omega_0 + \bar\omega^2 vv^\top` so that nothing large cancels).
        ``D <= 0``: the likelihood decreases away from the singular covariance, whose face
        holds the maximum (lme4's "boundary (singular) fit"); ``D > 0``: it increases, the
        maximum is inside.

        :return: ``None`` when ``site`` has no such covariance, else a dict with ``slope``
            and ``se`` (its Monte Carlo standard error, batch means over the draws),
            ``min_corr_eigenvalue`` (of the estimate's correlation matrix), ``direction``
            (:math:`v`) and ``correlation`` (the estimate's correlation matrix)."""
        got = self._mvn_covariance(site)
        if got is None:
            return None
        rule, pnames, S = got
        info = self.info
        sd = np.sqrt(np.diag(S))
        corr = S / np.outer(sd, sd)
        lam, vecs = np.linalg.eigh(S)
        v = vecs[:, 0]
        c = float(np.mean(np.diag(S)))
        q = S.shape[0]
        zs = np.asarray(self.z_draws)
        T, C = zs.shape[:2]
        rows = int(np.size(info.trace0[site]["value"])) // q
        signs = np.where(np.random.default_rng(0).random((T * C, rows)) < 0.5, -1.0, 1.0)

        def build(args, kwargs, ids):
            def f(theta_u, zs, signs, v, c):
                tc = info.constrain_theta(theta_u)
                Sig = mvn_rule_covariance(rule, pnames, tc)
                lam0 = v @ Sig @ v
                t1 = {**tc, **_mvn_rule_params(rule, pnames, Sig + c * jnp.outer(v, v))}

                def one(zf, sg):
                    zc, _ = info.constrain_z(zf)
                    tr = info.trace_at(t1, zc, args, kwargs)
                    loc = unwrap_mvn(tr[site]["fn"], tr[site]["value"])[0]  # (rows, q)
                    shape = jnp.shape(zc[site])
                    b = zc[site].reshape(-1, q)
                    x0 = b - ((b - loc) @ v)[:, None] * v[None, :]

                    def ell(x):
                        return info.log_joint_c(t1, {**zc, site: x.reshape(shape)}, args,
                                                kwargs)

                    g = jax.grad(ell)(x0)
                    w = sg[:, None] * v[None, :]
                    hv = jax.jvp(jax.grad(ell), (x0,), (w,))[1]
                    # the prior N(loc, Sig + c vv') along v at x0: gradient 0 (x0 - loc is
                    # orthogonal to v, an eigenvector), curvature -1 / (lam0 + c) per row
                    return 0.5 * (jnp.sum((g @ v) ** 2) + jnp.sum(w * hv)
                                  + x0.shape[0] / (lam0 + c))

                return jax.vmap(one)(zs, signs)

            return f

        dt = zs.dtype
        d = self._program(("face_slope", site), build)(
            jnp.asarray(self.theta), jnp.asarray(zs.reshape(T * C, -1)),
            jnp.asarray(signs, dt), jnp.asarray(v, dt), jnp.asarray(c, dt))
        slope, se = _draw_mean_and_se(d, T, C)
        return {"slope": slope, "se": se,
                "min_corr_eigenvalue": float(np.linalg.eigvalsh(corr)[0]),
                "direction": v, "correlation": corr}

    def _covariance_faces(self, cols: list, sing: list) -> dict:
        """For each full random-effect covariance that ends nearly singular (smallest
        eigenvalue of its correlation matrix below :data:`COV_FACE_CORR`) or with a diagonal
        entry of its factor among ``sing`` (the trajectory's boundary coordinates): the
        verdict of :meth:`covariance_face_slope`. ``{site: {kind, js, names, ...}}`` with
        ``kind`` ``"face"`` (the slope <= 0 within 2 Monte Carlo SE: a boundary fit; ``js``
        the factor's diagonal coordinates at 0, or the one nearest 0 relative to its
        standard deviation) or ``"refuted"`` (significantly > 0 although the trajectory put
        ``js`` at 0: a collapse, not the maximum)."""
        out = {}
        for site, rule, pnames in getattr(self, "_mvn_sites", None) or ():
            S = self._mvn_covariance(site)[2]
            q = S.shape[0]
            sd = np.sqrt(np.diag(S))
            with np.errstate(invalid="ignore", divide="ignore"):
                lc = float(np.linalg.eigvalsh(S / np.outer(sd, sd))[0])
            mat = pnames[1] if rule == "scale_corr" else pnames[0]
            diag = {k: f"{mat}[{k},{k}]" for k in range(q) if f"{mat}[{k},{k}]" in cols}
            in_sing = [cols.index(n) for n in diag.values() if cols.index(n) in sing]
            if not (lc < COV_FACE_CORR or in_sing):
                continue
            try:
                fs = self.covariance_face_slope(site)
            except Exception:  # noqa: BLE001
                # a model the slope's program cannot differentiate: judged by the trajectory
                # alone, as before (the suite's strict mode raises)
                if _programs.VERIFY_TRACE_KEYS:
                    raise
                continue
            if fs is None or not np.isfinite(fs["slope"]) or not np.isfinite(fs["se"]):
                continue
            if in_sing and fs["slope"] > 3.0 * fs["se"]:
                kind, js = "refuted", in_sing
            elif fs["slope"] + 2.0 * fs["se"] <= 0.0:
                kind, js = "face", in_sing
                if not js and diag:
                    # the factor's diagonal entry nearest 0 against its standard deviation
                    # (the SD of that random effect given those before it)
                    try:
                        rel = np.abs(np.diag(np.linalg.cholesky(S))) / sd
                    except np.linalg.LinAlgError:  # singular in float64 too: its last entry
                        rel = np.arange(q, 0, -1, dtype=np.float64)
                    k = min(diag, key=lambda k: rel[k])
                    js = [cols.index(diag[k])]
            else:
                continue
            out[site] = {**fs, "kind": kind, "js": js, "names": [cols[j] for j in js]}
        return out

    def check_convergence(self, warn: bool = True) -> list[str]:
        """Signs of a fit that has not converged, as messages naming what to change (warned
        as :class:`ConvergenceWarning` when ``warn``; the fit keeps them in
        :attr:`convergence_messages`, and its standard errors and -2LL then warn too):

        - **phases too short**: a final (decreasing-step) phase of fewer than
          :data:`MIN_FINAL_ITERS` iterations, or an exploration phase of fewer than
          :data:`MIN_EXPLORATION_ITERS` (``num_exploration=0``, steps decreasing from the
          first iteration as in Gruffaz et al. 2024, is a design, judged by the drift test);
        - **drift in the final phase**: for every coordinate of :math:`\\theta`, its change
          across the last half of the final phase (least-squares line), when it is
          significant against its Monte Carlo error (3 standard errors, batch means of the
          residuals) and
          larger than :data:`DRIFT_SE` times the coordinate's standard error (the Louis
          information; 1% of its value when there is none): an estimate still moving by a
          tenth of its own uncertainty at the end has not reached the maximum;
        - **drift at the end of the exploration phase**: the change of the mean between the
          two halves of its last 40%, significant (3 Monte Carlo standard errors, batch
          means) and larger than :data:`DRIFT_SE` standard errors (1% of the value without
          them) -> more ``num_exploration``;
        - **an E-step that collapsed**: an acceptance rate below :data:`MIN_ACCEPT` over the
          final phase (not for ULA, which takes every move), or latent draws at the final
          :math:`\\theta` that change between consecutive draws less than
          :data:`MIN_ACCEPT` of the time;
        - **a parameter heading to the boundary of its support** (a variance collapsing to
          0; :func:`boundary_collapse`).
        """
        msgs = []
        df = self.trajectory
        K = len(df)
        n_expl = int(self.num_exploration)
        K1 = min(n_expl, K)
        L = K - K1
        cols = list(self.names)
        X = df[cols].to_numpy(np.float64) if K else np.zeros((0, len(cols)))
        kernel = getattr(self, "settings", {}).get("kernel")
        info = getattr(self, "info", None)
        th0 = getattr(self, "theta0_c", None)
        # coordinates that end at their boundary (a singular fit): their Monte Carlo moves
        # at the floor (a factor of a few around 1e-5 of their largest value) are no drift
        sing = singular_coords(info, X, th0) if info is not None and K else []
        # a random-effect variance ending near 0 is judged by the likelihood's slope at 0
        # (boundary_slope): a claimed boundary where the likelihood rises away from 0 is a
        # collapse, not a maximum; a variance still creeping down to 0 (EM's sublinear pace
        # towards a boundary maximum) whose slope there is <= 0 is at the boundary
        slopes, refuted, settled, short = {}, [], [], []
        if info is not None and K and getattr(self, "_diag_scales", None) is not None:
            ref_all = np.nanmax(np.abs(np.concatenate(
                [X, np.asarray(th0, np.float64).reshape(1, -1)] if th0 is not None else [X])),
                axis=0)
            tail = X[-max(K // 4, 1):]
            for j in sorted(set(np.asarray(self._diag_scales[1]).tolist())):
                med = np.median(np.abs(tail[:, j]))
                small = med < BOUNDARY_SETTLED_RATIO * ref_all[j]
                if j not in sing and not med < BOUNDARY_SLOPE_RATIO * ref_all[j]:
                    continue
                try:
                    sl = self.boundary_slope(cols[j])
                except Exception:  # noqa: BLE001
                    # a model the slope's program cannot differentiate: judged by the
                    # trajectory alone, as before (the suite's strict mode raises)
                    if _programs.VERIFY_TRACE_KEYS:
                        raise
                    continue
                if sl is None or not np.all(np.isfinite(sl)):
                    continue
                slopes[j] = sl
                if j in sing and sl[0] > 3.0 * sl[1]:
                    refuted.append(j)
                elif j not in sing and sl[0] + 2.0 * sl[1] <= 0.0:
                    (settled if small else short).append(j)
        faces = self._covariance_faces(cols, sing) if info is not None and K else {}
        face_out = {j for f in faces.values() if f["kind"] == "refuted" for j in f["js"]}
        face_in = {j for f in faces.values() if f["kind"] == "face" for j in f["js"]}
        sing = sorted((set(sing) - set(refuted) - face_out) | set(settled) | face_in)
        self.singular_params = [cols[j] for j in sing]
        live = np.ones(len(cols), bool)
        live[sing] = False
        # -- phases
        if L < MIN_FINAL_ITERS:
            msgs.append(
                f"SAEM: the final (decreasing-step) phase has {L} iteration"
                f"{'s' if L != 1 else ''} (< {MIN_FINAL_ITERS}): too few to average the Monte "
                "Carlo noise out of the estimates or to check that they stopped moving; give "
                f"Schedule(num_iters={max(K1, 300) + 200}, num_exploration={max(K1, 300)}) (the "
                "default: 300 + 200) or more."
            )
        if 0 < n_expl < MIN_EXPLORATION_ITERS:
            msgs.append(
                f"SAEM: the exploration phase has {n_expl} iterations (< "
                f"{MIN_EXPLORATION_ITERS}): the E-step's step sizes are adapted and the "
                "variances annealed during it; give num_exploration >= 100 (the default "
                "is 300)."
            )
        se_cache: list = []

        def unit(values):
            """DRIFT_SE standard errors per coordinate (computed once, only when a drift is
            significant), else 1% of the value where there are none."""
            if not se_cache:
                se = self._se_array() if hasattr(self, "_se_array") else None
                se_cache.append(np.full(len(cols), np.nan) if se is None else se)
            se = se_cache[0]
            ok = np.isfinite(se) & (se > 0)
            return np.where(ok, DRIFT_SE * se, 0.01 * np.abs(values)), np.where(ok, se, np.nan)

        # -- drift at the end of the exploration phase
        if K1 >= 50:
            seg = X[int(0.6 * K1):K1]
            diff, se_mc = _half_drift(seg)
            drift = (np.abs(diff) > 3 * se_mc + 1e-12) & (diff != 0) & live
            if np.any(drift):
                drift &= np.abs(diff) > unit(seg[len(seg) // 2:].mean(0))[0] + 1e-12
            if np.any(drift):
                names = [c for c, d in zip(cols, drift, strict=True) if d]
                msgs.append(
                    f"SAEM: {names} still drift at the end of the exploration phase "
                    f"({K1} iterations); lengthen both phases (e.g. Schedule(num_iters="
                    f"{2 * K1 + max(K - K1, 200)}, num_exploration={2 * K1})) or give "
                    "initial values closer to the estimates."
                )
        # -- drift in the final phase
        if L >= MIN_FINAL_ITERS:
            fin = X[K1:]
            diff, se_mc = _trend(fin[L // 2:])
            cand = (np.abs(diff) > 3 * se_mc + 1e-12) & (diff != 0) & live
            if np.any(cand):
                u, se = unit(fin[-(L // 4):].mean(0))
                drift = cand & (np.abs(diff) > u + 1e-12)
                if np.any(drift):
                    desc = ", ".join(
                        f"{c} by {d:+.3g}" + (f" ({abs(d) / s:.2f} SE)" if np.isfinite(s)
                                              and s > 0 else "")
                        for c, d, s, f in zip(cols, diff, se, drift, strict=True) if f)
                    msgs.append(
                        f"SAEM: the estimates still drift in the final phase ({L} "
                        f"iterations at decreasing steps): over its last half {desc}; the "
                        "maximum is not reached. Lengthen both phases (e.g. Schedule("
                        f"num_iters={max(2 * K1, 300) + max(2 * L, 200)}, num_exploration="
                        f"{max(2 * K1, 300)})) or give initial values closer to the "
                        "estimates."
                    )
        # -- the E-step
        acc = df["accept_rate"].to_numpy() if "accept_rate" in df else np.zeros(0)
        final = acc[K1:] if K1 < len(acc) else acc
        if final.size and kernel != "ula" and np.mean(final) < MIN_ACCEPT:
            msgs.append(
                f"SAEM: the E-step accepted {np.mean(final):.1%} of its moves in the final "
                "phase; the latent draws barely move (use the default adaptive E-step: "
                "step_size=None, or a smaller step_size)."
            )
        zd = getattr(self, "z_draws", None)
        if zd is not None and np.ndim(zd) == 3 and zd.shape[0] > 1 and zd.shape[2] > 0:
            moved = np.any(np.asarray(zd[1:]) != np.asarray(zd[:-1]), axis=-1)  # (T-1, C)
            frac = float(np.mean(moved))
            if frac < MIN_ACCEPT:
                msgs.append(
                    f"SAEM: the latent draws at the final theta changed in {frac:.1%} of "
                    f"{moved.size} consecutive draws: the E-step is stuck, so the standard "
                    "errors and the likelihood's proposals rest on a handful of points "
                    "(use the default adaptive E-step, or a smaller step size of your kernel)."
                )
        # -- boundary
        singular_msgs = []
        b = boundary_collapse(info, X, th0) if info is not None and K else None

        def slope_text(j):
            D, se = slopes[j]
            return (f"d log L / d {cols[j]}^2 at 0 = {D:.3g}"
                    + (f" (Monte Carlo SE {se:.2g})" if se > 0 else ""))

        for kind, js in (("settled", settled), ("short", short), ("refuted", refuted)):
            for j in js:
                if b is not None and b["name"] == cols[j]:
                    continue  # said by the collapse's message below
                ratio = np.median(np.abs(X[-max(K // 4, 1):, j])) / ref_all[j]
                msgs.append(_slope_message(kind, cols[j], X[-1, j], ratio, slope_text(j)))
                if kind == "settled":
                    singular_msgs.append(msgs[-1])
        for site, f in faces.items():
            if b is not None and b["name"] in f["names"]:
                continue  # said by the collapse's message below
            msgs.append(_face_message(site, f))
            if f["kind"] == "face":
                singular_msgs.append(msgs[-1])
        if b is not None:
            sing_now = b["name"] in self.singular_params
            others = [n for n in self.singular_params if n != b["name"]]
            msgs.append(
                (_SINGULAR_PREFIX if sing_now else "SAEM: ")
                + (f"{others} also end at their boundary; " if others else "")
                + f"'{b['name']}' fell to {b['value']:.3g} at iteration "
                f"{b['iteration']} (down from {b['reference']:.3g} earlier): it is heading to "
                f"{b['bound']:g}, the boundary of its support, and "
                + (boundary_advice(b, info) if cols.index(b["name"]) not in refuted else
                   "the log-likelihood increases away from 0 along it ("
                   + slope_text(cols.index(b["name"])) + "): 0 is not its maximum, the "
                   "variance collapsed on the way (refit with a larger initial value, "
                   "init_params, or a longer exploration phase)")
                + "; the other estimates of such a fit (and the -2LL) may have been thrown "
                "off by it."
                + (f" It ends there ({X[-1, cols.index(b['name'])]:.3g}, held at "
                   f"{VARIANCE_FLOOR:g} of its largest value by the M-step): the estimates "
                   "are the maximum on the boundary (lme4 reports such a fit as "
                   "'boundary (singular) fit')." if sing_now else "")
            )
            if sing_now:
                singular_msgs.append(msgs[-1])
        if warn:
            for m in msgs:
                warnings.warn(m, SingularFitWarning if any(m is x for x in singular_msgs) else
                              ConvergenceWarning, stacklevel=3)
        return msgs

    # -- plots --------------------------------------------------------------------------------
    def plot_convergence(self, reference: dict | None = None, ncols: int = 4):
        """Trajectories of every coordinate of :math:`\\theta`; ``reference`` adds horizontal
        lines (e.g. true values or an exact maximum). Returns the matplotlib figure."""
        import matplotlib.pyplot as plt

        cols = self.names
        nrows = -(-len(cols) // ncols)
        fig, axes = plt.subplots(nrows, min(ncols, len(cols)), figsize=(3.2 * min(ncols, len(
            cols)), 2.4 * nrows), squeeze=False)
        for ax, c in zip(axes.flat, cols, strict=False):
            ax.plot(self.trajectory.index, self.trajectory[c], lw=1)
            if reference is not None and c in reference:
                ax.axhline(reference[c], color="k", ls=":", lw=1)
            ax.set_title(c, fontsize=9)
            ax.set_xlabel("iteration", fontsize=8)
        for ax in list(axes.flat)[len(cols):]:
            ax.axis("off")
        fig.tight_layout()
        return fig

    def __repr__(self) -> str:
        est = ", ".join(f"{k}={v:.4g}" for k, v in self.estimates().items())
        return f"SAEMResult(mstep={self.mstep!r}, {est})"
