"""E-steps of MCMC-SAEM: Markov kernels targeting :math:`p(z\\mid y;\\theta)`.

:class:`LangevinEStep` is the built-in E-step (pure JAX, explicit state
:class:`LangevinEStepState`): per E-step, ``prior_proposals`` independence Metropolis--Hastings
moves proposing from :math:`p(z\\mid\\theta)` (saemix's kernel 1), then ``num_steps``
preconditioned Langevin moves (MALA, or ULA without the accept/reject test; Gruffaz et al.
2024, Sec. 2.3), each subject accepted or rejected on its own -- valid because
:math:`p(z\\mid y;\\theta) = \\prod_i p(z_i\\mid y_i;\\theta)` given the subject layout.

Adaptation (on by default when no ``step_size`` is given): during the exploration phase,
each subject's step size :math:`h_i` follows a Robbins--Monro recursion towards the target
acceptance rate, and its preconditioner :math:`M_i = L_iL_i^\\top` is the running covariance of
that subject's draws (pooled over chains; initialised at the covariance of draws from the
prior at :math:`\\theta_0`), as saemix scales its random-walk proposals by the conditional
variances. After the exploration phase both are frozen (the average of :math:`\\log h_i` over
the adaptation is kept), so the kernel is fixed while the statistics are averaged.

:class:`NumPyroEStep` runs any NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel` (NUTS, our
federated kernels), re-bound to each new :math:`\\theta` with ``refresh`` (state
:class:`NumPyroEStepState`).

Both implement the :class:`~numpyro_fed.saem.protocols.EStep` protocol, the only members
the fit loop calls. Duck typing is left only where the object is the user's NumPyro kernel
or its state (which fields a kernel's state has is the kernel's own business).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from jax.flatten_util import ravel_pytree
from numpyro.handlers import block, substitute
from numpyro.infer.mcmc import MCMCKernel

from numpyro_fed.algorithms.langevin import (
    block_preconditioner,
    langevin_noise,
    langevin_proposal,
    mala_log_ratio,
)
from numpyro_fed.saem.model import (
    ModelInfo,
    SubjectLayout,
    block_hessian,
    block_jet,
    from_blocks,
    log_joint_per_subject,
    pad_mask,
    to_blocks,
)
from numpyro_fed.saem.protocols import EStep

__all__ = ["LangevinEStep", "LangevinEStepState", "NumPyroEStep", "NumPyroEStepState",
           "flat_preconditioner"]

#: largest number of latent coordinates per subject with a full (not diagonal) preconditioner.
#: Nested levels make large blocks whose coordinates trade off (a location's effect against
#: its broods' and chicks': only their sums meet the data), which a diagonal metric cannot
#: follow: on lme4's grouseticks with three nested intercepts (locations of up to 29 latents,
#: 32 chains) the diagonal metric left seed 2 with the location / brood variances 0.35 SE
#: off the exact maximum (gap 0.157, no warning; a longer final phase or the Newton M-step:
#: the same), the full one 0.12 SE (0.029); seeds 0-5 0.001-0.029 and every estimate within
#: 0.12 SE, against 0.011-0.157 and 0.35 SE. Crossed Penicillin (one block of 30): the same
#: estimates, 3.4-4.6 s a fit against 5.2 s. The cost is ``q`` derivative passes per
#: iteration for the curvature at the tracked modes and a ``q x q`` factorisation per block.
FULL_PRECONDITIONER_MAX = 32

#: up to this many latent coordinates per subject, the E-step's gradients are computed in
#: forward mode: one JVP per coordinate of a block, for every subject at once -- exact, as
#: :math:`U_i` depends on :math:`z_i` alone (the layout's factorisation, which the
#: per-subject Metropolis test relies on too) -- instead of one reverse pass; the block
#: Hessians of the preconditioner are then forward over forward. The reverse pass of a
#: sparse-superposition PK model transposes its gathers into scatter-adds, slow on XLA:CPU:
#: on ``nlme::Quinidine`` (136 subjects, CL and V) the value and gradient of two chains took
#: 2.0-3.1 ms in forward mode against 5.6-23 ms in reverse (2-core CPU, loaded)
FORWARD_GRADIENT_MAX = 3


def _abs_eigh(H):
    """Eigen-decomposition of the blocks ``H`` ``(n, q, q)`` with the eigenvalues replaced by
    their absolute values, floored at 1e-6 of each block's largest (saddle-free)."""
    lam, V = jnp.linalg.eigh(H)
    lam = jnp.abs(lam)
    return jnp.maximum(lam, 1e-6 * jnp.max(lam, -1, keepdims=True) + 1e-30), V


