"""QLSD family: quantised Langevin stochastic dynamics (Vono et al., AISTATS 2022).

All variants are one recursion ([VPD+22]_, Alg. 1 and Alg. 2):

.. math::

    g_i = \\mathcal{C}\\big(H_i(\\theta_k) - \\eta_k^{(i)}\\big), \\qquad
    g = \\nabla U_0(\\theta_k) + c + \\eta_k + \\textstyle\\sum_i g_i, \\qquad
    \\theta_{k+1} = \\theta_k - \\gamma g + \\sqrt{2\\gamma}\\, Z_{k+1},

with memory terms :math:`\\eta^{(i)}_{k+1} = \\eta^{(i)}_k + \\alpha g_i`,
:math:`\\eta_{k+1} = \\eta_k + \\alpha\\sum_i g_i`, :math:`\\eta_0 = 0` (text of Sec. 2 and
Table 1; the pseudo-code of Alg. 2 swaps the "QLSD*" / "QLSD++" labels of the memory update),
:math:`\\nabla U_0` the server's share of the prior (zero with the default split prior), and
the client oracle :math:`H_i` and server offset :math:`c` of each variant:

* **QLSD#** (Alg. 1): :math:`H_i = (N_i/n)\\sum_{j\\in S_i}\\nabla U_{ij}(\\theta)` (or the
  exact :math:`\\nabla U_i(\\theta)` when ``batch_size=None``, or any user oracle), :math:`c=0`.
* **QLSD*** (Alg. 2): :math:`H_i = (N_i/n)\\sum_{j\\in S_i}[\\nabla U_{ij}(\\theta) -
  \\nabla U_{ij}(\\theta^\\star)]` and :math:`c = g^\\star = \\sum_i \\nabla U_i(\\theta^\\star)`.
  The paper sets :math:`c = 0`, which is unbiased only when :math:`\\nabla U(\\theta^\\star)=0`
  exactly; a numerically found (or user-given, constrained-space) :math:`\\theta^\\star` is not
  an exact minimiser of the unconstrained potential, so :math:`g^\\star` is computed once (one
  counted round) and added on the server, which makes :math:`\\sum_i H_i + c` unbiased for
  :math:`\\nabla U(\\theta)` for *any* :math:`\\theta^\\star`.
* **QLSD++** (Alg. 2): SVRG control point :math:`\\zeta_k` reset to :math:`\\theta_k` when
  :math:`k \\equiv 0 \\pmod l`; :math:`H_i = (N_i/n)\\sum_{j\\in S_i}[\\nabla U_{ij}(\\theta) -
  \\nabla U_{ij}(\\zeta_k)] + \\nabla U_i(\\zeta_k)`, :math:`c = 0`. Each client computes
  :math:`\\nabla U_i(\\zeta_k)` from the :math:`\\theta_k` it has just received: the refresh costs
  computation, not communication. The refresh is a ``lax.cond`` on the iteration counter, which
  is shared (unbatched) by vectorized chains, so it stays a real branch: the full local
  gradients are computed once every ``l`` steps, not every step.

With the identity compressor these are LSD# / LSD* / LSD++ (the papers' uncompressed
baselines); with the identity compressor and full local gradients every variant is federated
ULA, and produces the same chain as :class:`~numpyro_fed.kernels.langevin.ULA` for the same
key (up to floating-point summation order).

**Stochastic quantisation** (eq. (4)) is :func:`numpyro_fed.compressors.quantize`; the
papers' "b bits" is :math:`s = 2^b` levels: ``compressor="bits:4"``, ``bits=4``,
``quantize(bits=4)`` and ``levels=16`` are the same compressor.

.. [VPD+22] M. Vono, V. Plassier, A. Durmus, A. Dieuleveut and E. Moulines. "QLSD: Quantised
   Langevin Stochastic Dynamics for Bayesian Federated Learning". AISTATS 2022.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed import _programs
from numpyro_fed._validation import check_float, check_int
from numpyro_fed.algorithms import estimators
from numpyro_fed.algorithms import qlsd as core
from numpyro_fed.algorithms import theta_star as search_alg
from numpyro_fed.algorithms.participation import (
    check_participation,
    participation_mask,
    warn_if_many_empty_rounds,
)
from numpyro_fed.algorithms.theta_star import ThetaStarSearch
from numpyro_fed.algorithms.variants import canonical_variant, spellings
from numpyro_fed.compressors import Compressor, identity, quantize
from numpyro_fed.kernels.base import split_chain_keys
from numpyro_fed.kernels.langevin import FederatedKernel
from numpyro_fed.partition import ClientPartition

__all__ = [
    "QLSD",
    "QLSDSharp",
    "QLSDStar",
    "QLSDPlusPlus",
    "LSD",
    "QLSDExtra",
    "ThetaStarSearch",
    "VARIANTS",
    "find_theta_star",
    "check_theta_star",
]

#: Accepted spellings of the three variants (lower case), mapped to their canonical names;
#: read from the package's one variant table, :data:`numpyro_fed.algorithms.variants.VARIANTS`.
VARIANTS: dict[str, str] = spellings("qlsd")


class QLSDExtra(NamedTuple):
    """Per-chain algorithm state of :class:`QLSD` (``FedState.extra``).

    Fields not used by a configuration are empty arrays of shape ``(0,)``.

    - **eta_clients** -- client memory terms :math:`\\eta^{(i)}_k`, shape ``(b, d)``.
    - **eta** -- server memory :math:`\\eta_k = \\sum_i \\eta^{(i)}_k`, shape ``(d,)``.
    - **zeta** -- QLSD++ control point :math:`\\zeta_k`, shape ``(d,)``.
    - **grad_zeta** -- :math:`\\nabla U_i(\\zeta_k)` held by each client, shape ``(b, d)``.
    - **refreshes** -- number of QLSD++ control-point refreshes so far (int32).
    - **participants** -- with ``participation < 1``: boolean ``(b,)`` mask of the clients
      that took part in the last round; ``()`` otherwise.
    """

    eta_clients: jax.Array
    eta: jax.Array
    zeta: jax.Array
    grad_zeta: jax.Array
    refreshes: jax.Array
    participants: Any = ()


def check_theta_star(pot, value: Mapping[str, Any]) -> jax.Array:
    """Validate QLSD*'s user-given :math:`\\theta^\\star` (constrained site values) against the
    model's latent sites and return it flat and unconstrained.

    :raises ValueError: naming the site for an unknown or missing site, a wrong shape, a
        non-finite value or a value outside the site's support.
    """
    names = list(pot.latent_names)
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"`theta_star` has unknown sites {unknown}; the model's latent sites "
                         f"are {names}.")
    missing = sorted(set(names) - set(value))
    if missing:
        raise ValueError(f"`theta_star` lacks the sites {missing}: give a constrained value for "
                         f"every latent site {names} (or theta_star=None to search for it).")
    proto = jax.eval_shape(lambda x: pot.constrain(x, deterministic=False),
                           jax.ShapeDtypeStruct((pot.dim,), pot.dtype))
    for name in names:
        v = np.asarray(value[name], np.float64)
        want = tuple(np.shape(proto[name]))
        if v.shape != want:
            raise ValueError(f"`theta_star[{name!r}]` has shape {v.shape}, but site {name!r} has "
                             f"shape {want}.")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"`theta_star[{name!r}]` has non-finite values.")
        t = pot._inv_transforms[name]
        u = np.asarray(t.inv(jnp.asarray(v, pot.dtype)))
        if not np.all(np.isfinite(u)):
            raise ValueError(
                f"`theta_star[{name!r}]` = {np.array2string(v, precision=4)} is outside the "
                f"support of site {name!r} ({t.codomain}); give a value inside it.")
    return pot.unconstrain(value)


def centring_at(pot, theta: jax.Array, *, data: ClientPartition | None = None,
                grads: jax.Array | None = None) -> tuple[jax.Array, jax.Array, float, float]:
    """QLSD*'s centring round at ``theta``: the clients' gradients and
    :func:`~numpyro_fed.algorithms.theta_star.centring`, in one program.

    :param data: the client partition, whose gradients are computed here (in process), or
    :param grads: the ``(b, d)`` gradients the clients sent (the Flower server).
    :return: ``(grads, g_star, grad_norm, scale)`` (the norms as Python floats).
    """
    def run(t, data, grads):
        grads = pot.full_grads(t, data) if grads is None else grads
        return (grads, *search_alg.centring(grads, pot.server_grad(t)))

    grads, g_star, gnorm, scale = _programs.Program(run)(theta, data, grads)
    return grads, g_star, float(gnorm), float(scale)


def find_theta_star(
    potential,
    data: ClientPartition,
    x0: jax.Array,
    *,
    method: str = "bb",
    maxiter: int = 2000,
    gtol: float = 1e-5,
    learning_rate: float = 1e-2,
) -> tuple[jax.Array, ThetaStarSearch]:
    """Federated minimisation of :math:`U = U_0 + \\sum_i U_i` from ``x0`` (one compiled loop).

    Each iteration is one communication round: the server broadcasts :math:`\\theta`
    (``b`` dense float32 vectors), every client returns :math:`\\nabla U_i(\\theta)` (and, for
    BFGS's line search, the scalar :math:`U_i(\\theta)`).

    :param potential: a :class:`~numpyro_fed.potential.FederatedPotential`.
    :param data: the client partition.
    :param x0: flat unconstrained starting point.
    :param method: ``"bb"`` (default: full-gradient descent with Barzilai--Borwein step sizes,
        gradients only, robust in float32), ``"adam"`` (full-gradient Adam) -- both in a
        ``lax.while_loop`` that stops when :math:`\\|\\nabla U\\| \\le` ``gtol``
        :math:`\\cdot\\max(1, \\|\\nabla U(x_0)\\|)` -- or ``"bfgs"``
        (``jax.scipy.optimize.minimize``; its line search needs accurate potential values,
        prefer float64).
    :param maxiter: maximal number of iterations (rounds).
    :param gtol: relative gradient tolerance.
    :param learning_rate: Adam's step size.
    :return: ``(theta_star, ThetaStarSearch)``.
    """
    b, d = data.num_clients, potential.dim

    def grad_u(x):
        return jnp.sum(potential.full_grads(x, data), 0) + potential.server_grad(x)

    if method == "bfgs":
        from jax.scipy.optimize import minimize

        fun = lambda x: potential.potential(x, data)  # noqa: E731
        g0 = jnp.linalg.norm(_programs.Program(grad_u)(x0))
        res = _programs.Program(
            lambda x: minimize(fun, x, method="BFGS",
                               options={"maxiter": maxiter, "gtol": gtol * max(1.0, float(g0))})
        )(x0)
        theta, rounds = res.x, int(res.nfev)
        up_per_round = b * (32 * d + 32)  # gradient + value for the line search
    elif method in search_alg.METHODS:

        def search(x):
            g = grad_u(x)
            tol = search_alg.tolerance(gtol, jnp.linalg.norm(g))

            def body(st):
                st = search_alg.update(method, st, learning_rate)
                return st._replace(g=grad_u(st.x))

            out = lax.while_loop(lambda st: search_alg.keep_going(st, tol, maxiter), body,
                                 search_alg.init(x, g))
            return out.k, out.x

        k, theta = _programs.Program(search)(x0)
        rounds = int(k) + 1  # + the gradient at x0
        up_per_round = b * 32 * d
    else:
        raise ValueError(
            f"Unknown theta* search `method`={method!r}; use 'bb', 'adam' or 'bfgs'."
        )
    g_final = float(jnp.linalg.norm(_programs.Program(grad_u)(theta)))
    g_start = float(jnp.linalg.norm(_programs.Program(grad_u)(x0)))
    info = ThetaStarSearch(
        method=method,
        rounds=rounds,
        bits_up=rounds * up_per_round,
        bits_down=rounds * b * 32 * d,
        grad_norm=g_final,
        converged=search_alg.converged(g_final, g_start, gtol),
    )
    return theta, info


class QLSD(FederatedKernel):
    """Quantised Langevin stochastic dynamics: QLSD#, QLSD* and QLSD++ ([VPD+22]_ Alg. 1-2).

    See the module docstring for the recursion. The kernel runs inside
    :class:`numpyro.infer.MCMC` (``num_chains``, ``chain_method="vectorized"``,
    ``print_summary``, ``az.from_numpyro``); the per-step ``bits`` (up, down) are a sample
    field, cumulative totals (including warmup and the one-off rounds of QLSD*) are in the
    state (:meth:`communication`).

    :param model: an ordinary NumPyro model.
    :param partition: the client partition of its data.
    :param variant: ``"#"`` / ``"sharp"``, ``"*"`` / ``"star"`` or ``"++"`` / ``"plusplus"``.
    :param step_size: :math:`\\gamma`.
    :param batch_size: per-client minibatch ``n`` (uniform with replacement); ``None`` uses
        full local gradients.
    :param compressor: an *unbiased* :class:`~numpyro_fed.compressors.Compressor` or a spec
        (``"bits:4"`` = ``"quantize:16"``); ``None`` is the identity (LSD).
    :param bits: shortcut for ``compressor=quantize(bits=bits)`` (:math:`s = 2^{bits}`).
    :param levels: shortcut for ``compressor=quantize(levels=levels)``.
    :param memory_rate: :math:`\\alpha`. ``None``: the paper's default, :math:`1/(\\omega+1)`
        for QLSD++ and 0 (no memory) for QLSD# and QLSD*; ``0`` switches memory off; values
        above :math:`1/(\\omega+1)` (the theory's bound) warn, values outside [0, 1] raise.
    :param refresh_every: ``l``, QLSD++'s control-point period.
    :param theta_star: QLSD* only: the centring point, as a dict of *constrained* site values
        (or an array for a single-site model); ``None`` searches for the minimiser of
        :math:`U` by federated optimisation (:func:`find_theta_star`), whose communication is
        stored in :attr:`theta_star_search` and included in the state's cumulative counters.
    :param theta_star_kwargs: options of :func:`find_theta_star` (``method``, ``maxiter``,
        ``gtol``, ``learning_rate``).
    :param oracle: QLSD# only: a custom stochastic gradient oracle
        ``oracle(key, theta, data) -> (b, d)`` array of :math:`H_i(\\theta)` (Alg. 1 with any
        oracle satisfying H3); overrides ``batch_size``.
    :param participation: probability ``p`` that a client takes part in a round (default 1:
        every client, every round). Absent clients send nothing and keep their memory term;
        the server reweights the received messages by the ratio estimator
        :math:`b/|S_k|` (see :mod:`numpyro_fed.algorithms.participation`); the mask of each
        round is ``state.extra.participants``.
    :param kwargs: :class:`~numpyro_fed.kernels.langevin.FederatedKernel` options (``prior``,
        ``likelihood_weight``, ``init_strategy``, ``check_finite``,
        ``postprocess_deterministic``).

    **Example**

    .. code-block:: python

        kernel = QLSD(model, clients, variant="++", step_size=1e-4, batch_size=32, bits=4)
        mcmc = MCMC(kernel, num_warmup=1000, num_samples=5000, num_chains=4,
                    chain_method="vectorized")
        mcmc.run(random.key(0))
        idata = numpyro_fed.to_inference_data(mcmc)  # bits_up / bits_down in
        # idata.sample_stats (az.from_numpyro: one `bits` variable, axis (up, down))
    """

    name = "QLSD"

    def __init__(
        self,
        model: Callable,
        partition: ClientPartition,
        *,
        variant: str = "#",
        step_size: float,
        batch_size: int | None = None,
        compressor: Compressor | str | None = None,
        bits: int | None = None,
        levels: int | None = None,
        memory_rate: float | None = None,
        refresh_every: int = 100,
        theta_star: Mapping[str, Any] | Any | None = None,
        theta_star_kwargs: Mapping[str, Any] | None = None,
        oracle: Callable | None = None,
        participation: float = 1.0,
        init_strategy: Callable = init_to_uniform,
        **kwargs: Any,
    ) -> None:
        self.variant = canonical_variant("qlsd", variant)
        self.participation = check_participation(participation)
        given = [n for n, v in (("compressor", compressor), ("bits", bits), ("levels", levels))
                 if v is not None]
        if len(given) > 1:
            raise ValueError(f"Give at most one of `compressor`, `bits`, `levels` (got {given}).")
        if bits is not None:
            compressor = quantize(bits=bits)
        elif levels is not None:
            compressor = quantize(levels=levels)
        super().__init__(
            model, partition, step_size=step_size, batch_size=batch_size,
            compressor=compressor, init_strategy=init_strategy, **kwargs,
        )
        warn_if_many_empty_rounds(self.participation, partition.num_clients)
        comp = self.compressor
        if not comp.unbiased or comp.omega is None:
            raise ValueError(
                f"QLSD needs an unbiased compressor (H2), got {comp.name}; use quantize(...), "
                "rand_k(...) or identity(). Biased/contractive compressors belong to ELF."
            )
        d = self.potential.dim
        self.omega = float(comp.omega(d))
        bound = 1.0 / (self.omega + 1.0)
        if memory_rate is None:
            memory_rate = bound if self.variant == "++" else 0.0
        alpha = check_float(
            "memory_rate", memory_rate, low=0.0, high=1.0,
            what=f" (QLSD Thm. 3 asks for at most 1/(omega+1) = {bound:.4g} for {comp.name} "
                 f"in dimension {d}; 0 switches memory off)")
        if alpha > bound * (1 + 1e-9):
            warnings.warn(
                f"`memory_rate`={alpha:.4g} exceeds the theoretical bound 1/(omega+1) = "
                f"{bound:.4g} of {comp.name} in dimension {d} (QLSD Thm. 3); the memory terms "
                "may amplify the compression noise.",
                stacklevel=2,
            )
        self.memory_rate = alpha
        self.refresh_every = check_int("refresh_every", refresh_every, minimum=1)
        if oracle is not None and self.variant != "#":
            raise ValueError("A custom `oracle` is only used by variant='#' (QLSD, Alg. 1).")
        self._custom_oracle = oracle
        if theta_star is not None and self.variant != "*":
            raise ValueError("`theta_star` is only used by variant='*' (QLSD*).")
        self._theta_star_user = theta_star
        if theta_star is not None:
            self._user_theta_star()  # refuse a bad centring point now, not at MCMC.run
        self.theta_star_kwargs = dict(theta_star_kwargs or {})
        self.theta_star: jax.Array | None = None
        self.theta_star_search: ThetaStarSearch | None = None
        self._star_fingerprint = None
        self.g_star: jax.Array | None = None
        self._grads_star: jax.Array | None = None
        self._star_bits: tuple[int, int] = (0, 0)

    # -- QLSD*: centring point ---------------------------------------------------------
    def _user_theta_star(self) -> jax.Array:
        """The user's ``theta_star`` as a flat unconstrained vector, checked site by site."""
        pot, value = self.potential, self._theta_star_user
        if not isinstance(value, Mapping):
            if len(pot.latent_names) != 1:
                raise ValueError(
                    "`theta_star` must be a dict of constrained site values "
                    f"{list(pot.latent_names)}; an array is accepted only for one site."
                )
            value = {pot.latent_names[0]: value}
        return check_theta_star(pot, value).astype(pot.dtype)

    def _prepare_theta_star(self, rng_key) -> None:
        """Find or convert :math:`\\theta^\\star`, then compute :math:`g^\\star` (once)."""
        pot, data = self.potential, self.partition
        b, d = data.num_clients, pot.dim
        if self._theta_star_user is not None:
            theta = self._user_theta_star()
            search = ThetaStarSearch("user", 0, 0, 0, float("nan"), True)
        else:
            vectorized, key = split_chain_keys(rng_key)
            key = key[0] if vectorized else key
            x0 = pot.init_params(key, self._init_strategy, fold_in=11)
            theta, search = find_theta_star(pot, data, x0, **self.theta_star_kwargs)
        grads, g_star, gnorm, scale = centring_at(pot, theta, data=data)
        search = search._replace(grad_norm=gnorm)
        if gnorm > 1e-2 * max(1.0, scale):
            warnings.warn(
                f"QLSD*: ||grad U(theta*)|| = {gnorm:.3g} is large (clients' gradients at "
                f"theta* have norm {scale:.3g}): theta* is not a minimiser of the unconstrained "
                "potential. The chain stays unbiased because g* = sum_i grad U_i(theta*) is "
                "added on the server, but the control variates are less effective; give a "
                "better `theta_star` or tighten `theta_star_kwargs`.",
                stacklevel=3,
            )
        self.theta_star, self.g_star, self._grads_star = theta, g_star, grads
        self.theta_star_search = search
        # search rounds + broadcast of theta* + one uncompressed round for g*
        self._star_bits = (search.bits_up + b * 32 * d, search.bits_down + b * 32 * d)

    def _centring_fingerprint(self):
        """What :math:`\\theta^\\star` and :math:`g^\\star` are computed from: the program of
        the clients' potentials and gradients (its lowered module, which shows the model as
        it reads now: :func:`numpyro_fed._programs.program_key`), the user's value and the
        search's options. ``None``: cannot be keyed (then found again at every ``init``)."""
        pot, data = self.potential, self.partition

        def target(t, data):
            return pot.full_grads(t, data), pot.server_grad(t), pot.potential(t, data)

        key = _programs.program_key(target, (jax.ShapeDtypeStruct((pot.dim,), pot.dtype),
                                             data))
        if key is None:
            return None
        user = self._theta_star_user
        user = None if user is None else jax.tree.map(
            lambda v: (np.shape(v), np.asarray(v).tobytes()), user)
        try:
            hash(extra := (repr(user), repr(sorted(self.theta_star_kwargs.items()))))
        except TypeError:
            return None
        return key, extra

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        if self.variant == "*":
            # found once, and again when what it is computed from changed (never stale)
            fp = self._centring_fingerprint()
            if self.theta_star is None or fp is None or fp != self._star_fingerprint:
                self._prepare_theta_star(rng_key)
                self._star_fingerprint = fp
        return super().init(rng_key, num_warmup, init_params, model_args, model_kwargs)

    # -- algorithm ---------------------------------------------------------------------
    @property
    def _uses_zeta(self) -> bool:
        return self.variant == "++" and self.batch_size is not None

    def init_extra(self, key, x, data):
        b, d = data.num_clients, x.shape[0]
        empty = jnp.zeros((0,), x.dtype)
        mem = self.memory_rate > 0
        extra = QLSDExtra(
            eta_clients=jnp.zeros((b, d), x.dtype) if mem else empty,
            eta=jnp.zeros((d,), x.dtype) if mem else empty,
            zeta=x if self._uses_zeta else empty,
            grad_zeta=jnp.zeros((b, d), x.dtype) if self._uses_zeta else empty,
            refreshes=jnp.zeros((), jnp.int32),
            participants=jnp.ones((b,), bool) if self.participation < 1.0 else (),
        )
        up, down = self._star_bits
        return extra, up, down + self.broadcast_bits(data)

    def estimator(self) -> estimators.GradientEstimator:
        """The client oracle :math:`H_i` of this variant
        (:mod:`numpyro_fed.algorithms.estimators`): QLSD#'s plain (or custom) oracle,
        QLSD*'s fixed control variate at :math:`\\theta^\\star` (available after ``init``),
        QLSD++'s SVRG control point."""
        if self.variant == "*" and self.theta_star is None:
            raise RuntimeError("QLSD*: theta* is found at `init`; run the kernel first.")
        return estimators.for_variant(
            self.variant, self.batch_size, refresh_every=self.refresh_every,
            theta_star=self.theta_star, grad_star=self._grads_star, g_star=self.g_star,
            oracle=self._custom_oracle)

    def step(self, key, noise_key, i, x, extra, data):
        """One round ([VPD+22]_ Alg. 1-2): the client half (the estimator of
        :mod:`numpyro_fed.algorithms.estimators` and
        :func:`~numpyro_fed.algorithms.qlsd.client_message`) on all clients at once, each
        client's compression ``vmap``-ed, and the server half
        (:func:`~numpyro_fed.algorithms.qlsd.server_aggregate`,
        :func:`~numpyro_fed.algorithms.qlsd.server_move`). With ``participation < 1`` only
        the clients of the round's mask
        (:func:`~numpyro_fed.algorithms.participation.participation_mask`) send;
        QLSD++'s control variates :math:`\\nabla U_i(\\zeta_k)` are deterministic, so a client
        absent at a refresh computes the same value when it next takes part."""
        est, alpha = self.estimator(), self.memory_rate
        oracle = estimators.StackedClients(self.potential, data)
        k_batch, k_comp = random.split(key)
        mask = None
        if self.participation < 1.0:
            mask = participation_mask(key, self.participation, data.num_clients)
        est_state = ()
        if est.refresh_every is not None:  # QLSD++ with minibatches: the control point
            est_state = est.step_state(
                oracle, i, x, estimators.SVRGState(extra.zeta, extra.grad_zeta, extra.refreshes))
            extra = extra._replace(zeta=est_state.zeta, grad_zeta=est_state.grad_zeta,
                                   refreshes=est_state.refreshes)
        h = est.estimate(oracle, k_batch, x, est_state)
        decoded, up = self.compress_all(k_comp, core.client_message(h, extra.eta_clients, alpha),
                                        mask=mask)
        g, eta = core.server_aggregate(decoded, extra.eta, alpha, mask)
        applied = decoded if mask is None else jnp.where(mask[:, None], decoded, 0.0)
        extra = extra._replace(eta_clients=core.client_commit(extra.eta_clients, applied, alpha),
                               eta=eta)
        x_new = core.server_move(noise_key, x, g, est.offset, self.potential.server_grad(x),
                                 self._step_size)
        if mask is None:
            return x_new, extra, up, self.broadcast_bits(data)
        down = self.count_clients_bits(mask, 32 * self.potential.dim)
        return x_new, extra._replace(participants=mask), up, down

    def _display_name(self) -> str:
        return f"QLSD{self.variant}"

    def get_diagnostics_str(self, state):
        base = super().get_diagnostics_str(state)
        return f"QLSD{self.variant} ({self.compressor.name}). {base}"


def _fixed_variant_init(variant: str):
    def __init__(self, model, partition, **kwargs):
        if "variant" in kwargs:
            raise ValueError(f"{type(self).__name__} fixes variant={variant!r}.")
        QLSD.__init__(self, model, partition, variant=variant, **kwargs)

    return __init__


class QLSDSharp(QLSD):
    """QLSD# ([VPD+22]_ Alg. 1 with the minibatch oracle): ``QLSD(..., variant="#")``."""

    __init__ = _fixed_variant_init("#")


class QLSDStar(QLSD):
    """QLSD* ([VPD+22]_ Alg. 2, fixed control variate at :math:`\\theta^\\star`):
    ``QLSD(..., variant="*")``."""

    __init__ = _fixed_variant_init("*")


class QLSDPlusPlus(QLSD):
    """QLSD++ ([VPD+22]_ Alg. 2, SVRG control point every ``l`` steps and memory):
    ``QLSD(..., variant="++")``."""

    __init__ = _fixed_variant_init("++")


def LSD(model: Callable, partition: ClientPartition, *, variant: str = "#", **kwargs) -> QLSD:
    """The uncompressed baselines LSD# / LSD* / LSD++: :class:`QLSD` with the identity
    compressor (32-bit floats on the uplink)."""
    for name in ("compressor", "bits", "levels"):
        if kwargs.get(name) is not None:
            raise ValueError(f"LSD uses the identity compressor; do not pass `{name}`.")
    return QLSD(model, partition, variant=variant, compressor=identity(), **kwargs)
