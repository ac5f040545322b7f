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
from typing import Any

import jax.numpy as jnp
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.algorithms import estimators
from numpyro_fed.algorithms import qlsd as core
from numpyro_fed.algorithms.federated import AlgorithmState, FederatedAlgorithm
from numpyro_fed.algorithms.participation import check_participation, warn_if_many_empty_rounds
from numpyro_fed.algorithms.theta_star import ThetaStarSearch
from numpyro_fed.algorithms.variants import canonical_variant, spellings
from numpyro_fed.compressors import Compressor, identity, quantize
from numpyro_fed.kernels.driver import (
    AlgorithmKernel,
    centring_at,
    check_theta_star,
    find_theta_star,
    user_point,
)
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
    "centring_at",
]

#: Accepted spellings of the three variants (lower case), mapped to their canonical names;
#: read from the package's one variant table, :data:`numpyro_fed.algorithms.variants.VARIANTS`.
VARIANTS: dict[str, str] = spellings("qlsd")


class QLSDExtra(AlgorithmState):
    """Per-chain algorithm state of :class:`QLSD` (``FedState.extra``): an
    :class:`~numpyro_fed.algorithms.federated.AlgorithmState` whose ``clients`` are
    :class:`~numpyro_fed.algorithms.qlsd.QLSDClientState` (stacked) and ``server`` a
    :class:`~numpyro_fed.algorithms.qlsd.QLSDServerState`, with the names of the paper:

    - **eta_clients** -- client memory terms :math:`\\eta^{(i)}_k`, shape ``(b, d)`` (``(0,)``
      without memory).
    - **eta** -- server memory :math:`\\eta_k = \\sum_i \\eta^{(i)}_k`, shape ``(d,)``.
    - **zeta** -- QLSD++ control point :math:`\\zeta_k`, shape ``(d,)``.
    - **grad_zeta** -- :math:`\\nabla U_i(\\zeta_k)` held by each client, shape ``(b, d)``.
    - **refreshes** -- number of QLSD++ control-point refreshes so far (int32).
    - **participants** -- with ``participation < 1``: boolean ``(b,)`` mask of the clients
      that took part in the last round; ``()`` otherwise.
    """

    __slots__ = ()

    @property
    def eta_clients(self):
        return self.clients.eta

    @property
    def eta(self):
        return self.server.eta

    def _svrg(self, name):
        est = self.clients.estimator
        if not isinstance(est, estimators.SVRGState):
            raise AttributeError(f"QLSDExtra has no {name!r}: only QLSD++ with minibatches "
                                 "keeps a control point")
        return getattr(est, name)

    @property
    def zeta(self):
        return self._svrg("zeta")

    @property
    def grad_zeta(self):
        return self._svrg("grad_zeta")

    @property
    def refreshes(self):
        if not isinstance(self.clients.estimator, estimators.SVRGState):
            # no control point: never refreshed (zeros over the chains' axes)
            return jnp.zeros(jnp.shape(self.server.eta)[:-1], jnp.int32)
        return self._svrg("refreshes")


class QLSD(AlgorithmKernel):
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
    extra_type = QLSDExtra

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
        FederatedKernel.__init__(
            self, model, partition, step_size=step_size, batch_size=batch_size,
            compressor=compressor, init_strategy=init_strategy, **kwargs,
        )
        warn_if_many_empty_rounds(self.participation, partition.num_clients)
        self.theta_star_kwargs = dict(theta_star_kwargs or {})
        self._custom_oracle = oracle
        self._theta_star_user = theta_star
        self.refresh_every = refresh_every
        self.memory_rate = memory_rate
        self._alg_key = None
        alg = self._build_algorithm(warn_stacklevel=3)
        self.memory_rate = alg.description["options"]["memory_rate"]
        self.refresh_every = alg.description["options"]["refresh_every"]
        self._alg_key = self._algorithm_key()
        comp = self.compressor
        self.omega = float(comp.omega(self.potential.dim))
        self._init_setup()
        if theta_star is not None:
            user_point(self.potential, theta_star)  # refuse a bad centring point now

    # -- the algorithm value --------------------------------------------------------------
    def _algorithm_key(self) -> tuple:
        return (self.variant, self._step_size, self.batch_size, id(self.compressor),
                self.memory_rate, self.refresh_every, self.participation,
                id(self._custom_oracle), id(self._theta_star_user),
                repr(sorted(self.theta_star_kwargs.items())))

    def _build_algorithm(self, warn_stacklevel: int = 2) -> FederatedAlgorithm:
        kw = dict(self.theta_star_kwargs)
        names = {"method": "theta_star_method", "maxiter": "theta_star_maxiter",
                 "gtol": "theta_star_gtol", "learning_rate": "theta_star_lr"}
        unknown = sorted(set(kw) - set(names))
        if unknown:
            raise TypeError(f"`theta_star_kwargs` has unknown options {unknown}; use "
                            f"{sorted(names)}.")
        search = {names[k]: v for k, v in kw.items()}
        alg = core.algorithm(
            self.variant, step_size=self._step_size, compressor=self.compressor,
            memory_rate=self.memory_rate, refresh_every=self.refresh_every,
            batch_size=self.batch_size, participation=self.participation,
            theta_star=self._theta_star_user, oracle=self._custom_oracle,
            dim=self.potential.dim, warn_stacklevel=warn_stacklevel + 1,
            **(search if self.variant == "*" else {}))
        self._alg, self._alg_key = alg, self._algorithm_key()
        return alg

    @property
    def algorithm(self) -> FederatedAlgorithm:
        """The :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` this kernel runs,
        :func:`numpyro_fed.algorithms.qlsd.algorithm` of its options (built again, without
        warnings, if an option was changed since)."""
        if self._alg_key != self._algorithm_key():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._build_algorithm()
        return self._alg

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

    def _display_name(self) -> str:
        return f"QLSD{self.variant}"

    def get_diagnostics_str(self, state):
        base = FederatedKernel.get_diagnostics_str(self, state)
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