def _inverse(lam, V, dt):
    """The blocks ``V diag(1 / lam) V^T`` (a non-finite eigenvalue counted as 1)."""
    lam = jnp.where(jnp.isfinite(lam), lam, 1.0)
    return jnp.einsum("nij,nj,nkj->nik", V, 1.0 / lam, V).astype(dt)


class LangevinEStepState(NamedTuple):
    """State of :class:`LangevinEStep`.

    - **z** -- latents of every chain, flat unconstrained ``(C, d_z)``.
    - **log_step** -- current :math:`\\log h_i` per subject ``(n,)``.
    - **log_step_avg** -- its running average over the adaptation (used once frozen).
    - **mean** -- the tracked conditional modes, flat ``(d_z,)`` (diagonal blocks: the mean
      of the chains).
    - **cov** -- the preconditioner :math:`M_i` ``(n, q, q)`` (``(n, q)``: diagonal).
    - **chol** -- the preconditioner factor :math:`L_i` (same shape as ``cov``).
    - **count** -- adaptation E-steps done so far.
    """

    z: jax.Array
    log_step: jax.Array
    log_step_avg: jax.Array
    mean: jax.Array
    cov: jax.Array
    chol: jax.Array
    count: jax.Array


def flat_preconditioner(info: ModelInfo, precond: Callable | None):
    """A user preconditioner ``P(theta_c) -> dict | array`` as a flat ``(d_z,)`` function of
    unconstrained :math:`\\theta`."""
    if precond is None:
        return None

    def P(theta_u):
        p = precond(info.constrain_theta(theta_u))
        if not isinstance(p, dict):
            return jnp.broadcast_to(jnp.asarray(p), (info.dim_z,))
        full = {
            n: jnp.broadcast_to(jnp.asarray(p.get(n, 1.0)), info.z_u_shapes[n])
            for n in info.latent_names
        }
        return ravel_pytree(full)[0]

    return P


