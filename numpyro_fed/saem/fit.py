"""MCMC-SAEM: the :class:`SAEM` front end and the pure fit loop.

The loop (Dynamax ``fit_em`` style, over an E-step and an M-step: implementations of the
:class:`~numpyro_fed.saem.protocols.EStep` and :class:`~numpyro_fed.saem.protocols.MStep`
protocols, e.g. those of :mod:`~numpyro_fed.saem.estep` and :mod:`~numpyro_fed.saem.mstep`):

.. math::

    z_{k+1} \\sim \\Pi^{m}_{\\theta_k}(z_k, \\cdot), \\qquad
    s_{k+1} = s_k + \\gamma_{k+1}\\,(S(z_{k+1}) - s_k), \\qquad
    \\theta_{k+1} = \\hat\\theta(s_{k+1})

(Gruffaz et al. 2024, Sec. 2.2, eq. (2)). Burn-in, the iterations and the draws at the
final :math:`\\theta` are one :func:`jax.lax.scan` over phases (one E-step body serves the
three). The compiled programs take the data, the initial :math:`\\theta` and the key as
arguments. Every :meth:`SAEM.run` analyses the model and traces its programs afresh (what
the model reads -- a module global, a closure, a mutable object -- is read now) into a
frozen :class:`SAEMProgram`; the compiled executables are found by program content
(:mod:`numpyro_fed._programs`), so a second run on new data of the same shapes -- a
bootstrap, a covariate search, another seed -- compiles nothing, and a run whose programs
changed never gets the old ones.

A failure inside the compiled loop is carried out of it as data (a :class:`Failure` code,
the iteration and :math:`\\theta` in :class:`SAEMState`), decoded on the host into a
:class:`SAEMFailure` and raised as a :class:`~numpyro_fed.errors.DivergenceError` naming
the cause.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import lax, random
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_median
from numpyro.infer.mcmc import MCMCKernel

from numpyro_fed import _programs
from numpyro_fed._validation import check_float, check_int, check_positive_float
from numpyro_fed.errors import DivergenceError
from numpyro_fed.saem import memo
from numpyro_fed.saem.estep import LangevinEStep, NumPyroEStep, flat_preconditioner
from numpyro_fed.saem.model import (
    ModelInfo,
    SubjectLayout,
    centred_score_hess,
    centring_design,
    jit_loop,
    jit_once,
    joint_layout,
    merge_data,
    split_data,
    static_as_numpy,
    subject_layout,
    units_per_block,
)
from numpyro_fed.saem.mstep import (
    PROBE_SEED,
    GaussianMStep,
    NewtonMStep,
    SufficientStatistics,
    UserMStep,
    detect_gaussian,
)
from numpyro_fed.saem.protocols import EStep, MStep, check_estep, check_mstep
from numpyro_fed.saem.result import (
    SAEMResult,
    boundary_advice,
    boundary_collapse,
    run_off,
    warm_programs,
)
from numpyro_fed.saem.schedule import MAX_ITERATIONS, Schedule

__all__ = ["SAEM", "SAEMFailure", "SAEMProgram", "SAEMState", "Failure", "fit_saem"]

#: chains x subjects aimed at by the default number of chains
#: a fit whose compiled loop still runs after this many seconds compiles the programs of
#: its standard errors meanwhile (:meth:`SAEM._warm_while_running`); a shorter loop would
#: hide little of their compilation
WARM_AFTER_S = 1.0
#: whether fits compile their standard errors' programs while the loop compiles and runs
#: (:meth:`SAEM._run_warming`); ``NUMPYRO_FED_WARM_PROGRAMS=0`` turns it off where every core
#: is busy anyway (a test suite run by one worker per core), as the warmed programs of a
#: fit whose standard errors are never asked for would only add work there
WARM_PROGRAMS = os.environ.get("NUMPYRO_FED_WARM_PROGRAMS", "1") != "0"

#: replay the programs of an earlier run with the same key, without tracing them
#: (:mod:`numpyro_fed.saem.memo`); ``NUMPYRO_FED_REPLAY_RUNS=0`` traces every run
REPLAY_RUNS = os.environ.get("NUMPYRO_FED_REPLAY_RUNS", "1") != "0"

MIN_CHAIN_SUBJECTS = 50
#: chains x top-level groups aimed at by the default, per nested level of random effects in
#: the blocks (a latent site with several units in a block,
#: :func:`~numpyro_fed.saem.model.units_per_block`: casks in batches, broods in locations,
#: occasions in subjects). How a variance splits between nested levels is weakly determined:
#: the likelihood has a flat shoulder towards a small upper-level variance, where EM moves at a
#: crawl, and the Monte Carlo noise of the exploration phase (steps of 1) walks the estimate
#: onto it. Measured on lme4's grouseticks, Poisson (1|LOCATION) + (1|BROOD), 63 locations,
#: seeds 0-5 (exact -2LL above the minimum; tau_location^2 error in SE of the exact
#: information): 2 chains (the subjects' rule) -- seed 2 at 2.14 with tau_location 0.145
#: against the MLE 0.583 and no warning, 4 seeds of 6 off target; 8 chains -- 0.010-0.127,
#: seed 3 -0.34 SE (22%) without a warning; 16 chains -- 0.005-0.061, at most 0.24 SE. With a
#: third level (the chicks' observation-level effects, 2 nested levels): 16 chains left
#: seed 2 0.36 SE off, 32 chains 0.011-0.157, at most 0.35 SE (seed 2). Simulated IOV (30
#: subjects x 2 occasions): 2 chains, seed 1 omega_CL 0.42 SE off; 17 chains, 0.001-0.022
#: above the minimum on seeds 0-3. Pastes (10 batches, 5 chains): seed 0 tau_batch^2 0.34 SE
#: off, 0.03 SE with 48.
MIN_CHAIN_NESTED_GROUPS = 1000
#: the most chains the default gives a model with nested levels (Oats: 6 blocks)
MAX_NESTED_CHAINS = 64
#: ... and at most this many latent coordinates over its chains (the kept draws are a
#: ``(num_draws, chains, latents)`` buffer: 200 x 2e5 floats = 160 MB; a few schools with
#: thousands of pupils' effects each would otherwise get 64 chains of every pupil)
MAX_NESTED_CHAIN_LATENTS = 200_000
#: chains x subjects aimed at by the default for a model with a random-effect vector of a
#: full covariance (a multivariate normal latent per subject): while the step is 1 the
#: moment formula's covariance is that of one iteration's draws, and the variance left in
#: the direction its correlation leaves least of is underestimated from few draws; the
#: next draws, from that prior, are pulled towards the line, and the conditional variance
#: drifts to 0 (the correlation to +-1). Measured on datasets::ChickWeight, weight ~ Time +
#: (Time|Chick), 50 chicks, exact correlation -0.95, seeds 0-3 (exact -2LL above the
#: minimum): 2 chains (the subjects' rule) 0.88-2.44, L[1,1] at 0.21 against 1.13, seed 2
#: without a warning; 8 chains 0.005-0.305; 16 chains 0.0004-0.044
MIN_CHAIN_FULL_COV_SUBJECTS = 800


def default_num_chains(info: ModelInfo, layout: SubjectLayout, has_subjects: bool) -> int:
    """The default number of chains: ``max(2, ceil(MIN_CHAIN_SUBJECTS / subjects))``;
    with ``L`` nested levels of random effects in the blocks (latent sites with several units
    in a block), at least ``min(MAX_NESTED_CHAINS, ceil(L * MIN_CHAIN_NESTED_GROUPS /
    groups), MAX_NESTED_CHAIN_LATENTS // latents)``; with a random-effect vector of a full
    covariance (:func:`full_covariance_sites`), at least ``min(MAX_NESTED_CHAINS,
    ceil(MIN_CHAIN_FULL_COV_SUBJECTS / subjects), MAX_NESTED_CHAIN_LATENTS // latents)``; 2
    without a subject structure."""
    if not has_subjects:
        return 2
    n = layout.n
    c = max(2, math.ceil(MIN_CHAIN_SUBJECTS / n))
    cap = MAX_NESTED_CHAIN_LATENTS // max(1, info.dim_z)
    levels = sum(u > 1 for u in units_per_block(info, layout).values())
    if n > 1 and levels:
        nested = min(MAX_NESTED_CHAINS, math.ceil(levels * MIN_CHAIN_NESTED_GROUPS / n), cap)
        c = max(c, nested)
    if n > 1 and full_covariance_sites(info):
        c = max(c, min(MAX_NESTED_CHAINS, math.ceil(MIN_CHAIN_FULL_COV_SUBJECTS / n), cap))
    return c


def full_covariance_sites(info: ModelInfo) -> list[str]:
    """The latent sites drawn from a multivariate normal of two or more coordinates (a
    random-effect vector with a full covariance), wrappers (``expand``, ``to_event``,
    masks) looked through."""
    out = []
    for n in info.latent_names:
        fn = (getattr(info, "trace0", None) or {}).get(n, {}).get("fn")
        while fn is not None and not isinstance(fn, (dist.MultivariateNormal,
                                                     dist.LowRankMultivariateNormal)):
            fn = getattr(fn, "base_dist", None)
        if fn is not None and fn.event_shape and fn.event_shape[-1] >= 2:
            out.append(n)
    return out


class Failure(enum.IntEnum):
    """What stopped a fit, as carried out of the compiled loop (:attr:`SAEMState.failure`).

    - **NONE** -- nothing: the fit ran to the end.
    - **BURN_IN** -- the E-step became non-finite during burn-in (at :math:`\\theta_0`).
    - **ESTEP** -- the E-step became non-finite at an SAEM iteration.
    - **MSTEP** -- the M-step gave a non-finite :math:`\\theta` from finite latents.
    """

    NONE = 0
    BURN_IN = 1
    ESTEP = 2
    MSTEP = 3


class SAEMFailure(NamedTuple):
    """A failed fit, decoded on the host from the final :class:`SAEMState`.

    - **kind** -- the :class:`Failure` (never ``NONE``).
    - **iteration** -- the SAEM iteration (0-based; 0 for ``BURN_IN``).
    - **theta** -- :math:`\\theta` (flat unconstrained) the failed step started from.
    """

    kind: Failure
    iteration: int
    theta: np.ndarray

    @staticmethod
    def of(state: SAEMState) -> SAEMFailure | None:
        """The failure recorded in ``state``, or ``None``."""
        kind = Failure(int(state.failure))
        if kind is Failure.NONE:
            return None
        return SAEMFailure(kind, int(state.failed_at), np.asarray(state.failed_theta))


class SAEMState(NamedTuple):
    """Carry of the compiled SAEM loop.

    - **k** -- iteration counter.
    - **theta** -- flat unconstrained :math:`\\theta_k`.
    - **estate** -- state of the E-step (its latents hold every chain's).
    - **mstate** -- state of the M-step (SA statistics, Newton's averages).
    - **rng_key** -- random key.
    - **failure** -- int32 :class:`Failure` code of the first failure (``Failure.NONE``:
      none); the loop stops updating once it is set.
    - **failed_at** -- the iteration of that failure (0 during burn-in or without one).
    - **failed_theta** -- :math:`\\theta` (unconstrained) at that iteration.
    """

    k: jax.Array
    theta: jax.Array
    estate: Any
    mstate: Any
    rng_key: jax.Array
    failure: jax.Array
    failed_at: jax.Array
    failed_theta: jax.Array


# phases of the compiled program
_BURN, _ITER, _DRAW, _PAD = 0, 1, 2, 3


def fit_saem(estep: EStep, mstep: MStep, latents: Callable | None = None,
             score_hess: Callable | None = None):
    """The pure SAEM program: ``step(carry, x, data, aux, ids)`` for :func:`jax.lax.scan`.

    ``estep`` and ``mstep`` implement :class:`~numpyro_fed.saem.protocols.EStep` and
    :class:`~numpyro_fed.saem.protocols.MStep` (a :class:`TypeError` names a missing
    member); ``latents(estate) -> z (C, d_z)`` defaults to ``estep.latents``.

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

    A non-finite E-step or M-step sets :attr:`SAEMState.failure` (a :class:`Failure` code)
    and freezes the state; the host decodes it (:meth:`SAEMFailure.of`).
    """
    check_estep(estep, "estep")
    check_mstep(mstep, "mstep")
    if latents is None:
        latents = estep.latents
    # the chains move with theta: by the M-step's transport (interweaving), else in the
    # centred coordinates (z - M dtheta; see centring_design)
    transport = mstep.transport
    none, burn_in = int(Failure.NONE), int(Failure.BURN_IN)
    e_fail, m_fail = int(Failure.ESTEP), int(Failure.MSTEP)

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
            fail = jnp.where(finite, state.failure, burn_in).astype(jnp.int32)
            return state._replace(estate=es, mstate=mst, rng_key=key, failure=fail), zbuf, dacc

        def b_iter(_):
            g = jnp.asarray(gamma, dt)
            sh = score_hess(theta, z, data, M) if score_hess is not None else None
            mean_sh = None if sh is None else (jnp.mean(sh[0], 0), jnp.mean(sh[1], 0))
            theta_new, mst = mstep.update(state.mstate, g, theta, z, data, aux, anneal,
                                          mean_sh)
            ok = finite & jnp.all(jnp.isfinite(theta_new))
            already = state.failure != none
            new = SAEMState(state.k + 1, theta_new, es, mst, key, state.failure,
                            state.failed_at, state.failed_theta)
            keep = already | ~ok
            out = jax.tree.map(lambda a, b: jnp.where(keep, a, b), state, new)
            if transport is None:
                def move(zf):
                    return zf - M @ (out.theta - theta)
            else:
                def move(zf):
                    return transport(out.mstate, zf, theta, out.theta, aux)
            out = out._replace(estate=estep.move(out.estate, move))
            flag = ~already & ~ok
            kind = jnp.where(finite, m_fail, e_fail).astype(jnp.int32)
            return out._replace(
                rng_key=key, failure=jnp.where(flag, kind, state.failure),
                failed_at=jnp.where(flag, state.k, state.failed_at),
                failed_theta=jnp.where(flag, theta, state.failed_theta)), zbuf, dacc

        def b_draw(_):
            st = state._replace(estate=es, rng_key=key)
            return st, zbuf.at[j].set(z), dacc + acc

        def b_pad(_):
            return state, zbuf, dacc

        out = lax.switch(ph, [b_burn, b_iter, b_draw, b_pad], None)
        return out, (out[0].theta, acc)

    return step


def _padded_xs(xs, pad: int, dt) -> tuple:
    """The schedule's inputs of the loop (:meth:`SAEM._schedule_xs`) with ``pad`` padding
    iterations appended (phase ``_PAD``: nothing changes), the step sizes in ``dt``."""
    return (np.concatenate([xs[0], np.full(pad, _PAD, np.int32)]),
            np.concatenate([xs[1], np.ones(pad)]).astype(np.dtype(dt)),
            np.concatenate([xs[2], np.zeros(pad, np.int32)]),
            np.concatenate([xs[3], np.zeros(pad, bool)]),
            np.concatenate([xs[4], np.zeros(pad, bool)]),
            np.concatenate([xs[5], np.zeros(pad, np.int32)]))


def _on_worker(fn: Callable, name: str):
    """``(pool, future)``: ``fn()`` started on a worker thread (to compile or run a program:
    XLA releases the GIL) with this thread's ``jax_enable_x64``; shut the pool down after
    taking the result."""
    x64 = bool(jax.config.jax_enable_x64)

    def run():
        with jax.enable_x64(x64):  # the worker's configuration is the caller's
            return fn()

    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    return pool, pool.submit(run)


def _types(*trees) -> tuple:
    """The structure and the (shape, dtype, weak type) of every leaf of ``trees`` (arrays or
    :class:`jax.ShapeDtypeStruct`): what a program is traced on."""
    leaves, treedef = jax.tree.flatten(trees)
    return treedef, tuple((tuple(np.shape(x)), str(x.dtype),
                           bool(getattr(x, "weak_type", False))) for x in leaves)


@dataclass(frozen=True, eq=False)
class SAEMProgram:
    """The description of one SAEM fit, built by every :meth:`SAEM.run` from the model and
    the structure of its data and never changed after (:attr:`SAEM.program`: the last
    run's); the compiled
    executables are cached by content (:mod:`numpyro_fed._programs`), this description is
    not cached at all (what the model reads is read again by the next run).

    - **info** -- the model (:class:`~numpyro_fed.saem.model.ModelInfo`).
    - **data** -- ``(args, kwargs)``, the arrays the model reads concretely as NumPy arrays.
    - **layout** -- the subject layout (one joint block without subjects).
    - **layout_reason** -- why there are no subjects (``""`` when there are).
    - **has_subjects** -- whether the latents factorise over a subject plate.
    - **num_chains**, **prior_proposals** -- chains of :math:`z`, independence proposals
      per E-step.
    - **estep** -- the :class:`~numpyro_fed.saem.protocols.EStep`.
    - **builtin** -- the E-step is SAEM's own (pure JAX; its programs take the data as
      arguments), not the user's kernel or E-step.
    - **mstep** -- the :class:`~numpyro_fed.saem.protocols.MStep`.
    - **mstep_reason** -- why the closed-form Gaussian M-step does not apply (or ``""``).
    - **use_fisher** -- standard errors are offered.
    - **centring** -- the chains move in the centred coordinates.
    - **step** -- the pure loop body (:func:`fit_saem`).
    """

    info: ModelInfo
    data: tuple
    layout: SubjectLayout
    layout_reason: str
    has_subjects: bool
    num_chains: int
    prior_proposals: int
    estep: EStep
    builtin: bool
    mstep: MStep
    mstep_reason: str
    use_fisher: bool
    centring: bool
    step: Callable


class SAEM:
    """MCMC-SAEM for maximum marginal likelihood of the ``param`` sites of a NumPyro model.

    With no settings, ``SAEM(model).run(key, **data)`` is meant to reach the maximum of the
    marginal likelihood of a mixed-effects model on its natural scale: the E-step is
    per-subject MALA with step sizes and preconditioners adapted during the exploration phase
    plus 2 independence proposals from :math:`p(z\\mid\\theta)` per iteration (saemix's
    kernels), ``max(2, ceil(50 / subjects))`` chains (more with nested levels of random effects,
    see ``num_chains``), saemix's schedule (300 exploration iterations
    with simulated annealing of the variances, then 200 at :math:`\\gamma_k = k^{-2/3}`), the
    closed-form Gaussian M-step where it applies (SA-Newton elsewhere), and a convergence
    check at the end.

    :param model: a NumPyro model; ``numpyro.param`` sites are :math:`\\theta` (their
        ``constraint`` is respected), latent ``sample`` sites are :math:`z`.
    :param kernel: ``"mala"`` (default) or ``"ula"`` (built-in, pure JAX), a NumPyro
        :class:`~numpyro.infer.mcmc.MCMCKernel` instance that implements ``wrap_model`` and
        ``refresh`` (e.g. ``NUTS(model)``), a factory ``f(conditioned_model) ->
        MCMCKernel``, or an E-step of your own (an implementation of
        :class:`~numpyro_fed.saem.protocols.EStep`, on the flat unconstrained latents and
        :math:`\\theta` of :class:`~numpyro_fed.saem.model.ModelInfo`).
    :param step_size: fixed Langevin step size :math:`\\eta` of the built-in kernels (no
        adaptation; with ``preconditioner``: the E-step of Gruffaz et al. 2024). ``None``
        (default): adaptive per-subject step sizes and preconditioners.
    :param num_mcmc_steps: Langevin steps per SAEM iteration (``m``, default 4 as in
        Gruffaz et al. 2024).
    :param num_chains: chains of :math:`z`; statistics are averaged over chains. Default:
        ``max(2, ceil(50 / number of subjects))`` (2 without a subject plate): chains x
        subjects >= 50 as in saemix, and at least two chains, which halves the Monte Carlo
        variance of the statistics of a model with many subjects at twice the E-step cost.
        When the subjects (groups) hold ``L`` nested levels of random effects (the casks of
        a batch, the broods of a location, a subject's occasions), at least ``min(64,
        ceil(1000 L / groups), 200000 // latents)`` (:data:`MIN_CHAIN_NESTED_GROUPS`): the
        split of a variance between the levels is weakly determined, and with fewer chains
        the exploration phase's noise left estimates far from the maximum without a warning.
    :param schedule: a :class:`Schedule` (default: saemix's, see :class:`Schedule`).
    :param mstep: ``"auto"`` (closed-form Gaussian where recognised, SA-Newton for the other
        parameters), ``"gaussian"`` (the same, but an error if nothing is recognised),
        ``"newton"``, a :class:`SufficientStatistics`, or an M-step of your own (an
        implementation of :class:`~numpyro_fed.saem.protocols.MStep`).
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
        kernel: str | MCMCKernel | EStep | Callable = "mala",
        step_size: float | None = None,
        num_mcmc_steps: int = 4,
        num_chains: int | None = None,
        schedule: Schedule | None = None,
        mstep: str | SufficientStatistics | MStep = "auto",
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
        elif not (isinstance(kernel, MCMCKernel | EStep) or callable(kernel)):
            if any(hasattr(kernel, m) for m in ("init", "step", "latents")):
                check_estep(kernel)  # an E-step that lacks members: say which
            raise TypeError("`kernel` must be 'mala', 'ula', an MCMCKernel, a factory or an "
                            "E-step (numpyro_fed.saem.protocols.EStep).")
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
        if isinstance(mstep, str):
            if mstep not in ("auto", "gaussian", "newton"):
                raise ValueError(
                    f"mstep={mstep!r}: use 'auto', 'gaussian', 'newton', SufficientStatistics "
                    "or an M-step (numpyro_fed.saem.protocols.MStep)."
                )
        elif not isinstance(mstep, SufficientStatistics):
            check_mstep(mstep)
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
        #: the :class:`SAEMProgram` of the last run (``None`` before one got that far)
        self.program: SAEMProgram | None = None

    @property
    def num_chains(self) -> int:
        """Chains used (known after the model is analysed)."""
        if self.program is not None:
            return self.program.num_chains
        return self._num_chains or 1

    # ------------------------------------------------------------------ the program
    def _build_program(self, rng_key, args, kwargs, init_params=None) -> SAEMProgram:
        """The :class:`SAEMProgram` of this run, built afresh (no cache keyed on the model
        object or a list of settings can see what the model reads; its programs are compiled
        once per content, :func:`~numpyro_fed.saem.model.jit_once`): the model's analysis,
        the subject layout (:meth:`_layout`), the M-step (:meth:`_mstep`), the E-step
        (:meth:`_estep`) and the loop body over them (:func:`fit_saem`)."""
        info = ModelInfo(self.model, args, kwargs, rng_key)
        scope = _programs.current_scope()
        if scope is not None:  # which data the model reads concretely: part of the run key
            scope.activate(info.static_data)
        if init_params is not None:  # before anything is compiled
            info.check_init_params(init_params)
        # the arrays the model reads concretely, as NumPy arrays from here on: every program
        # that closes over the data sees concrete values (JAX stages operations on a
        # closed-over jax.Array)
        args, kwargs = static_as_numpy(args, kwargs, info.static_data)
        builtin = isinstance(self.kernel, str)
        layout, layout_reason, has_subjects = self._layout(info, builtin, args, kwargs,
                                                           rng_key)
        num_chains = (self._num_chains if self._num_chains is not None
                      else default_num_chains(info, layout, has_subjects))
        if self._prior_proposals is not None:
            n_prior = self._prior_proposals
        else:
            n_prior = 2 if (builtin and has_subjects) else 0
        mstep, mstep_reason = self._mstep(info, args, kwargs, rng_key)
        estep = self._estep(info, layout, n_prior, kwargs, bool(args))

        # the coordinates whose score and Hessian the M-step reads (the SA-Newton ones of the
        # Gaussian M-step; every one for the plain Newton M-step): a Hessian in those only
        score_idx = getattr(mstep, "score_idx", None)  # optional (see MStep)

        def score_hess(theta_u, z, data, M):
            return centred_score_hess(info, theta_u, z, data[0], data[1], M, idx=score_idx)

        return SAEMProgram(
            info=info, data=(args, kwargs), layout=layout, layout_reason=layout_reason,
            has_subjects=has_subjects, num_chains=num_chains, prior_proposals=n_prior,
            estep=estep, builtin=builtin, mstep=mstep, mstep_reason=mstep_reason,
            use_fisher=bool(self.fisher if self.fisher is not None
                            else info.dim_theta <= 50),
            centring=bool(builtin and has_subjects and self.centring),
            step=fit_saem(estep, mstep, estep.latents,
                          score_hess if mstep.needs_score else None),
        )

    def _layout(self, info: ModelInfo, builtin: bool, args, kwargs, rng_key
                ) -> tuple[SubjectLayout, str, bool]:
        """``(layout, reason, has_subjects)``: the subject layout of the built-in E-steps
        (:func:`~numpyro_fed.saem.model.subject_layout`), else one joint block and why."""
        layout, reason = (None, "mh_blocks='joint'")
        if self.mh_blocks != "joint" and builtin:
            # the structure probes from a fixed key, as the M-step's (PROBE_SEED): the
            # layout is the model's, the same for every seed (a replayed run relies on it)
            layout, reason = subject_layout(info, self.subject_plate, args, kwargs,
                                            random.fold_in(random.key(PROBE_SEED), 3))
            if layout is None and self.mh_blocks == "subject":
                raise ValueError(
                    f"mh_blocks='subject': the model has no subject structure ({reason}); use "
                    "mh_blocks='joint'."
                )
        if layout is None:
            return joint_layout(info), reason, False
        return layout, reason, True

    def _mstep(self, info: ModelInfo, args, kwargs, rng_key) -> tuple[MStep, str]:
        """``(mstep, reason)``: the M-step the ``mstep`` setting asks for (a user's
        :class:`~numpyro_fed.saem.protocols.MStep` as given); with ``"auto"`` or
        ``"gaussian"``, the closed-form Gaussian one where
        :func:`~numpyro_fed.saem.mstep.detect_gaussian` recognises the model, with the reason
        when it does not."""
        tau = self.schedule.anneal_factor
        ann_mask = None
        if self.annealed is not None:
            unknown = set(self.annealed) - set(info.param_names)
            if unknown:
                raise ValueError(f"`annealed` names unknown param sites {sorted(unknown)}.")
            ann_mask = np.zeros(info.dim_theta_c, bool)
            for i, n in enumerate(info.param_names):
                if n in self.annealed:
                    ann_mask[info.param_offsets[i]:info.param_offsets[i + 1]] = True
        spec = self.mstep_spec
        if isinstance(spec, SufficientStatistics):
            return UserMStep(info, spec, tau, ann_mask), ""
        if not isinstance(spec, str):
            return spec, ""
        if spec == "newton":
            return NewtonMStep(info, self.newton_damping, self.newton_max_step,
                               anneal_factor=tau, annealed=ann_mask), ""
        # the structure probes do not depend on the fit's key: a model gets the same M-step
        # whatever the seed (Quinidine with time-varying covariates got the Newton M-step on
        # seed 0 and the closed form on seed 1)
        gspec, reason = detect_gaussian(info, args, kwargs)
        if gspec is not None:
            return GaussianMStep(info, gspec, damping=self.newton_damping,
                                 max_step=self.newton_max_step, anneal_factor=tau,
                                 interweave=self.interweave), reason
        if spec == "gaussian":
            raise ValueError(
                f"mstep='gaussian': the model is not of the recognised Gaussian family "
                f"({reason}). Use mstep='newton' or give SufficientStatistics."
            )
        return NewtonMStep(info, self.newton_damping, self.newton_max_step,
                           anneal_factor=tau, annealed=ann_mask), reason

    def _estep(self, info: ModelInfo, layout: SubjectLayout, n_prior: int, kwargs,
               has_args: bool) -> EStep:
        """The E-step: SAEM's own Langevin E-step, a NumPyro kernel's, or the user's
        :class:`~numpyro_fed.saem.protocols.EStep` as given."""
        if isinstance(self.kernel, str):
            return LangevinEStep(
                info, layout, mala=self.kernel == "mala", step_size=self.step_size,
                preconditioner=flat_preconditioner(info, self.preconditioner),
                prior_proposals=n_prior, target_accept=self.target_accept)
        if isinstance(self.kernel, EStep) and not isinstance(self.kernel, MCMCKernel):
            return self.kernel
        return NumPyroEStep(info, self.model, self.kernel, kwargs, has_args)

    # ------------------------------------------------------------------ programs
    def _init_program(self, st: SAEMProgram, static):
        info, estep, mstep = st.info, st.estep, st.mstep
        C = st.num_chains
        strat, jitter = self.init_strategy, self.init_jitter
        model = self.model

        lay = st.layout
        centre = st.centring

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
                              jnp.full((), int(Failure.NONE), jnp.int32),
                              jnp.zeros((), jnp.int32), theta0)
            return state, z0, aux, per_site

        return jit_once(init) if st.builtin else init

    def _chunk_program(self, st: SAEMProgram, static):
        step = st.step

        def chunk(carry, xs, arrays, aux, ids):
            data = merge_data(arrays, static)
            return lax.scan(lambda c, x: step(c, x, data, aux, ids), carry, xs)

        return jit_loop(chunk)

    def _schedule_xs(self, st: SAEMProgram):
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
        # a run whose model (by value), data (by content) and settings equal an earlier
        # run's prepares the same programs: it replays them without tracing (saem.memo)
        key = (memo.run_key(self, rng_key, model_args, model_kwargs,
                            (init_params, bool(progress_bar), int(num_chunks)))
               if REPLAY_RUNS else None)
        with _programs.replay_scope(key):
            args, kwargs = model_args, model_kwargs
            st = self._build_program(rng_key, args, kwargs, init_params)
            self.program = st
            # the arrays the model reads concretely are static (constants of the programs)
            args, kwargs = st.data
            arrays, static = split_data(args, kwargs, st.info.static_data)
            info = st.info
            if init_params is not None:
                tc = info.check_init_params(init_params)
                theta0 = info.unconstrain_theta(tc)
            else:
                theta0 = info.theta0_u_flat
            # a strongly typed theta: the carry keeps one type, the program compiles once
            theta0 = jnp.asarray(theta0, dtype=jnp.result_type(theta0.dtype))
            ids = ({k: jnp.asarray(v) for k, v in st.layout.site_ids} if st.has_subjects
                   else None)
            init = self._init_program(st, static)
            log_step0 = jnp.asarray(math.log(self.step_size) if self.step_size else 0.0,
                                    theta0.dtype)
            init_args = (theta0, arrays, random.fold_in(rng_key, 1), ids, log_step0)
            whole = st.builtin and not progress_bar  # the loop in one call (one shape)
            if whole:
                # the initial state compiles on a worker while the loop is traced from its
                # types (XLA releases the GIL; tracing stays on this thread)
                (state, z0, aux, per_site), chunk, chunk_prep = self._init_and_trace_loop(
                    st, static, init, init_args, arrays, ids)
            else:
                state, z0, aux, per_site = init(*init_args)
                chunk_prep = None
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
                if chunk_prep is None:
                    chunk = self._chunk_program(st, static)
                inputs = (arrays, aux, ids)
            else:  # a NumPyro kernel: the data closed over (as its own programs do)
                data = (args, kwargs)
                chunk = jit_loop(lambda c, x: lax.scan(
                    lambda cc, xx: st.step(cc, xx, data, aux, ids), c, x))
                inputs = ()
            compiled = []  # traced once per run (the chunks have one shape), then called

            def call(c, x):
                if not compiled:
                    prep = chunk.prepare(c, x, *inputs) if chunk_prep is None else chunk_prep
                    compiled.append(prep.finish() if isinstance(prep, _programs.Pending)
                                    else prep)
                return compiled[0](c, x, *inputs)
            nc = max(1, min(int(num_chunks), total)) if progress_bar else 1
            L = -(-total // nc)
            xs = _padded_xs(xs, nc * L - total, dt)
            thetas, accs = [], []
            bar = None
            if progress_bar:
                from tqdm.auto import tqdm

                bar = tqdm(total=total, desc="SAEM")
            warm = {}
            try:
                if WARM_PROGRAMS and nc == 1 and st.builtin and st.use_fisher:
                    # one call: the loop runs while the standard errors' programs compile
                    (carry, (th, ac)), warm = self._run_warming(st, chunk, carry, xs, inputs,
                                                                aux, args, kwargs, ids, theta0,
                                                                prep=chunk_prep)
                    thetas.append(th)
                    accs.append(ac)
                for c in range(nc if not thetas else 0):
                    carry, (th, ac) = call(carry, tuple(v[c * L:(c + 1) * L] for v in xs))
                    thetas.append(th)
                    accs.append(ac)
                    if bar is not None:
                        bar.update(min(L, total - c * L))
                        if int(carry[0].failure) != Failure.NONE:
                            break
            finally:
                if bar is not None:
                    bar.close()
            thetas = np.concatenate([np.asarray(t) for t in thetas])
            accs = np.concatenate([np.asarray(a) for a in accs])
            state, zs, dacc = carry
            failure = SAEMFailure.of(state)
            if failure is not None:
                # the updates before the failure (a failed iteration keeps the last finite theta)
                traj = thetas[B1:B1 + failure.iteration]
                raise self._divergence_error(st, failure, state.estate, theta0, args, kwargs,
                                             traj)
            res = SAEMResult(
                model=self.model, info=info, layout=st.layout if st.has_subjects else None,
                ids=ids, theta=np.asarray(state.theta),
                thetas_u=thetas[B1:B1 + K], gammas=self.gammas, accs=accs[B1:B1 + K],
                zs=np.asarray(zs), accept_final=float(dacc) / max(T, 1),
                centring=np.asarray(aux[1]) if st.use_fisher else None,
                mstep=st.mstep.kind, args=args, kwargs=kwargs,
                num_exploration=self.schedule.num_exploration, settings=self._describe(st),
                programs={}, theta0=np.asarray(theta0),
            )
            spec = getattr(st.mstep, "spec", None)
            if isinstance(st.mstep, GaussianMStep) and spec.diag_sites:
                # the diagonal random-effect scales, for the boundary slopes of the check
                res._diag_scales = (tuple(spec.diag_sites), np.asarray(spec.lat_g))
            if isinstance(st.mstep, GaussianMStep) and spec.mvn_sites:
                # the full random-effect covariances, for the check's singular-covariance
                # slopes (a correlation at +-1)
                res._mvn_sites = tuple(spec.mvn_sites)
            res._warm = warm
            try:
                res.convergence_messages = res.check_convergence(warn=True)
            finally:
                res._warm = {}  # later calls trace afresh, as every call does
            return res

    def _run_warming(self, st: SAEMProgram, chunk, carry, xs, inputs, aux, args, kwargs,
                     ids, theta0, prep=None):
        """Run the whole loop (one call of ``chunk``) and, meanwhile, compile the programs
        of the result's standard errors (:func:`~numpyro_fed.saem.result.warm_programs`):
        ``(loop outputs, warmed runners)``.

        A loop program not compiled yet is compiled by a worker thread (XLA releases the
        GIL), which then dispatches it; this thread traces and compiles the standard
        errors' programs in the meantime. Tracing stays on this thread: NumPyro's effect
        handlers are one global stack, which two threads tracing a model would share. A
        loop already compiled is dispatched at once, and the programs are warmed after
        :data:`WARM_AFTER_S` if it still runs (its iterations run on XLA's threads). Either
        way the numbers are those of an unwarmed fit: the same programs run on the same
        arguments. ``prep``: the loop prepared already (:meth:`_init_and_trace_loop`)."""
        if prep is None:
            prep = chunk.prepare(carry, xs, *inputs)
        pool = fut = None
        if isinstance(prep, _programs.Pending):
            pool, fut = _on_worker(lambda: prep.finish()(carry, xs, *inputs),
                                   "numpyro_fed-compile")
            loop: list = []

            def busy():
                if not fut.done():
                    return True
                if not loop:
                    loop.append(self._loop_busy(fut.result()))
                return loop[0]()

            wait = 0.0  # compiling the loop takes seconds: warm at once
        else:
            out = prep(carry, xs, *inputs)
            busy, wait = self._loop_busy(out), WARM_AFTER_S
        scope = _programs.active_scope()
        if scope is not None and scope.replays and pool is None:
            # a replayed run: its convergence check takes the recorded run's programs, none
            # is traced or compiled, nothing to warm
            return out, {}
        try:
            # the warmed programs depend on timing: not recorded for a replay (the check
            # records those it runs, warmed or not)
            with scope.suspend() if scope is not None else contextlib.nullcontext():
                warm = self._warm_while_running(st, busy, wait, jax.typeof(carry[1]), aux,
                                                args, kwargs, ids, theta0)
        finally:
            if pool is not None:
                out = fut.result()  # the worker's error, if any, is raised here
                pool.shutdown()
        return out, warm

    def _init_and_trace_loop(self, st: SAEMProgram, static, init, init_args, arrays, ids):
        """``(init outputs, chunk, prepared loop)``: the initial state's program compiled
        on a worker thread while this thread traces and lowers the whole loop from the
        types of its arguments (the initial state's output types: the loop does not read
        its values to be traced); the loop is prepared from those types whether or not the
        initial state was compiled already, so that a replayed run prepares the same
        programs in the same order. A first fit of ``nlme::Quinidine`` compiles its
        initial state in 1.3 s and traces its loop in 1.4 s (2-core CPU): they overlap."""
        iprep = init.prepare(*init_args)
        pool = fut = None
        if isinstance(iprep, _programs.Pending):
            pool, fut = _on_worker(iprep.finish, "numpyro_fed-init")
            out_info = iprep.lowered.out_info
        else:
            out_info = iprep.compiled.out_info
        try:
            types = jax.tree.map(
                lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype,
                                               weak_type=bool(getattr(o, "weak_type", False))),
                out_info)
            carry, inputs = self._loop_arguments(st, types, arrays, ids)
            chunk = self._chunk_program(st, static)
            xs = _padded_xs(self._schedule_xs(st)[0], 0, carry[0].theta.dtype)
            chunk_prep = chunk.prepare(carry, xs, *inputs)
        finally:
            runner = fut.result() if fut is not None else iprep
            if pool is not None:
                pool.shutdown()
        out = runner(*init_args)
        # the loop was traced on the types the initial state has (else traced again on it)
        carry_now, inputs_now = self._loop_arguments(st, out, arrays, ids)
        if _types(carry_now, inputs_now) != _types(carry, inputs):
            chunk_prep = chunk.prepare(carry_now, xs, *inputs_now)
        return out, chunk, chunk_prep

    def _loop_arguments(self, st: SAEMProgram, init_out, arrays, ids):
        """``(carry, inputs)`` of the whole loop from the initial state's outputs (arrays or
        their types), as :meth:`run` builds them."""
        state, z0, aux, _ = init_out
        T = self.num_draws
        zbuf = jax.ShapeDtypeStruct((T,) + tuple(z0.shape), z0.dtype)
        dacc = jax.ShapeDtypeStruct((), state.theta.dtype)
        return (state, zbuf, dacc), (arrays, aux, ids)

    @staticmethod
    def _loop_busy(outputs) -> Callable[[], bool]:
        """Whether the dispatched loop of these outputs still runs."""
        leaves = [x for x in jax.tree.leaves(outputs) if hasattr(x, "is_ready")]  # no keys
        return lambda: not all(x.is_ready() for x in leaves)

    def _warm_while_running(self, st: SAEMProgram, busy, wait: float, zbuf, aux, args,
                            kwargs, ids, theta0) -> dict:
        """After ``wait`` seconds of ``busy()``, compile the programs of the result's standard
        errors while ``busy()`` (:func:`~numpyro_fed.saem.result.warm_programs`); their
        runners, for the fit's own convergence check. ``zbuf``: the type of the draws."""
        t0 = time.perf_counter()
        while busy() and time.perf_counter() - t0 < wait:
            time.sleep(0.01)
        if not busy():
            return {}
        fields = dict(info=st.info, layout=st.layout if st.has_subjects else None, ids=ids,
                      args=args, kwargs=kwargs,
                      theta=np.zeros(theta0.shape, theta0.dtype),
                      z_draws=np.zeros(zbuf.shape, zbuf.dtype),
                      centring=np.zeros(jax.typeof(aux[1]).shape, jax.typeof(aux[1]).dtype))
        return warm_programs(fields, busy)

    fit = run

    def _divergence_error(self, st: SAEMProgram, failure: SAEMFailure, estate, theta0, args,
                          kwargs, traj=None) -> DivergenceError:
        """The error for a failed fit (host side, after the run), by the kind of the
        failure: it quotes the E-step kernel's own step size and, when the log-density of a
        site is already non-finite at that theta for the latents the E-step started from,
        names the site; a non-finite M-step is blamed on the M-step. When a parameter was
        heading to the boundary of its support (a variance collapsing to 0, see
        :func:`~numpyro_fed.saem.result.boundary_collapse`), that is the cause named, with
        its last finite value and the iteration."""
        info = st.info
        bad = failure.iteration
        ran = ""
        if failure.kind is not Failure.BURN_IN and traj is not None and len(traj):
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
                what = "M-step" if failure.kind is Failure.MSTEP else "E-step"
                return DivergenceError(
                    f"SAEM: '{b['name']}' collapsed to its boundary {b['bound']:g}: its last "
                    f"finite value was {b['value']:.3g} at iteration {b['iteration']} (down "
                    f"from {b['reference']:.3g}), and the {what} became non-finite at "
                    f"iteration {bad + 1} (theta={_format_theta(info, failure.theta)}). The "
                    f"constraint of '{b['name']}' is respected; "
                    + boundary_advice(b, info) + "."
                )
        summary = st.estep.step_size_summary(estate)
        if isinstance(st.estep, NumPyroEStep):
            name = type(st.estep.kernel).__name__
            fix = (f"reduce the step size of the E-step kernel {name} (the `kernel` you "
                   "passed; SAEM's own `step_size` does not apply to it)")
        elif not st.builtin:
            fix = (f"check your E-step {type(st.estep).__name__} (the `kernel` you passed; "
                   "SAEM's own `step_size` does not apply to it)")
        elif self.step_size is not None:
            fix = ("reduce `step_size`, or leave step_size=None for the adaptive E-step "
                   "(SAEM's default)")
        else:
            fix = ("the adaptive E-step rejects non-finite proposals, so the model's "
                   "log-density itself became non-finite: check the model at these values")
        if failure.kind is Failure.BURN_IN:
            return DivergenceError(
                f"SAEM: the E-step kernel diverged during burn-in at theta_0="
                f"{_format_theta(info, theta0)} (E-step: {summary}); {fix}; or give initial "
                "values closer to the data (`init_params`)."
            )
        theta = _format_theta(info, failure.theta)
        sites = info.nonfinite_sites(info.constrain_theta(jnp.asarray(failure.theta)),
                                     st.estep.latents(estate), args, kwargs)
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
        if failure.kind is Failure.MSTEP:  # the model is finite there: the M-step itself
            what = ("your SufficientStatistics maximizer"
                    if isinstance(st.mstep, UserMStep)
                    else f"the {st.mstep.kind} M-step")
            head = (f"SAEM: the M-step gave a non-finite theta at iteration {bad}, from "
                    f"theta={theta} and finite latents (E-step: {summary})")
            if ran and not isinstance(st.mstep, UserMStep):
                # the cause is parameters running off (degenerate data), not the M-step
                return DivergenceError(head + "." + ran)
            return DivergenceError(
                head + f": {what} is not defined at these statistics. Check it (a variance "
                "from a negative difference, a division by a zero count), declare each "
                "param's constraint, or give `init_params` closer to the data." + ran
            )
        return DivergenceError(
            f"SAEM: the E-step became non-finite at iteration {bad} with theta={theta} "
            f"(E-step: {summary}); {fix}." + ran
        )

    def _describe(self, st: SAEMProgram) -> dict:
        """:attr:`SAEMResult.settings <numpyro_fed.saem.SAEMResult.settings>` of the fit."""
        desc = st.mstep.describe()
        return {
            "kernel": self.kernel if isinstance(self.kernel, str) else type(self.kernel).__name__,
            "num_chains": st.num_chains, "prior_proposals": st.prior_proposals,
            "subjects": st.layout.n if st.has_subjects else None,
            "subject_plate": st.layout.plate if st.has_subjects else None,
            "mstep": st.mstep.kind, "mstep_reason": st.mstep_reason,
            "adaptive": self.step_size is None and st.builtin,
            "num_iters": len(self.gammas), "num_exploration": self.schedule.num_exploration,
            "use_fisher": st.use_fisher,
            "centring": st.centring,
            "interweave": bool(desc.get("interweave", False)),
            # the data arguments the model reads concretely (static: compiled per value)
            "static_data": list(st.info.static_data),
            # the scales of Gaussian sites (standard deviations of random effects and
            # residuals: flat constrained indices) and the covariance parameters of
            # MultivariateNormal sites, for the variance scale of the parameter table
            "variance_coords": list(desc.get("variance_coords", [])),
            "mvn_covariances": list(desc.get("mvn_covariances", [])),
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
