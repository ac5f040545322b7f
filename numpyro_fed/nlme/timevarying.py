r"""Compartment models whose parameters change over time (time-varying covariates).

With a covariate that changes within a subject, each individual parameter is piecewise
constant: the value in force at a time is that of the last record (dose or observation, in
record order) at or before it -- last observation carried forward, as NONMEM and nlme use
time-varying covariates. The system stays linear but is no longer time-invariant, so the
superposition of the closed-form unit responses of :mod:`numpyro_fed.nlme.pk` (one set of
rate constants over the whole history) is no longer exact. As NONMEM's ADVAN routines do,
:func:`predict_piecewise` advances the compartment amounts from record to record, each
interval with the parameters in force on it:

.. math::

    A(t_{k+1}) = e^{M_k (t_{k+1} - t_k)} A(t_k) + \sum_{\text{infusions}}
    e^{M_k (t_{k+1} - u_1)} \int_0^{u_1 - u_0} e^{M_k s}\, r\, e_c\, ds,

with :math:`M_k` the rate matrix of the parameters of record :math:`k` (depot, central and
peripheral compartments; ``CL, V, KA, Q, V2, Q3, V3``) and :math:`[u_0, u_1]` the part of the
interval during which an infusion runs; the integral is a block of the exponential of the
augmented matrix :math:`[[M_k, r e_c], [0, 0]]` (Van Loan 1978). A bolus adds its amount to
its compartment (``F`` in force at the dose, for doses into compartment 1); a steady-state
dose (``SS = 1``, ``II``) replaces the amounts by the steady state of a train of identical
doses every ``II`` under the parameters in force at the dose, :math:`(I - e^{M\,II})^{-1}b`
(NONMEM's SS = 1 reset: earlier doses, running infusions included, stop there). An
observation is predicted from the amounts after its record, as the concentration
``A_central / V`` with the ``V`` in force at it (or the depot amount for ``CMT = 1`` with
first-order absorption). Amounts, not concentrations, are continuous across a change of
``V``.

One compartment (with or without a depot): the exponential of :math:`M t` in closed form
(:func:`exp_rate_matrix`: :math:`e^{-k t}`, :math:`e^{-k_a t}` and the Bateman term written
without cancellation), far cheaper to compile and differentiate than a general matrix
exponential. Otherwise the amounts are exact up to the matrix exponential's round-off
(:func:`expm_small`: Padé with scaling and squaring; differentiable to every order);
with constant parameters the result equals the closed forms
(``tests/test_nlme_diagnostics_multidose.py``: 1e-10 relative in float64), and with
piecewise-constant ones an ODE solution (``diffrax``) integrated interval by interval.

No LAPACK call: the matrix exponential (:func:`expm_small`) and the steady-state solve
(:func:`solve_small`) are written in matrix products and elementwise operations. jaxlib
0.10's CPU LAPACK kernels split a large batch of small matrices over XLA's intra-op thread
pool from a thread of that pool and block until the pieces finish; two such kernels running
at once on a two-thread pool wait for each other forever (the 136-subject Quinidine fit with
time-varying covariates stalled at 0% CPU in ``lapack_strsm_ffi``, batch 136 x 40 doses).
The vmapped prediction of every subject and draw is exactly such a batch.

Not supported: a lag time ``TLAG`` (the lagged dose times would interleave with the
records), ODE models and plain structural functions (:class:`~numpyro_fed.nlme.model.
PKModel` refuses them with time-varying covariates).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["exp_rate_matrix", "expm_small", "merge_records", "one_minus_exp_rate_matrix",
           "predict_piecewise", "rate_matrix", "solve_small"]

#: Squarings :func:`expm_small` undoes at most (1-norms up to ``theta * 2**MAX_SQUARINGS``);
#: beyond, NaN.
MAX_SQUARINGS = 32


def solve_small(A: jax.Array, B: jax.Array) -> jax.Array:
    """``X`` with ``A X = B`` for a small square ``A`` of static size: Gaussian elimination
    with partial pivoting, unrolled over the size, in gathers and elementwise operations (no
    LAPACK call; see the module docstring). Differentiable to every order (the pivot order
    is piecewise constant).

    :param A: ``(n, n)``.
    :param B: ``(n,)`` or ``(n, k)``.
    :return: the shape of ``B``.
    """
    n = A.shape[-1]
    vec = B.ndim == 1
    B = B[:, None] if vec else B
    W = jnp.concatenate([A, B.astype(jnp.result_type(A, B))], axis=1)
    rows = jnp.arange(n)
    for j in range(n - 1):
        p = j + jnp.argmax(jnp.abs(W[j:, j]))
        W = W[jnp.where(rows == j, p, jnp.where(rows == p, j, rows))]
        W = W.at[j + 1:].add(-(W[j + 1:, j] / W[j, j])[:, None] * W[j])
    X: list[jax.Array] = [jnp.zeros(())] * n
    for i in range(n - 1, -1, -1):
        acc = W[i, n:]
        for k in range(i + 1, n):
            acc = acc - W[i, k] * X[k]
        X[i] = acc / W[i, i]
    out = jnp.stack(X)
    return out[:, 0] if vec else out


def expm_small(A: jax.Array) -> jax.Array:
    r""":math:`e^{A}` of a small square matrix: the diagonal Padé approximant
    :math:`r_m = q_m(A)^{-1} p_m(A)` after scaling by :math:`2^{-s}`, then ``s`` squarings
    (Higham 2005, Algorithm 2.3 with its top degree: ``m = 13``, :math:`\theta_{13} = 5.37`
    in float64; ``m = 7``, :math:`\theta_7 = 3.93` in float32, the constants of
    ``jax.scipy.linalg.expm``), in matrix products and :func:`solve_small` (no LAPACK
    call; see the module docstring). The squarings are a fixed-length scan that skips those
    past ``s``, so reverse-mode derivatives exist.

    :param A: ``(n, n)``, floating.
    :return: ``(n, n)``; NaN when ``s`` would exceed :data:`MAX_SQUARINGS`.
    """
    A = jnp.asarray(A)
    n = A.shape[-1]
    m, theta = (13, 5.371920351148152) if A.dtype == jnp.float64 else (7, 3.925724783138660)
    norm = jax.lax.stop_gradient(jnp.max(jnp.sum(jnp.abs(A), axis=-2)))
    s = jnp.maximum(0.0, jnp.ceil(jnp.log2(jnp.maximum(norm, 1e-30) / theta)))
    X = A / (2.0 ** s).astype(A.dtype)
    b = [math.factorial(2 * m - j) * math.factorial(m)
         / (math.factorial(2 * m) * math.factorial(j) * math.factorial(m - j))
         for j in range(m + 1)]
    power = jnp.eye(n, dtype=A.dtype)
    U = jnp.zeros_like(A)
    V = b[0] * power
    for j in range(1, m + 1):
        power = power @ X
        if j % 2:
            U = U + b[j] * power
        else:
            V = V + b[j] * power
    R = solve_small(V - U, V + U)

    def square(R, i):
        return jnp.where(i < s, R @ R, R), None

    R, _ = jax.lax.scan(square, R, jnp.arange(MAX_SQUARINGS, dtype=s.dtype))
    return jnp.where(s > MAX_SQUARINGS, jnp.nan, R)


def _bateman(k: jax.Array, ka: jax.Array, t: jax.Array) -> jax.Array:
    """``(e^{-k t} - e^{-ka t}) / (ka - k)`` as ``t e^{-lo t} phi(z)``, ``z = (hi - lo) t``,
    ``phi(z) = (1 - e^{-z}) / z`` (its series below 1e-3): no cancellation, no overflow, and
    exact derivatives of every order at ``ka = k`` (the branch there is the one analytic in
    ``ka - k``, not a min / max)."""
    d = ka - k
    up = d >= 0
    lo = jnp.where(up, k, ka)
    z = jnp.where(up, d, -d) * t
    small = z < 1e-3
    zs = jnp.where(small, 1.0, z)
    phi = jnp.where(small, 1.0 - z / 2 + z * z / 6 - z * z * z / 24, -jnp.expm1(-zs) / zs)
    return t * jnp.exp(-lo * t) * phi


def exp_rate_matrix(M: jax.Array, t: jax.Array, n_compartments: int,
                    absorption: bool) -> jax.Array:
    """:math:`e^{M t}` for a rate matrix of :func:`rate_matrix` (``(S, S)``, scalar
    ``t >= 0``): in closed form for one compartment (``k = -M_cc``, ``k_a = -M_00``),
    :func:`expm_small` otherwise."""
    if n_compartments != 1:
        return expm_small(M * t)
    if not absorption:
        return jnp.exp(M * t)
    ka, k = -M[0, 0], -M[1, 1]
    zero = jnp.zeros((), M.dtype)
    return jnp.stack([jnp.stack([jnp.exp(-ka * t), zero]),
                      jnp.stack([ka * _bateman(k, ka, t), jnp.exp(-k * t)])])


def one_minus_exp_rate_matrix(M: jax.Array, t: jax.Array, n_compartments: int,
                              absorption: bool) -> jax.Array:
    r""":math:`I - e^{M t}` without cancellation, the matrix of a steady state
    :math:`(I - e^{M\,II})^{-1} b`: a slow elimination (:math:`k\,II` below the unit
    round-off, e.g. a draw with a small ``CL`` and a large ``V``) made ``1 - e^{-k II}`` 0 in
    float32, the steady state infinite and every derivative NaN. One compartment in closed
    form (``-expm1``, the Bateman term); otherwise :math:`-A\,\varphi_1(A)`, ``A = M t``,
    with :math:`\varphi_1(A) = \sum_k A^k/(k+1)!` the upper right block of the exponential
    of ``[[A, I], [0, 0]]`` (Higham 2008, Thm. 10.13)."""
    if n_compartments == 1:
        if not absorption:
            return -jnp.expm1(M * t)
        ka, k = -M[0, 0], -M[1, 1]
        zero = jnp.zeros((), M.dtype)
        return jnp.stack([jnp.stack([-jnp.expm1(-ka * t), zero]),
                          jnp.stack([-ka * _bateman(k, ka, t), -jnp.expm1(-k * t)])])
    S = M.shape[0]
    A = M * t
    big = jnp.zeros((2 * S, 2 * S), M.dtype).at[:S, :S].set(A).at[:S, S:].set(
        jnp.eye(S, dtype=M.dtype))
    return -A @ expm_small(big)[:S, S:]


def rate_matrix(p: dict[str, jax.Array], n_compartments: int, absorption: bool) -> jax.Array:
    """The matrix :math:`M` of :math:`dA/dt = M A` of a linear compartment model (states:
    depot if ``absorption``, central, peripherals -- NONMEM's compartment order).

    :param p: scalars ``CL, V`` (and ``KA``; ``Q, V2``; ``Q3, V3`` as the model needs).
    :return: ``(S, S)``.
    """
    S = n_compartments + int(absorption)
    c = int(absorption)
    k10 = p["CL"] / p["V"]
    M = jnp.zeros((S, S), jnp.result_type(k10))
    M = M.at[c, c].add(-k10)
    for j, (q, v2) in enumerate((("Q", "V2"), ("Q3", "V3"))[: n_compartments - 1]):
        kcp, kpc = p[q] / p["V"], p[q] / p[v2]
        pi = c + 1 + j
        M = M.at[c, c].add(-kcp).at[pi, c].add(kcp).at[c, pi].add(kpc).at[pi, pi].add(-kpc)
    if absorption:
        M = M.at[0, 0].add(-p["KA"]).at[c, 0].add(p["KA"])
    return M


def merge_records(t: jax.Array, doses_before: jax.Array, n_doses: int) -> tuple:
    """Positions of the observations and doses of one subject in record order.

    Observation ``j`` follows ``doses_before[j]`` doses (non-decreasing in ``j``; padding
    observations hold the number of real doses), so its position is ``j + doses_before[j]``
    and dose ``k`` has ``k`` doses and ``#{j: doses_before[j] <= k}`` observations before
    it. Padding doses land after every real record.

    :return: ``(pos_obs (T,), pos_dose (D,))``, together a permutation of ``T + D``.
    """
    nb = jnp.asarray(doses_before, jnp.int32)
    T = t.shape[0]
    k = jnp.arange(n_doses)
    pos_obs = jnp.arange(T) + nb
    pos_dose = k + jnp.sum(nb[None, :] <= k[:, None], axis=1)
    return pos_obs, pos_dose


def predict_piecewise(model: Any, p_obs: dict, p_dose: dict, t: jax.Array, doses: Any,
                      doses_before: jax.Array | None = None, cmt: jax.Array | None = None,
                      *, infusions: bool = True, steady_state: bool = True) -> jax.Array:
    """Predictions ``(T,)`` of one subject whose parameters change from record to record.

    :param model: a :class:`~numpyro_fed.nlme.pk.CompartmentModel` (its
        ``n_compartments``, ``absorption``, ``observed_cmt``, ``default_dose_cmt``).
    :param p_obs: natural-scale parameters in force at each observation record,
        ``{name: (T,)}``.
    :param p_dose: the same at each dose record, ``{name: (D,)}``.
    :param t: ``(T,)`` observation times (sorted; padding repeats a real time).
    :param doses: fields ``time, amt, rate, cmt, ss, ii, mask``, each ``(D,)``.
    :param doses_before: ``(T,)`` doses recorded before each observation (default: the doses
        at or before its time).
    :param cmt: ``(T,)`` compartment of each observation (0: the observed one).
    :param infusions: whether any dose may be an infusion (static; ``False`` skips their
        terms, and an infusion then makes its subject NaN).
    :param steady_state: whether any dose may be at steady state (static; the same).
    :return: ``(T,)``.
    """
    if "TLAG" in p_obs or "TLAG" in p_dose:
        raise ValueError("time-varying parameters with a lag time TLAG are not supported: "
                         "remove TLAG from the params, or make its covariates constant.")
    n_c = model.n_compartments
    absorb = model.absorption is not None
    S = n_c + int(absorb)
    c_idx = int(absorb)
    t = jnp.asarray(t)
    dtype = jnp.result_type(t, *p_obs.values(), *p_dose.values())
    t = t.astype(dtype)
    T = t.shape[0]
    dm = jnp.asarray(doses.mask, bool)
    dtime = jnp.where(dm, jnp.asarray(doses.time, dtype), 0.0)
    D = dtime.shape[0]
    if doses_before is None:
        doses_before = jnp.sum(dm[None, :] & (dtime[None, :] <= t[:, None]), axis=1)
    pos_o, pos_d = merge_records(t, doses_before, D)
    E = T + D

    def scatter(vo, vd):
        out = jnp.zeros((E,) + jnp.shape(vo)[1:], jnp.result_type(vo, vd))
        return out.at[pos_o].set(vo).at[pos_d].set(vd)

    names = sorted(set(p_obs) | set(p_dose))
    p_ev = {k: scatter(jnp.asarray(p_obs[k], dtype), jnp.asarray(p_dose[k], dtype))
            for k in names}
    if "F" not in p_ev:
        p_ev["F"] = jnp.ones((E,), dtype)
    is_dose = scatter(jnp.zeros(T, bool), dm)
    ev_t = jax.lax.cummax(scatter(t, dtime), axis=0)  # padding never goes back in time
    M = jax.vmap(lambda q: rate_matrix(q, n_c, absorb))(p_ev)  # (E, S, S)
    M_prev = jnp.concatenate([M[:1], M[:-1]])
    dt = jnp.diff(ev_t, prepend=ev_t[:1])
    def em(Mk, tk):  # e^{M t} (closed form for one compartment)
        return exp_rate_matrix(Mk, tk, n_c, absorb)

    Phi = jax.vmap(em)(M_prev, dt)  # (E, S, S)

    # ---- per dose (D,): amount, rate, duration, target compartment, steady state
    dcmt = jnp.asarray(doses.cmt, jnp.int32)
    valid_cmt = (dcmt >= 1) & (dcmt <= S)
    tgt = jax.nn.one_hot(jnp.clip(dcmt - 1, 0, S - 1), S, dtype=dtype)  # (D, S)
    f_d = jnp.asarray(p_dose.get("F", jnp.ones((D,), dtype)), dtype)
    amt = jnp.asarray(doses.amt, dtype)
    amt = jnp.where(dcmt == model.default_dose_cmt, f_d * amt, amt)
    rate = jnp.asarray(doses.rate, dtype)
    inf = dm & (rate > 0)
    ss = dm & jnp.asarray(doses.ss, bool)
    ii = jnp.where(ss, jnp.asarray(doses.ii, dtype), 1.0)
    tau = jnp.where(inf, amt / jnp.where(inf, rate, 1.0), 0.0)
    bad = dm & (~valid_cmt | (rate < 0) | (ss & (jnp.asarray(doses.ii, dtype) <= 0)))
    if not infusions:
        bad = bad | inf
    if not steady_state:
        bad = bad | ss
    bad = bad | (ss & inf & (tau > ii))  # overlapping steady-state infusions
    bolus = jnp.where((dm & ~inf)[:, None], amt[:, None] * tgt, 0.0)  # (D, S)
    M_d = M[pos_d]  # parameters in force at each dose

    def aug(Mk, r_vec, length):  # int_0^length e^{M s} r_vec ds
        A = jnp.zeros((S + 1, S + 1), dtype).at[:S, :S].set(Mk).at[:S, S].set(r_vec)
        return expm_small(A * length)[:S, S]

    if steady_state:
        I_Phi = jax.vmap(lambda Mk, tk: one_minus_exp_rate_matrix(Mk, tk, n_c, absorb))(
            M_d, ii)
        b_ss = bolus
        if infusions:
            r_vec = rate[:, None] * tgt
            one = jax.vmap(aug)(M_d, r_vec, tau)  # amounts at the end of one infusion
            rest = jax.vmap(em)(M_d, jnp.maximum(ii - tau, 0.0))
            b_ss = jnp.where(inf[:, None], jnp.einsum("dij,dj->di", rest, one), bolus)
        x_ss = jax.vmap(solve_small)(I_Phi, b_ss)  # (D, S)
        # a steady-state infusion: the amounts before the current one, which then runs
    else:
        x_ss = jnp.zeros((D, S), dtype)

    # ---- infusions running during each interval (E, S)
    if infusions:
        idx = jnp.arange(D)
        later = idx[None, :] > idx[:, None]
        reset = jnp.min(jnp.where(later & ss[None, :], dtime[None, :], jnp.inf), axis=1,
                        initial=jnp.inf)
        end = jnp.minimum(dtime + tau, reset)
        a_t = jnp.concatenate([ev_t[:1], ev_t[:-1]])  # interval k: [a_t[k], ev_t[k]]
        u0 = jnp.clip(dtime[None, :], a_t[:, None], ev_t[:, None])
        u1 = jnp.clip(end[None, :], a_t[:, None], ev_t[:, None])
        on = inf[None, :] & (u1 > u0)
        r_vec = rate[:, None] * tgt

        def contrib(Mk, tk, u0k, u1k, onk):
            J = jax.vmap(lambda r, ln: aug(Mk, r, ln))(r_vec, jnp.where(onk, u1k - u0k, 0.0))
            P = jax.vmap(lambda s: em(Mk, s))(jnp.where(onk, tk - u1k, 0.0))
            return jnp.sum(jnp.where(onk[:, None], jnp.einsum("dij,dj->di", P, J), 0.0), 0)

        inf_ev = jax.vmap(contrib)(M_prev, ev_t, u0, u1, on)
    else:
        inf_ev = jnp.zeros((E, S), dtype)

    dose_of_ev = scatter(jnp.zeros(T, jnp.int32), jnp.arange(D, dtype=jnp.int32))
    add_ev = jnp.where(is_dose[:, None], bolus[dose_of_ev], 0.0)
    ss_ev = is_dose & ss[dose_of_ev]
    xss_ev = x_ss[dose_of_ev]

    def step(x, ev):
        Phi_k, inf_k, add_k, ss_k, xss_k = ev
        x = Phi_k @ x + inf_k
        x = jnp.where(ss_k, xss_k, x + add_k)
        return x, x

    _, X = jax.lax.scan(step, jnp.zeros((S,), dtype), (Phi, inf_ev, add_ev, ss_ev, xss_ev))
    x_obs = X[pos_o]  # (T, S): amounts after each observation record
    out = x_obs[:, c_idx] / jnp.asarray(p_obs["V"], dtype)
    if cmt is not None:
        cmt = jnp.asarray(cmt, jnp.int32)
        other = jnp.full((T,), jnp.nan, dtype)
        if absorb:
            other = jnp.where(cmt == 1, x_obs[:, 0], other)
        out = jnp.where((cmt == 0) | (cmt == model.observed_cmt), out, other)
    return out + jnp.where(jnp.any(bad), jnp.nan, 0.0)