class LangevinEStep(EStep):
    """Built-in E-step: prior proposals + per-subject preconditioned MALA (or ULA).

    :param info: the model.
    :param layout: the subject layout (the joint layout: one block).
    :param mala: Metropolis-adjust the Langevin moves (``False``: ULA, the E-step of Gruffaz
        et al. 2024).
    :param step_size: fixed step size (no adaptation), or ``None`` for adaptive steps.
    :param preconditioner: fixed diagonal preconditioner ``P(theta_u) -> (d_z,)`` (with a
        fixed step: Gruffaz et al. 2024, Sec. 5.4), or ``None``.
    :param prior_proposals: independence MH moves from :math:`p(z\\mid\\theta)` per E-step.
    :param target_accept: target acceptance rate of the adaptation (0.574: optimal MALA).
    """

    def __init__(self, info: ModelInfo, layout: SubjectLayout, *, mala: bool = True,
                 step_size: float | None = None, preconditioner: Callable | None = None,
                 prior_proposals: int = 0, target_accept: float = 0.574,
                 adapt_gain: float = 0.3) -> None:
        self.info, self.layout = info, layout
        self.mala = mala
        self.adaptive = step_size is None
        self.step_size = step_size
        self.P = preconditioner
        self.n_prior = int(prior_proposals)
        self.target = float(target_accept)
        self.gain = float(adapt_gain)
        self.full = self.adaptive and layout.q <= FULL_PRECONDITIONER_MAX
        self.zidx = np.asarray(layout.zidx)
        #: padded entries of unequal groups (standard normal pseudo-coordinates)
        self.pad = pad_mask(self.zidx)
        #: gradients in forward mode (see FORWARD_GRADIENT_MAX)
        self.forward = layout.q <= FORWARD_GRADIENT_MAX

    # -- helpers ---------------------------------------------------------------------------
    def to_blocks(self, z):  # (..., d_z) -> (..., n, q)
        return to_blocks(z, self.zidx)

    def from_blocks(self, zb):  # (..., n, q) -> (..., d_z)
        return from_blocks(zb, self.zidx)

    def _U(self, theta_c, data, ids):
        info, layout = self.info, self.layout
        args, kwargs = data

        def U(q):
            per, rest = log_joint_per_subject(info, layout, theta_c, q, args, kwargs,
                                              ids=ids)
            return -per

        if self.forward:
            def vg_one(zf):
                return self._forward_value_grad(U, zf)
        else:
            def vg_one(zf):
                u, vjp = jax.vjp(U, zf)
                return u, vjp(jnp.ones_like(u))[0]

        return jax.vmap(vg_one)

    def _forward_value_grad(self, U_sub, zf):
        """``(U_sub(zf) (n,), gradient of sum(U_sub) (d_z,))`` in forward mode: the JVP
        along :math:`e_k` in every block at once gives :math:`\\partial U_i / \\partial
        z_{ik}` for every subject :math:`i` (block separability: :math:`U_i` depends on
        :math:`z_i` only)."""
        n, q = self.zidx.shape
        eye = jnp.eye(q, dtype=zf.dtype)
        E = jnp.stack([self.from_blocks(jnp.broadcast_to(eye[k], (n, q))) for k in range(q)])
        u, cols = jax.vmap(lambda e: jax.jvp(U_sub, (zf,), (e,)), out_axes=(None, 0))(E)
        return u, self.from_blocks(cols.T)  # cols (q, n): column k of every block

    def _loglik(self, theta_c, data, ids):
        args, kwargs = data
        return jax.vmap(lambda zf: log_joint_per_subject(
            self.info, self.layout, theta_c, zf, args, kwargs, observed_only=True, ids=ids)[0])

    # -- init ------------------------------------------------------------------------------
    def init(self, key, z, theta_u, data, ids=None, log_step=None) -> LangevinEStepState:
        """Initial state at the chains' latents ``z`` ``(C, d_z)``; the adaptive
        preconditioner starts at the curvature at the chains' mean (see :meth:`_track`). With
        a fixed step, ``log_step`` (traced; default: the log of ``step_size``) -- so that one
        compiled program serves every step size of a sweep."""
        n, q = self.layout.n, self.layout.q
        dt = z.dtype
        mode = jnp.mean(z, 0)
        if self.adaptive:
            theta_c = self.info.constrain_theta(theta_u)
            gradU = self._gradU(theta_c, data, ids)
            cov = self._inv_curvature(key, gradU, z if not self.full else mode[None])
            log_step = jnp.full((n,), jnp.log(0.5 / q ** (1.0 / 3.0)), dt)
        else:
            cov = jnp.ones((n, q), dt)
            ls = jnp.log(self.step_size) if log_step is None else log_step
            log_step = jnp.full((n,), ls, dt)
        return LangevinEStepState(z, log_step, log_step, mode, cov, self._chol(cov),
                                  jnp.zeros((), dt))

    def _gradU(self, theta_c, data, ids):
        info, layout = self.info, self.layout
        args, kwargs = data

        def U_sub(q):
            return -log_joint_per_subject(info, layout, theta_c, q, args, kwargs, ids=ids)[0]

        if self.forward:
            def value_grad(zf):
                return self._forward_value_grad(U_sub, zf)
        else:
            def value_grad(zf):
                u, vjp = jax.vjp(U_sub, zf)
                return u, vjp(jnp.ones_like(u))[0]

        def gradU(zf):
            return value_grad(zf)[1]

        gradU.per_subject = U_sub
        gradU.value_grad = value_grad
        return gradU

    def _inv_curvature(self, key, gradU, pts):
        """Inverse curvature of :math:`U_i = -\\log p(y_i, z_i\\mid\\theta)`: per subject,
        the inverse Hessian block averaged over the points ``pts`` ``(P, d_z)`` with its
        eigenvalues replaced by their absolute values (floored at 1e-6 of the largest) -- the
        Laplace covariance where :math:`p(z_i\\mid y_i;\\theta)` is log-concave. With more
        than ``FULL_PRECONDITIONER_MAX`` coordinates per block: the inverse diagonal, by
        Hutchinson's estimator (8 Rademacher probes per point)."""
        layout = self.layout
        dt = pts.dtype
        if self.full:
            H = jnp.mean(jax.vmap(lambda zf: block_hessian(gradU, zf, layout))(pts), 0)
            return _inverse(*_abs_eigh(H), dt)
        v = random.rademacher(key, (8,) + pts.shape, dt)

        def hd(zf, vv):
            return vv * jax.jvp(gradU, (zf,), (vv,))[1]

        d = jnp.mean(jax.vmap(lambda vv: jax.vmap(hd)(pts, vv))(v), (0, 1))  # (d_z,)
        d = self.to_blocks(jnp.abs(d))
        if self.pad.any():
            d = jnp.where(jnp.asarray(self.pad), 1.0, d)
        d = jnp.maximum(d, 1e-6 * jnp.max(d) + 1e-30)
        return jnp.where(jnp.isfinite(d), 1.0 / d, 1.0).astype(dt)

    def _track(self, key, state, z, theta_c, data, ids):
        """One damped Newton step of each subject's conditional mode (warm-started at the
        previous one; a backtracking search keeps the best of 4 step lengths per subject)
        and the metric at the mode it started from: a function of :math:`\\theta` and of the
        previous modes, not of the chains' positions. Diagonal blocks: the metric at the
        chains' positions, averaged with the previous one."""
        gradU = self._gradU(theta_c, data, ids)
        dt = z.dtype
        if not self.full:
            m = self._inv_curvature(key, gradU, z)
            return jnp.mean(z, 0), 0.7 * state.cov + 0.3 * m
        U_sub = gradU.per_subject
        mode = state.mean
        # the value, gradient and curvature at the tracked mode from one program site
        u0, g, H = block_jet(gradU.value_grad, mode, self.layout)
        g = self.to_blocks(g)
        lam, V = _abs_eigh(H)
        step = -jnp.einsum("nij,nj->ni", V, jnp.einsum("nji,nj->ni", V, g) / lam)
        step = jnp.where(jnp.isfinite(step), step, 0.0)

        # the four step lengths evaluated at once (one batched evaluation rather than four in
        # sequence); per subject the lowest finite U below the start's, the longest step on
        # a tie, else the start (what a sequential search keeping strict improvements gives)
        scales = jnp.asarray([1.0, 0.5, 0.25, 0.1], dt)
        cands = mode[None] + jax.vmap(lambda sc: self.from_blocks(sc * step))(scales)
        uc = jax.vmap(U_sub)(cands)  # (4, n)
        better = jnp.isfinite(uc) & (uc < u0[None])
        k = jnp.argmin(jnp.where(better, uc, jnp.inf), 0)  # (n,)
        cb = self.to_blocks(cands)  # (4, n, q)
        pick = jnp.take_along_axis(cb, k[None, :, None], 0)[0]
        mode_new = self.from_blocks(jnp.where(jnp.any(better, 0)[:, None], pick,
                                              self.to_blocks(mode)))
        # the metric: the inverse curvature at the mode the Newton step started from (the
        # curvature at the new mode would be another copy of the model's second derivatives
        # in the program; the modes converge, and the metric follows one E-step behind)
        cov = _inverse(lam, V, dt)
        ok = jnp.all(jnp.isfinite(cov), (-2, -1))[:, None, None]
        return mode_new, jnp.where(ok, cov, state.cov)

    def _chol(self, cov):
        if self.full:
            return jnp.linalg.cholesky(cov)
        return jnp.sqrt(cov)

    # -- one E-step --------------------------------------------------------------------------
    def step(self, key, state: LangevinEStepState, theta_u, data, num_steps, adapt,
             ids=None):
        """Prior proposals, then ``num_steps`` Langevin moves; with ``adapt`` (traced bool) the
        step sizes and preconditioners adapt. Returns ``(state, mean_accept, finite)``."""
        info = self.info
        theta_c = info.constrain_theta(theta_u)
        vg = self._U(theta_c, data, ids)
        z = state.z
        dt = z.dtype
        k_prior, k_mcmc = random.split(key)
        if self.n_prior:
            z = self._prior_mh(k_prior, z, theta_c, data, ids)
        zb = self.to_blocks(z)
        pad = self.pad.any()
        if pad:
            # the padded pseudo-coordinates are independent standard normals: an exact
            # draw (a Gibbs step) keeps the moves below invariant for the real ones
            m = jnp.asarray(self.pad, dt)
            zb = zb + m * random.normal(random.fold_in(k_prior, 5), zb.shape, dt)
            vg_flat = vg

            def vg(zf, yb=None):  # noqa: F811 -- the block version with the padding
                u_, g_ = vg_flat(zf)
                return u_ + 0.5 * jnp.sum(m * yb**2, -1), g_, m * yb
        else:
            m = None
        if self.adaptive:
            log_h = jnp.where(adapt, state.log_step, state.log_step_avg)
            L = state.chol
        else:
            log_h = state.log_step
            p = jnp.ones(info.dim_z, dt) if self.P is None else self.P(theta_u).astype(dt)
            L = self.to_blocks(jnp.sqrt(p))
        pre = block_preconditioner(L, self.full)

        def evaluate(yb):
            if pad:
                uy, gy, gpy = vg(self.from_blocks(yb), yb)
                return uy, self.to_blocks(gy) + gpy
            uy, gy = vg(self.from_blocks(yb))
            return uy, self.to_blocks(gy)

        # step 0 evaluates U and its gradient at the current chains (the state of the first
        # move); steps 1..num_steps are the moves. One evaluation site in the program, not two
        # (each is a copy of the model's log-density and its derivatives to compile)
        def body(i, carry):
            zb, u, gb, log_h, acc_sum = carry
            first = i == 0
            kn, ka = random.split(random.fold_in(k_mcmc, i - 1))
            h = jnp.exp(log_h)[None, :, None]
            xi = langevin_noise(kn, zb)
            yb = jnp.where(first, zb, langevin_proposal(zb, gb, h, xi, pre))
            uy, gyb = evaluate(yb)
            # whitened residuals (see mala_log_ratio): r_fwd = sqrt(2h) xi exactly
            fwd = jnp.sqrt(2.0 * h) * xi
            bwd = -fwd + h * pre.mul_Lt(gb + gyb)
            lr = mala_log_ratio(u, uy, jnp.sum(fwd**2, -1), jnp.sum(bwd**2, -1), h[..., 0])
            acc = jnp.exp(jnp.minimum(lr, 0.0))  # (C, n)
            if self.mala:
                ok = (random.uniform(ka, acc.shape, dt) < acc) | first
                yb = jnp.where(ok[..., None], yb, zb)
                uy = jnp.where(ok, uy, u)
                gyb = jnp.where(ok[..., None], gyb, gb)
            return yb, uy, gyb, log_h, acc_sum + jnp.where(first, 0.0, jnp.mean(acc))

        zeros = jnp.zeros(zb.shape[:-1], dt)
        zb, u, gb, log_h, acc_sum = lax.fori_loop(
            0, num_steps + 1, body, (zb, zeros, jnp.zeros_like(zb), log_h, jnp.zeros((), dt)))
        z = self.from_blocks(zb)
        finite = jnp.all(jnp.isfinite(u)) & jnp.all(jnp.isfinite(z))
        acc = acc_sum / jnp.maximum(num_steps, 1).astype(dt)
        if not self.adaptive:
            return state._replace(z=z), acc, finite
        # adaptation between E-steps (a real branch: nothing is computed once it is over):
        # one global step size from the acceptance averaged over subjects and chains, and the
        # metric at the tracked conditional modes -- neither depends on one chain's position,
        # so the draws of the exploration phase stay close to the target
        cnt = state.count

        def step_sizes():
            lh = state.log_step + self.gain * (acc - self.target)
            lh = jnp.clip(lh, -30.0, 5.0)
            avg_rate = jnp.where(cnt < 20, 1.0 / (cnt + 1.0), 0.05).astype(dt)
            return lh, state.log_step_avg + avg_rate * (lh - state.log_step_avg)

        if self.full:
            # the metric keeps following theta after the adaptation (the step size is frozen):
            # it is a function of theta and of the tracked modes only, and a variance that
            # shrinks in the averaging phase would otherwise leave a metric too wide. It is
            # computed once, outside the branch (one copy in the compiled program).
            mode, cov = self._track(random.fold_in(key, 7), state, z, theta_c, data, ids)
            tracked = state._replace(z=z, mean=mode, cov=cov, chol=self._chol(cov))

            def adapted(_):
                lh, log_avg = step_sizes()
                return tracked._replace(log_step=lh, log_step_avg=log_avg, count=cnt + 1.0)

            frozen = lambda _: tracked  # noqa: E731
        else:
            def adapted(_):
                lh, log_avg = step_sizes()
                mode, cov = self._track(random.fold_in(key, 7), state, z, theta_c, data, ids)
                return LangevinEStepState(z, lh, log_avg, mode, cov, self._chol(cov), cnt + 1.0)

            frozen = lambda _: state._replace(z=z)  # noqa: E731
        out = lax.cond(adapt & finite, adapted, frozen, None)
        return out, acc, finite

    def _prior_mh(self, key, z, theta_c, data, ids):
        """Independence Metropolis--Hastings with the prior :math:`p(z\\mid\\theta)` as
        proposal (saemix's kernel 1): the acceptance ratio is the likelihood ratio, per
        subject."""
        info = self.info
        args, kwargs = data
        loglik = self._loglik(theta_c, data, ids)

        # step 0 evaluates the current chains' likelihood (carried: a rejected proposal keeps
        # it), steps 1..n_prior propose: one evaluation site in the program, n_prior + 1
        # evaluations rather than 2 n_prior
        def body(i, carry):
            zz, ll_z = carry
            first = i == 0
            kd, ku = random.split(random.fold_in(key, i - 1))
            y = jax.vmap(lambda k: info.prior_draw(k, theta_c, args, kwargs))(
                random.split(kd, zz.shape[0]))
            y = jnp.where(first, zz, y)
            ll_y = loglik(y)
            lr = ll_y - ll_z  # (C, n)
            lr = jnp.where(jnp.isnan(lr), -jnp.inf, lr)
            ok = (jnp.log(random.uniform(ku, lr.shape, zz.dtype)) < lr) | first
            yb, zb = self.to_blocks(y), self.to_blocks(zz)
            return (self.from_blocks(jnp.where(ok[..., None], yb, zb)),
                    jnp.where(ok, ll_y, ll_z))

        ll0 = jnp.zeros(self.to_blocks(z).shape[:-1], z.dtype)
        return lax.fori_loop(0, self.n_prior + 1, body, (z, ll0))[0]

    def latents(self, state: LangevinEStepState) -> jax.Array:
        """The chains' latents ``(C, d_z)``."""
        return state.z

    def move(self, state: LangevinEStepState, fn: Callable) -> LangevinEStepState:
        """Move every chain and the tracked modes by ``fn`` (flat ``(d_z,) -> (d_z,)``, an
        affine map per coordinate: SAEM's centring shift :math:`z - M\\Delta\\theta`, see
        :func:`~numpyro_fed.saem.model.centring_design`, or the M-step's transport)."""
        return state._replace(z=jax.vmap(fn)(state.z), mean=fn(state.mean))

    def step_size_summary(self, state: LangevinEStepState) -> str:
        h = np.exp(np.asarray(state.log_step_avg if self.adaptive else state.log_step))
        if self.adaptive:
            return f"adaptive step size {np.median(h):.3g} with curvature preconditioning"
        return f"step_size={float(h[0]):.3g}"


