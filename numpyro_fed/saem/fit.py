"""MCMC-SAEM: the :class:`SAEM` front end and the pure fit loop.

The loop (Dynamax ``fit_em`` style, over the E-step and M-step objects of
:mod:`~numpyro_fed.saem.estep` and :mod:`~numpyro_fed.saem.mstep`):

.. math::

    z_{k+1} \\sim \\Pi^{m}_{\\theta_k}(z_k, \\cdot), \\qquad
    s_{k+1} = s_k + \\gamma_{k+1}\\,(S(z_{k+1}) - s_k), \\qquad
    \\theta_{k+1} = \\hat\\theta(s_{k+1})

(Gruffaz et al. 2024, Sec. 2.2, eq. (2)). Burn-in, the iterations and the draws at the
final :math:`\\theta` are one :func:`jax.lax.scan` over phases (one E-step body serves the
three). The compiled programs take the data, the initial :math:`\\theta` and the key as
arguments. Every :meth:`SAEM.run` analyses the model and traces its programs afresh (what
the model reads -- a module global, a closure, a mutable object -- is read now); the
compiled executables are found by program content (:mod:`numpyro_fed._programs`), so a
second run on new data of the same shapes -- a bootstrap, a covariate search, another
seed -- compiles nothing, and a run whose programs changed never gets the old ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_median
from numpyro.infer.mcmc import MCMCKernel

from numpyro_fed._validation import check_float, check_int, check_positive_float
from numpyro_fed.errors import DivergenceError
from numpyro_fed.saem.estep import LangevinEStep, NumPyroEStep, flat_preconditioner
from numpyro_fed.saem.model import (
    ModelInfo,
    centred_score_hess,
    centring_design,
    jit_loop,
    jit_once,
    joint_layout,
    merge_data,
    split_data,
    static_as_numpy,
    subject_layout,
)
from numpyro_fed.saem.mstep import (
    GaussianMStep,
    NewtonMStep,
    SufficientStatistics,
    UserMStep,
    detect_gaussian,
)
from numpyro_fed.saem.result import SAEMResult, boundary_advice, boundary_collapse, run_off
from numpyro_fed.saem.schedule import MAX_ITERATIONS, Schedule

__all__ = ["SAEM", "SAEMState", "fit_saem"]

#: chains x subjects aimed at by the default number of chains
MIN_CHAIN_SUBJECTS = 50


class SAEMState(NamedTuple):
    """Carry of the compiled SAEM loop.

    - **k** -- iteration counter.
    - **theta** -- flat unconstrained :math:`\\theta_k`.
    - **estate** -- state of the E-step (its ``z`` holds the latents of every chain).
    - **mstate** -- state of the M-step (SA statistics, Newton's averages).
    - **rng_key** -- random key.
    - **bad_iter** -- first iteration with a non-finite E-step (-1: none; -2: burn-in).
    - **bad_theta** -- :math:`\\theta` (unconstrained) at that iteration.
    - **bad_mstep** -- whether it was the M-step (a non-finite :math:`\\theta` from finite
      latents) rather than the E-step.
    """

    k: jax.Array
    theta: jax.Array
    estate: Any
    mstate: Any
    rng_key: jax.Array
    bad_iter: jax.Array
    bad_theta: jax.Array
    bad_mstep: jax.Array


# phases of the compiled program
_BURN, _ITER, _DRAW, _PAD = 0, 1, 2, 3


def fit_saem(estep, mstep, latents: Callable, score_hess: Callable | None):
    """The pure SAEM program: ``step(carry, x, data, aux, ids)`` for :func:`jax.lax.scan`.

    ``x = (phase, gamma, num_steps, adapt, anneal, draw_index)``;
    ``carry = (state, zbuf, accept_sum)``; ``zbuf`` collects the latents of the draws phase;
    ``aux = (M-step constants, M)`` with ``M`` the centring design
    (:func:`~numpyro_fed.saem.model.centring_design`): after each update of
    :math:`\\theta` the chains move by :math:`-M\\,\\Delta\\theta`.

    ``score_hess(theta, z, data, M) -> (g (C, k), H (C, k, k))``: per chain the
    complete-data score and Hessian (centred: along :math:`z - M(\\theta' - \\theta)`) in
    the ``k`` coordinates the M-step reads (its ``score_idx``; all ``d`` by default), for the
    Newton M-step (``None`` when the M-step needs none). The Louis information is
    computed after the fit, from the draws at the final :math:`\\theta`
    (:meth:`~numpyro_fed.saem.SAEMResult.fisher_information`).
    """

    def step(carry, x, data, aux, ids):
        aux, M = aux
        state, zbuf, dacc = carry
        ph, gamma, n, adapt, anneal, j = x
        key, k_e = random.split(state.rng_key)
        es, acc, finite = estep.step(k_e, state.estate, state.theta, data, n, adapt, ids)
        z = latents(es)
        theta = state.theta
        dt = theta.dtype

        def b_burn(_):
            mst = mstep.init(theta, z, data, aux)
            bad = jnp.where(finite, state.bad_iter, -2).astype(jnp.int32)
            return state._replace(estate=es, mstate=mst, rng_key=key, bad_iter=bad), zbuf, dacc

        def b_iter(_):
            g = jnp.asarray(gamma, dt)
            sh = score_hess(theta, z, data, M) if score_hess is not None else None
            mean_sh = None if sh is None else (jnp.mean(sh[0], 0), jnp.mean(sh[1], 0))
            theta_new, mst = mstep.update(state.mstate, g, theta, z, data, aux, anneal,
                                          mean_sh)
            ok = finite & jnp.all(jnp.isfinite(theta_new))
            already = state.bad_iter != -1
            new = SAEMState(state.k + 1, theta_new, es, mst, key, state.bad_iter,
                            state.bad_theta, state.bad_mstep)
            keep = already | ~ok
            out = jax.tree.map(lambda a, b: jnp.where(keep, a, b), state, new)
            # the chains move with theta: by the M-step's transport (interweaving), else in
            # the centred coordinates (z - M dtheta; see centring_design)
            transport = getattr(mstep, "transport", None)
            if transport is None:
                def move(zf):
                    return zf - M @ (out.theta - theta)
            else:
                def move(zf):
                    return transport(out.mstate, zf, theta, out.theta, aux)
            out = out._replace(estate=estep.move(out.estate, move))
            flag = ~already & ~ok
            return out._replace(
                rng_key=key, bad_iter=jnp.where(flag, state.k, state.bad_iter),
                bad_theta=jnp.where(flag, theta, state.bad_theta),
                bad_mstep=jnp.where(flag, finite, state.bad_mstep)), zbuf, dacc

        def b_draw(_):
            st = state._replace(estate=es, rng_key=key)
            return st, zbuf.at[j].set(z), dacc + acc

        def b_pad(_):
            return state, zbuf, dacc

        out = lax.switch(ph, [b_burn, b_iter, b_draw, b_pad], None)
        return out, (out[0].theta, acc)

    return step


class _Structure:
    """Everything SAEM builds from the model and the structure of its data, with its
    programs; built by every run (the compiled executables are cached by content)."""


class SAEM:
    """MCMC-SAEM for maximum marginal likelihood of the ``param`` sites of a NumPyro model.

    With no settings, ``SAEM(model).run(key, **data)`` is meant to reach the maximum of the
    marginal likelihood of a mixed-effects model on its natural scale: the E-step is
    per-subject MALA with step sizes and preconditioners adapted during the exploration phase
    plus 2 independence proposals from :math:`p(z\\mid\\theta)` per iteration (saemix's
    kernels), ``max(2, ceil(50 / subjects))`` chains, saemix's schedule (300 exploration iterations
    with simulated annealing of the variances, then 200 at :math:`\\gamma_k = k^{-2/3}`), the
    closed-form Gaussian M-step where it applies (SA-Newton elsewhere), and a convergence
    check at the end.

    :param model: a NumPyro model; ``numpyro.param`` sites are :math:`\\theta` (their
        ``constraint`` is respected), latent ``sample`` sites are :math:`z`.
    :param kernel: ``"mala"`` (default) or ``"ula"`` (built-in, pure JAX), a NumPyro
        :class:`~numpyro.infer.mcmc.MCMCKernel` instance that implements ``wrap_model`` and
        ``refresh`` (e.g. ``NUTS(model)``), or a factory ``f(conditioned_model) ->
        MCMCKernel``.
    :param step_size: fixed Langevin step size :math:`\\eta` of the built-in kernels (no
        adaptation; with ``preconditioner``: the E-step of Gruffaz et al. 2024). ``None``
        (default): adaptive per-subject step sizes and preconditioners.
    :param num_mcmc_steps: Langevin steps per SAEM iteration (``m``, default 4 as in
        Gruffaz et al. 2024).
    :param num_chains: chains of :math:`z`; statistics are averaged over chains. Default:
        ``max(2, ceil(50 / number of subjects))`` (2 without a subject plate): chains x
        subjects >= 50 as in saemix, and at least two chains, which halves the Monte Carlo
        variance of the statistics of a model with many subjects at twice the E-step cost.
    :param schedule: a :class:`Schedule` (default: saemix's, see :class:`Schedule`).
    :param mstep: ``"auto"`` (closed-form Gaussian where recognised, SA-Newton for the other
        parameters), ``"gaussian"`` (the same, but an error if nothing is recognised),
        ``"newton"``, or a :class:`SufficientStatistics`.
    :param preconditioner: ``P(theta) -> dict`` of fixed diagonal preconditioners per latent
        site (with a fixed ``step_size``; Gruffaz et al. 2024, Sec. 5.4).
    :param fisher: offer standard errors (the Louis information from the draws at the final
        :math:`\\theta`, see :meth:`SAEMResult.fisher_information`); default: when
        :math:`\\dim\\theta \\le 50`.
    :param annealed: names of ``param`` sites annealed by the Newton/user M-steps (default:
        the positive ones; the Gaussian M-step anneals its variances).
    :param subject_plate: the plate of independent subjects (auto-detected: the plate holding
        every latent site).
    :param mh_blocks: ``"auto"``/``"subject"`` (one Metropolis test per subject) or
        ``"joint"`` (one test for the whole latent vector, the MALA of Gruffaz et al. 2024).
    :param prior_proposals: independence MH moves from :math:`p(z\\mid\\theta)` per E-step
        (saemix's kernel 1). Default: 2 when there are subjects, else 0.
    :param newton_damping: damping :math:`\\delta` of the Newton M-step.
    :param newton_max_step: per-coordinate clip of a Newton step, relative: coordinate
        :math:`j` moves by at most ``newton_max_step * max(1, |theta_j|)`` (unconstrained).
    :param num_draws: draws per chain of :math:`z` kept at the final :math:`\\theta`.
    :param init_strategy: NumPyro initialisation strategy of the latents at :math:`\\theta_0`.
    :param init_jitter: standard deviation of the jitter of chains > 0 (unconstrained space).
    :param target_accept: target acceptance rate of the adaptive MALA.
    :param centring: with the built-in E-steps, work in the centred coordinates of
        zero-mean random effects whose fixed effects sit in the likelihood (see
        :func:`~numpyro_fed.saem.model.centring_design`); the estimates are the same, the
        convergence much faster. ``False``: the model's own coordinates.
    :param interweave: with the Gaussian M-step, follow its closed-form (centred) cycle by an
        SA-Newton cycle in the non-centred parametrisation of the diagonal Gaussian sites
        (:math:`z = \\mu(\\theta) + \\omega(\\theta)\\eta`, :math:`\\eta` held fixed; the
        locations, scales and Newton parameters jointly; the chains move with it): an AECM
        iteration that interweaves the two augmentations (Yu & Meng 2011), fast where the
        centred one alone moves at EM's slow rate -- a random-effect variance that is small
        against what the data say of each subject. The estimates are the same maximum.
        ``False``: the centred cycles only.
    """

    def __init__(
        self,
        model: Callable,
        *,
        kernel: str | MCMCKernel | Callable = "mala",
        step_size: float | None = None,
        num_mcmc_steps: int = 4,
        num_chains: int | None = None,
        schedule: Schedule | None = None,
        mstep: str | SufficientStatistics = "auto",
        preconditioner: Callable | None = None,
        fisher: bool | None = None,
        annealed: Sequence[str] | None = None,
        subject_plate: str | None = None,
        mh_blocks: str = "auto",
        prior_proposals: int | None = None,
        newton_damping: float = 1.0,
        newton_max_step: float = 1.0,
        num_draws: int = 200,
        init_strategy: Callable = init_to_median,
        init_jitter: float = 0.1,
        target_accept: float = 0.574,
        centring: bool = True,
        interweave: bool = True,
    ) -> None:
        self.model = model
        self.centring = bool(centring)
        self.interweave = bool(interweave)
        if isinstance(kernel, str):
            if kernel.lower() not in ("ula", "mala"):
                raise ValueError(f"kernel={kernel!r}: use 'mala', 'ula' or an MCMCKernel.")
            kernel = kernel.lower()
        elif not (isinstance(kernel, MCMCKernel) or callable(kernel)):
            raise TypeError("`kernel` must be 'mala', 'ula', an MCMCKernel or a factory.")
        self.kernel = kernel
        self.step_size = check_positive_float("step_size", step_size, allow_none=True)
        self.num_mcmc_steps = check_int("num_mcmc_steps", num_mcmc_steps, minimum=1)
        self._num_chains = check_int("num_chains", num_chains, minimum=1, allow_none=True)
        self.num_draws = check_int("num_draws", num_draws, minimum=1)
        if self.num_draws > MAX_ITERATIONS:
            # kept draws are a (num_draws, chains, latents) buffer of the compiled loop
            raise ValueError(
                f"num_draws={self.num_draws}: more than {MAX_ITERATIONS:,} draws per chain "
                "(each a copy of every latent variable, kept in memory); the default 200 "
                "gives standard errors and the likelihood's proposals."
            )
        self.init_strategy = init_strategy
        self.init_jitter = check_float("init_jitter", init_jitter, low=0.0)
        self.schedule = Schedule() if schedule is None else schedule
        if not isinstance(self.schedule, Schedule):
            raise TypeError("`schedule` must be a numpyro_fed.saem.Schedule.")
        self.gammas = self.schedule.gamma_sequence()
        if not (isinstance(mstep, SufficientStatistics) or mstep in ("auto", "gaussian", "newton")):
            raise ValueError(
                f"mstep={mstep!r}: use 'auto', 'gaussian', 'newton' or SufficientStatistics."
            )
        self.mstep_spec = mstep
        if preconditioner is not None and step_size is None:
            raise ValueError(
                "`preconditioner` is a fixed preconditioner for a fixed `step_size`; give "
                "step_size= too, or leave both out for the adaptive E-step."
            )
        self.preconditioner = preconditioner
        self.fisher = fisher
        self.annealed = annealed
        self.subject_plate = subject_plate
        if mh_blocks not in ("auto", "subject", "joint"):
            raise ValueError(f"mh_blocks={mh_blocks!r}: use 'auto', 'subject' or 'joint'.")
        self.mh_blocks = mh_blocks
        prior_proposals = check_int("prior_proposals", prior_proposals, minimum=0,
                                    allow_none=True)
        if prior_proposals and not isinstance(kernel, str):
            raise ValueError("`prior_proposals` applies to the built-in 'ula'/'mala' E-steps.")
        self._prior_proposals = prior_proposals
        self.newton_damping = newton_damping
        self.newton_max_step = newton_max_step
        if not 0.0 < target_accept < 1.0:
            raise ValueError(f"`target_accept` must lie in (0, 1), got {target_accept!r}.")
        self.target_accept = float(target_accept)
        self.structure: _Structure | None = None

    @property
    def num_chains(self) -> int:
        """Chains used (known after the model is analysed)."""
        if self.structure is not None:
            return self.structure.num_chains
        return self._num_chains or 1

    # ------------------------------------------------------------------ structure
    def _build_structure(self, rng_key, args, kwargs, init_params=None) -> _Structure:
        st = _Structure()
        info = ModelInfo(self.model, args, kwargs, rng_key)
        if init_params is not None:  # before anything is compiled
            info.check_init_params(init_params)
        st.info = info
        # the arrays the model reads concretely, as NumPy arrays from here on: every program
        # that closes over the data sees concrete values (JAX stages operations on a
        # closed-over jax.Array)
        args, kwargs = static_as_numpy(args, kwargs, info.static_data)
        st.data = (args, kwargs)
        builtin = isinstance(self.kernel, str)
        layout, reason = (None, "mh_blocks='joint'")
        if self.mh_blocks != "joint" and builtin:
            layout, reason = subject_layout(info, self.subject_plate, args, kwargs,
                                            random.fold_in(rng_key, 3))
            if layout is None and self.mh_blocks == "subject":
                raise ValueError(
                    f"mh_blocks='subject': the model has no subject structure ({reason}); use "
                    "mh_blocks='joint'."
                )
        st.layout_reason = reason
        st.layout = layout if layout is not None else joint_layout(info)
        st.has_subjects = layout is not None
        n_sub = st.layout.n if st.has_subjects else 1
        st.num_chains = (self._num_chains if self._num_chains is not None
                         else (max(2, math.ceil(MIN_CHAIN_SUBJECTS / n_sub))
                               if st.has_subjects else 2))
        if self._prior_proposals is not None:
            n_prior = self._prior_proposals
        else:
            n_prior = 2 if (builtin and st.has_subjects) else 0
        st.prior_proposals = n_prior
        # M-step
        schedule = self.schedule
        tau = schedule.anneal_factor
        ann_mask = None
        if self.annealed is not None:
            unknown = set(self.annealed) - set(info.param_names)
            if unknown:
                raise ValueError(f"`annealed` names unknown param sites {sorted(unknown)}.")
            ann_mask = np.zeros(info.dim_theta_c, bool)
            for i, n in enumerate(info.param_names):
                if n in self.annealed:
                    ann_mask[info.param_offsets[i]:info.param_offsets[i + 1]] = True
        reason = ""
        if isinstance(self.mstep_spec, SufficientStatistics):
            mstep = UserMStep(info, self.mstep_spec, tau, ann_mask)
        elif self.mstep_spec == "newton":
            mstep = NewtonMStep(info, self.newton_damping, self.newton_max_step,
                                anneal_factor=tau, annealed=ann_mask)
        else:
            spec, reason = detect_gaussian(info, args, kwargs, random.fold_in(rng_key, 7))
            if spec is not None:
                mstep = GaussianMStep(info, spec, damping=self.newton_damping,
                                      max_step=self.newton_max_step, anneal_factor=tau,
                                      interweave=self.interweave)
            elif self.mstep_spec == "gaussian":
                raise ValueError(
                    f"mstep='gaussian': the model is not of the recognised Gaussian family "
                    f"({reason}). Use mstep='newton' or give SufficientStatistics."
                )
            else:
                mstep = NewtonMStep(info, self.newton_damping, self.newton_max_step,
                                    anneal_factor=tau, annealed=ann_mask)
        st.mstep, st.mstep_reason = mstep, reason
        st.use_fisher = bool(self.fisher if self.fisher is not None else info.dim_theta <= 50)
        # E-step
        if builtin:
            estep = LangevinEStep(
                info, st.layout, mala=self.kernel == "mala", step_size=self.step_size,
                preconditioner=flat_preconditioner(info, self.preconditioner),
                prior_proposals=n_prior, target_accept=self.target_accept)
            st.latents = lambda es: es.z
        else:
            estep = NumPyroEStep(info, self.model, self.kernel, kwargs, bool(args))
            st.latents = lambda es: es[0]
        st.estep = estep
        st.builtin = builtin
        need_sh = bool(getattr(mstep, "needs_score", False))

        # the coordinates whose score and Hessian the M-step reads (the SA-Newton ones of the
        # Gaussian M-step; every one for the plain Newton M-step): a Hessian in those only
        score_idx = getattr(mstep, "score_idx", None)

        def score_hess(theta_u, z, data, M):
            return centred_score_hess(info, theta_u, z, data[0], data[1], M, idx=score_idx)

        st.step = fit_saem(estep, mstep, st.latents, score_hess if need_sh else None)
        st.programs = {}
        st.first_run = True
        return st

    def _structure_for(self, rng_key, args, kwargs, init_params=None):
        """The structure of this run, built afresh: no cache keyed on the model object or a
        list of settings can see what the model reads (its programs are compiled once per
        content, :func:`~numpyro_fed.saem.model.jit_once`)."""
        st = self._build_structure(rng_key, args, kwargs, init_params)
        # the arrays the model reads concretely are static (constants of the programs)
        args, kwargs = st.data
        arrays, static = split_data(args, kwargs, st.info.static_data)
        self.structure = st
        return st, arrays, static, args, kwargs

    # ------------------------------------------------------------------ programs
    def _init_program(self, st: _Structure, static):
        if "init" in st.programs:
            return st.programs["init"]
        info, estep, mstep = st.info, st.estep, st.mstep
        C = st.num_chains
        strat, jitter = self.init_strategy, self.init_jitter
        model = self.model

        lay = st.layout
        centre = st.builtin and st.has_subjects and self.centring

        def init(theta0, arrays, key, ids, log_step0):
            args, kwargs = merge_data(arrays, static)
            data = (args, kwargs)
            theta_c = info.constrain_theta(theta0)
            k_z, k_e, k_run = random.split(key, 3)

            def z_one(k):
                k1, k2 = random.split(k)
                m = substitute(seed(substitute(model, data=theta_c), k1), substitute_fn=strat)
                tr = trace(m).get_trace(*args, **kwargs)
                zu = info.unconstrain_z({n: tr[n]["value"] for n in info.latent_names})
                return zu, jitter * random.normal(k2, zu.shape, zu.dtype)

            zs, noise = jax.vmap(z_one)(random.split(k_z, C))
            z0 = zs.at[1:].add(noise[1:])
            # per-site finiteness at the initial point (a clear error if not)
            per_site = _site_finite(info, theta_c, z0[0], args, kwargs)
            M = (centring_design(info, lay, theta0, z0[0], args, kwargs,
                                 random.fold_in(key, 11), ids=ids) if centre
                 else jnp.zeros((z0.shape[1], theta0.shape[0]), z0.dtype))
            aux = (mstep.prepare(theta0, z0, data, M), M)
            es = (estep.init(k_e, z0, theta0, data, None, log_step=log_step0) if st.builtin
                  else None)
            mshape = jax.eval_shape(lambda t, z: mstep.init(t, z, data, aux[0]), theta0, z0)
            mst = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), mshape)
            state = SAEMState(jnp.zeros((), jnp.int32), theta0, es, mst, k_run,
                              jnp.full((), -1, jnp.int32), theta0, jnp.zeros((), bool))
            return state, z0, aux, per_site

        prog = jit_once(init) if st.builtin else init
        st.programs["init"] = prog
        return prog

    def _chunk_program(self, st: _Structure, static):
        if "chunk" in st.programs:
            return st.programs["chunk"]
        step = st.step

        def chunk(carry, xs, arrays, aux, ids):
            data = merge_data(arrays, static)
            return lax.scan(lambda c, x: step(c, x, data, aux, ids), carry, xs)

        prog = jit_loop(chunk)
        st.programs["chunk"] = prog
        return prog

    def _schedule_xs(self, st: _Structure):
        sch = self.schedule
        K, T, m, B = len(self.gammas), self.num_draws, self.num_mcmc_steps, sch.num_burnin
        n_expl = sch.num_exploration if sch.num_exploration > 0 else K // 2
        n_ann = sch.annealing_iters
        phase = np.concatenate([np.full(B, _BURN), np.full(K, _ITER), np.full(T, _DRAW)])
        if B == 0:  # the M-step statistics are initialised by a burn-in step of 0 moves
            phase = np.concatenate([[_BURN], np.full(K, _ITER), np.full(T, _DRAW)])
            B1 = 1
        else:
            B1 = B
        gam = np.concatenate([np.ones(B1), self.gammas, np.ones(T)])
        nst = np.concatenate([np.full(B1, m if B else 0), np.full(K, m), np.ones(T)])
        kk = np.arange(K)
        adapt = np.concatenate([np.ones(B1, bool), kk < n_expl, np.zeros(T, bool)])
        anneal = np.concatenate([np.zeros(B1, bool), kk < n_ann, np.zeros(T, bool)])
        jdraw = np.concatenate([np.zeros(B1 + K), np.arange(T)])
        return (phase.astype(np.int32), gam, nst.astype(np.int32), adapt, anneal,
                jdraw.astype(np.int32)), B1, K, T

    # ------------------------------------------------------------------ run
    def run(
        self,
        rng_key: jax.Array,
        *model_args: Any,
        init_params: dict | None = None,
        progress_bar: bool = False,
        num_chunks: int = 20,
        **model_kwargs: Any,
    ):
        """Fit :math:`\\theta` by MCMC-SAEM.

        :param rng_key: a JAX random key.
        :param model_args: positional arguments of the model (data).
        :param init_params: optional dict of constrained initial values of ``param`` sites
            (default: their ``init_value`` in the model); each is checked against the site's
            constraint.
        :param progress_bar: run the compiled loop in ``num_chunks`` equal chunks with a
            ``tqdm`` progress bar.
        :param model_kwargs: keyword arguments of the model (data).
        :return: a :class:`~numpyro_fed.saem.SAEMResult`.

        The model may compute shapes and control flow from its data, as NumPyro's MCMC
        allows (``numpyro.plate("subject", int(subj.max()) + 1)``, ``len(np.unique(x))``,
        ``np.bincount``, ``if np.any(...)``): the data arguments it reads concretely are
        found by tracing it abstractly (:func:`~numpyro_fed.saem.model.find_static_data`)
        and are constants of the compiled programs (compiled once per value); the others
        are traced (compiled once per shape). ``result.settings["static_data"]`` lists them.
        :raises ValueError: the model reads a param or latent value in Python (named, with
            the file and line).
        """
        if not (isinstance(rng_key, jax.Array) and (
                jnp.issubdtype(rng_key.dtype, jax.dtypes.prng_key)
                or (rng_key.dtype == jnp.uint32 and rng_key.shape == (2,)))):
            raise TypeError(
                f"SAEM.run: `rng_key` must be a JAX random key (jax.random.key(0)), got "
                f"{type(rng_key).__name__} {rng_key!r}."
            )
        args, kwargs = model_args, model_kwargs
        st, arrays, static, args, kwargs = self._structure_for(rng_key, args, kwargs,
                                                               init_params)
        info = st.info
        if init_params is not None:
            tc = info.check_init_params(init_params)
            theta0 = info.unconstrain_theta(tc)
        else:
            theta0 = info.theta0_u_flat
        # a strongly typed theta: the carry keeps one type, the program compiles once
        theta0 = jnp.asarray(theta0, dtype=jnp.result_type(theta0.dtype))
        ids = self._ids(st, arrays, rng_key)
        init = self._init_program(st, static)
        log_step0 = jnp.asarray(math.log(self.step_size) if self.step_size else 0.0,
                                theta0.dtype)
        state, z0, aux, per_site = init(theta0, arrays, random.fold_in(rng_key, 1), ids,
                                        log_step0)
        if not bool(np.all(np.asarray(per_site))):
            info.check_finite_at(info.constrain_theta(theta0), z0[0], args, kwargs)
        if not st.builtin:
            es = st.estep.init(random.fold_in(rng_key, 2), z0, theta0, (args, kwargs))
            state = state._replace(estate=es)
        xs, B1, K, T = self._schedule_xs(st)
        dt = theta0.dtype
        carry = (state, jnp.zeros((T,) + z0.shape, z0.dtype), jnp.zeros((), dt))
        total = len(xs[0])
        if st.builtin:
            chunk = self._chunk_program(st, static)
            compiled = []  # traced once per run (the chunks have one shape), then called

            def call(c, x):
                if not compiled:
                    compiled.append(chunk.compiled(c, x, arrays, aux, ids))
                return compiled[0](c, x, arrays, aux, ids)
        else:
            data = (args, kwargs)
            call = jax.jit(lambda c, x: lax.scan(
                lambda cc, xx: st.step(cc, xx, data, aux, ids), c, x))
        nc = max(1, min(int(num_chunks), total)) if progress_bar else 1
        L = -(-total // nc)
        pad = nc * L - total
        xs = (np.concatenate([xs[0], np.full(pad, _PAD, np.int32)]),
              np.concatenate([xs[1], np.ones(pad)]).astype(np.dtype(dt)),
              np.concatenate([xs[2], np.zeros(pad, np.int32)]),
              np.concatenate([xs[3], np.zeros(pad, bool)]),
              np.concatenate([xs[4], np.zeros(pad, bool)]),
              np.concatenate([xs[5], np.zeros(pad, np.int32)]))
        thetas, accs = [], []
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="SAEM")
        try:
            for c in range(nc):
                carry, (th, ac) = call(carry, tuple(v[c * L:(c + 1) * L] for v in xs))
                thetas.append(th)
                accs.append(ac)
                if bar is not None:
                    bar.update(min(L, total - c * L))
                    if int(carry[0].bad_iter) != -1:
                        break
        finally:
            if bar is not None:
                bar.close()
        thetas = np.concatenate([np.asarray(t) for t in thetas])
        accs = np.concatenate([np.asarray(a) for a in accs])
        state, zs, dacc = carry
        bad = int(state.bad_iter)
        if bad != -1:
            # the updates before the failure (a failed iteration keeps the last finite theta)
            traj = thetas[B1:B1 + max(bad, 0)]
            raise self._divergence_error(st, state, theta0, bad, args, kwargs, traj)
        res = SAEMResult(
            model=self.model, info=info, layout=st.layout if st.has_subjects else None,
            ids=ids, theta=np.asarray(state.theta),
            thetas_u=thetas[B1:B1 + K], gammas=self.gammas, accs=accs[B1:B1 + K],
            zs=np.asarray(zs), accept_final=float(dacc) / max(T, 1),
            centring=np.asarray(aux[1]) if st.use_fisher else None,
            mstep=st.mstep.kind, args=args, kwargs=kwargs,
            num_exploration=self.schedule.num_exploration, settings=self._describe(st),
            programs=st.programs.setdefault("result", {}), theta0=np.asarray(theta0),
        )
        res.convergence_messages = res.check_convergence(warn=True)
        return res

    fit = run

    def _ids(self, st, arrays, key):
        """Subject of every site element; found again for each dataset in long format (the
        subject index is data) by the structure's compiled detection program."""
        if not st.has_subjects:
            return None
        lay = st.layout
        ids = {k: jnp.asarray(v) for k, v in lay.site_ids}
        if lay.ids_program is not None and not st.first_run:
            new, err = lay.ids_program(arrays, random.fold_in(key, 3))
            if err:
                raise ValueError(f"SAEM: the data do not factorise over subjects: {err}.")
            ids.update({k: jnp.asarray(v) for k, v in new.items()})
        st.first_run = False
        return ids

    def _divergence_error(self, st: _Structure, state: SAEMState, theta0, bad: int, args,
                          kwargs, traj=None) -> DivergenceError:
        """The error for a non-finite E-step (host side, after the run): it quotes the
        E-step kernel's own step size and, when the log-density of a site is already
        non-finite at that theta for the latents the E-step started from, names the site.
        When a parameter was heading to the boundary of its support (a variance collapsing
        to 0, see :func:`~numpyro_fed.saem.result.boundary_collapse`), that is the cause
        named, with its last finite value and the iteration."""
        info = st.info
        ran = ""
        if bad >= 0 and traj is not None and len(traj):
            tc = np.asarray(jax.vmap(info.theta_c_flat)(jnp.asarray(traj)))
            tc0 = np.asarray(info.theta_c_flat(jnp.asarray(theta0)))
            off = run_off(info, tc, tc0)
            if off:
                ran = (" Before that, " + ", ".join(
                    f"'{o['name']}' ran from {o['start']:.4g} (theta_0) to {o['value']:.4g}"
                    for o in off) + f" in {len(tc)} iteration{'s' if len(tc) > 1 else ''}: "
                    "the data do not determine "
                    + ("it" if len(off) == 1 else "them") + " (a degenerate data set -- every "
                    "observation equal or 0 -- or more random effects than the data show); "
                    "check the data and simplify the model, or fix "
                    + ("it" if len(off) == 1 else "them") + ".")
            b = boundary_collapse(info, tc, tc0)
            if b is not None:
                what = "M-step" if bool(state.bad_mstep) else "E-step"
                return DivergenceError(
                    f"SAEM: '{b['name']}' collapsed to its boundary {b['bound']:g}: its last "
                    f"finite value was {b['value']:.3g} at iteration {b['iteration']} (down "
                    f"from {b['reference']:.3g}), and the {what} became non-finite at "
                    f"iteration {bad + 1} (theta={_format_theta(info, state.bad_theta)}). The "
                    f"constraint of '{b['name']}' is respected; "
                    + boundary_advice(b) + "."
                )
        summary = st.estep.step_size_summary(state.estate)
        if not st.builtin:
            name = type(st.estep.kernel).__name__
            fix = (f"reduce the step size of the E-step kernel {name} (the `kernel` you "
                   "passed; SAEM's own `step_size` does not apply to it)")
        elif self.step_size is not None:
            fix = ("reduce `step_size`, or leave step_size=None for the adaptive E-step "
                   "(SAEM's default)")
        else:
            fix = ("the adaptive E-step rejects non-finite proposals, so the model's "
                   "log-density itself became non-finite: check the model at these values")
        if bad == -2:
            return DivergenceError(
                f"SAEM: the E-step kernel diverged during burn-in at theta_0="
                f"{_format_theta(info, theta0)} (E-step: {summary}); {fix}; or give initial "
                "values closer to the data (`init_params`)."
            )
        theta = _format_theta(info, state.bad_theta)
        sites = info.nonfinite_sites(info.constrain_theta(jnp.asarray(state.bad_theta)),
                                     st.latents(state.estate), args, kwargs)
        if sites:
            names = ", ".join(f"'{n}'" for n in sites)
            return DivergenceError(
                f"SAEM: the E-step became non-finite at iteration {bad} with theta={theta} "
                f"(E-step: {summary}): at this theta the log-density of "
                f"site{'s' if len(sites) > 1 else ''} {names} is not "
                "finite for the current latents, so the M-step moved a param where the model "
                "is not defined."
                + (ran if ran else
                   " Declare each param's constraint (e.g. "
                   "`constraint=constraints.positive` for a scale or a variance) or give "
                   "`init_params` closer to the data"
                   + ("." if st.builtin and self.step_size is None else
                      f"; if theta ran off because the E-step diverged first, {fix}."))
            )
        if bool(state.bad_mstep):  # the model is finite there: the M-step itself
            what = ("your SufficientStatistics maximizer"
                    if st.mstep.kind == "sufficient-statistics"
                    else f"the {st.mstep.kind} M-step")
            return DivergenceError(
                f"SAEM: the M-step gave a non-finite theta at iteration {bad}, from "
                f"theta={theta} and finite latents (E-step: {summary}): {what} is not "
                "defined at these statistics. Check it (a variance from a negative difference, "
                "a division by a zero count), declare each param's constraint, or give "
                "`init_params` closer to the data." + ran
            )
        return DivergenceError(
            f"SAEM: the E-step became non-finite at iteration {bad} with theta={theta} "
            f"(E-step: {summary}); {fix}." + ran
        )

    def _describe(self, st: _Structure) -> dict:
        spec = getattr(st.mstep, "spec", None)
        return {
            "kernel": self.kernel if isinstance(self.kernel, str) else type(self.kernel).__name__,
            "num_chains": st.num_chains, "prior_proposals": st.prior_proposals,
            "subjects": st.layout.n if st.has_subjects else None,
            "subject_plate": st.layout.plate if st.has_subjects else None,
            "mstep": st.mstep.kind, "mstep_reason": st.mstep_reason,
            "adaptive": self.step_size is None and st.builtin,
            "num_iters": len(self.gammas), "num_exploration": self.schedule.num_exploration,
            "use_fisher": st.use_fisher,
            "centring": bool(st.builtin and st.has_subjects and self.centring),
            "interweave": bool(getattr(st.mstep, "interweave", False)),
            # the data arguments the model reads concretely (static: compiled per value)
            "static_data": list(st.info.static_data),
            # the scales of Gaussian sites (standard deviations of random effects and
            # residuals: flat constrained indices) and the covariance parameters of
            # MultivariateNormal sites, for the variance scale of the parameter table
            "variance_coords": sorted(int(i) for i in np.concatenate(
                [spec.scale_lat_idx, spec.scale_obs_idx])) if spec is not None else [],
            "mvn_covariances": [(n, r, list(ps)) for n, r, ps in spec.mvn_sites]
            if spec is not None else [],
        }


def _site_finite(info: ModelInfo, theta_c, zf, args, kwargs):
    zc, _ = info.constrain_z(zf)
    lps = info.site_log_probs({**theta_c, **zc}, args, kwargs)
    return jnp.stack([jnp.isfinite(jnp.sum(v)) for v in lps.values()])


def _format_theta(info: ModelInfo, theta_u) -> str:
    tc = info.constrain_theta(jnp.asarray(theta_u))
    return "{" + ", ".join(
        f"{n}: {np.array2string(np.asarray(v), precision=4)}" for n, v in tc.items()
    ) + "}"