def _energy_finite(kstate) -> jax.Array:
    """Whether the potential energy a NumPyro kernel state tracks (``potential_energy``,
    or ``energy`` for the federated kernels) is finite; ``True`` when it tracks none."""
    for field in ("potential_energy", "energy"):
        e = getattr(kstate, field, None)
        if e is not None and hasattr(e, "dtype") and jnp.issubdtype(e.dtype, jnp.floating):
            return jnp.all(jnp.isfinite(e))
    return jnp.asarray(True)


class NumPyroEStepState(NamedTuple):
    """State of :class:`NumPyroEStep`.

    - **z** -- latents of every chain, flat unconstrained ``(C, d_z)``.
    - **kernel_state** -- the NumPyro kernel's own state, stacked over the chains.
    """

    z: jax.Array
    kernel_state: Any


class NumPyroEStep(EStep):
    """Any NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel` as the E-step.

    The kernel receives :math:`\\theta` through the model keyword ``_saem_theta`` and is
    re-bound to each new :math:`\\theta` with ``refresh`` (NumPyro >= 0.22). A federated
    kernel holds the per-row data in its ``ClientPartition``: it receives only the non-row
    arguments.
    """

    def __init__(self, info: ModelInfo, model: Callable, kernel: MCMCKernel | Callable,
                 data_kwargs: dict, has_args: bool) -> None:
        self.info = info

        def wrapper(m):
            # `block` hides the param sites from outer handlers: NumPyro's initialize_model
            # would otherwise substitute their initial values over the current theta
            def conditioned(*a, _saem_theta=None, **kw):
                with block(hide_fn=lambda site: site["type"] == "param"):
                    with substitute(data=_saem_theta if _saem_theta is not None else {}):
                        return m(*a, **kw)

            return conditioned

        if isinstance(kernel, MCMCKernel):
            try:
                k = kernel.wrap_model(wrapper)
            except NotImplementedError as err:
                raise ValueError(
                    f"{type(kernel).__name__} does not implement `wrap_model`; pass a "
                    "factory instead, e.g. kernel=lambda m: ULA(m, step_size=...)."
                ) from err
        else:
            k = kernel(wrapper(model))
            if not isinstance(k, MCMCKernel):
                raise TypeError("the `kernel` factory must return a NumPyro MCMCKernel.")
        if getattr(k, "check_finite", False):
            # the E-step is vmapped over chains and checked for divergence by SAEM; a host
            # callback per step inside a vmapped kernel would run at every step
            k = copy.copy(k)
            k.check_finite = False
        self.kernel = k
        self.field = k.sample_field
        self.row_keys = set(getattr(getattr(k, "partition", None), "keys", ()))
        if self.row_keys and has_args:
            raise ValueError(
                "With a federated E-step kernel, pass the data to SAEM.run as keyword "
                "arguments (the kernel takes the per-row data from its ClientPartition)."
            )

    def latents(self, state: NumPyroEStepState) -> jax.Array:
        """The chains' latents ``(C, d_z)``."""
        return state.z

    def move(self, state: NumPyroEStepState, fn: Callable) -> NumPyroEStepState:
        """No centring or transport for user kernels (their state is theirs): unchanged."""
        return state

    def step_size_summary(self, state: NumPyroEStepState | None = None) -> str:
        """The kernel's own step size: the one in its state when it keeps one (HMC/NUTS's
        ``adapt_state.step_size``, set by its step-size search at ``init``; MALA's
        ``step_size``), else the one it was built with."""
        name = type(self.kernel).__name__
        h = None
        if state is not None:
            ks = state.kernel_state
            h = getattr(getattr(ks, "adapt_state", None), "step_size", None)
            if h is None:
                h = getattr(ks, "step_size", None)
        if h is None:
            for attr in ("step_size", "_step_size"):
                h = getattr(self.kernel, attr, None)
                if h is not None and not callable(h):
                    break
                h = None
        try:
            h = np.asarray(h, dtype=float).reshape(-1)
        except (TypeError, ValueError):
            return name
        if h.size == 0:
            return name
        lo, hi = float(np.min(h)), float(np.max(h))
        if f"{lo:.3g}" == f"{hi:.3g}":
            return f"{name} step_size={lo:.3g}"
        return f"{name} step_size={lo:.3g}..{hi:.3g} over chains"

    def _kw(self, theta_u, data):
        args, kwargs = data
        kw = {k: v for k, v in kwargs.items() if k not in self.row_keys}
        return {**kw, "_saem_theta": self.info.constrain_theta(theta_u)}

    def init(self, key, z, theta_u, data, ids=None) -> NumPyroEStepState:
        """The kernel's ``init`` per chain at the latents ``z`` (host side: NumPyro's
        ``init`` is not traceable in general), stacked."""
        args, _ = data
        states = []
        for c, k in enumerate(random.split(key, z.shape[0])):
            zu = self.info._unravel_z(z[c])
            states.append(self.kernel.init(k, 0, zu, args, self._kw(theta_u, data)))
        return NumPyroEStepState(z, jax.tree.map(lambda *v: jnp.stack(v), *states))

    def step(self, key, state: NumPyroEStepState, theta_u, data, num_steps, adapt, ids=None):
        """``refresh`` the kernel at :math:`\\theta`, then ``num_steps`` of its ``sample``,
        vmapped over the chains. Returns ``(state, mean_accept, finite)``."""
        args, _ = data
        kwt = self._kw(theta_u, data)
        _, kstate = state
        kernel = self.kernel
        kstate = jax.vmap(lambda s: kernel.refresh(s, args, kwt))(kstate)

        def body(_, c):
            s, acc_sum = c
            s = jax.vmap(lambda st: kernel.sample(st, args, kwt))(s)
            acc = jnp.mean(getattr(s, "accept_prob", jnp.ones(())))
            return s, acc_sum + acc.astype(acc_sum.dtype)

        zdt = state.z.dtype
        kstate, acc_sum = lax.fori_loop(0, num_steps, body, (kstate, jnp.zeros((), zdt)))
        zf = jax.vmap(lambda st: ravel_pytree(getattr(st, self.field))[0])(kstate)
        # the kernel's own divergence check is off (see __init__): the E-step is finite when
        # its latents AND the potential energy it tracks are (a chain running off to 1e20 has
        # finite coordinates but an infinite energy -- what the kernel's guard caught)
        finite = jnp.all(jnp.isfinite(zf)) & _energy_finite(kstate)
        acc = acc_sum / jnp.maximum(num_steps, 1).astype(zdt)
        return NumPyroEStepState(zf, kstate), acc, finite
