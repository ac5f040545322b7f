"""Client gradient estimators :math:`H_i(\\theta)`: the QLSD variants as composable pieces.

Vono et al. (2022, AISTATS), "QLSD: Quantised Langevin Stochastic Dynamics for Bayesian
Federated Learning", Alg. 1 and Alg. 2, differ only in the oracle :math:`H_i` that client
:math:`i` evaluates at the broadcast :math:`\\theta_k` (and, for QLSD*, in a constant the server
adds). As BlackJAX's ``sgmcmc/gradients.py`` separates the gradient estimator from the
sampler, each variant here is a :class:`GradientEstimator`, an ``(init, refresh, estimate)``
triple of pure functions on arrays, with its own state NamedTuple:

* :func:`plain` -- QLSD# (Alg. 1): :math:`H_i = \\nabla U_i(\\theta)` (``batch_size=None``) or
  the minibatch oracle :math:`(N_i/n)\\sum_{j\\in S_i}\\nabla U_{ij}(\\theta)` (plus the client's
  exact prior share);
* :func:`fixed_control_variate` -- QLSD* (Alg. 2): :math:`H_i = (N_i/n)\\sum_{j\\in
  S_i}[\\nabla U_{ij}(\\theta) - \\nabla U_{ij}(\\theta^\\star)]` (or the exact difference
  :math:`\\nabla U_i(\\theta) - \\nabla U_i(\\theta^\\star)` without minibatches); the server adds
  :math:`g^\\star = \\sum_i\\nabla U_i(\\theta^\\star)` (:attr:`GradientEstimator.offset`);
* :func:`svrg` -- QLSD++ (Alg. 2): control point :math:`\\zeta` reset to :math:`\\theta_k` every
  ``refresh_every`` steps, :math:`H_i = (N_i/n)\\sum_{j\\in S_i}[\\nabla U_{ij}(\\theta) -
  \\nabla U_{ij}(\\zeta)] + \\nabla U_i(\\zeta)`;
* :func:`custom` -- any user oracle ``oracle(key, theta, data) -> H`` (Alg. 1 with any oracle
  satisfying H3).

**One client or all at once.** An estimator calls a :class:`ClientOracle`: the gradient
functions of the clients it serves. The in-process kernels pass
:class:`StackedClients` (all clients of a partition at once: every array gets a leading
client axis ``b``, and the minibatch rows of all clients come from one hash call, see
:func:`~numpyro_fed.minibatch.client_bits`); a deployed client (:mod:`numpyro_fed.flower`)
passes its own :class:`~numpyro_fed.algorithms.oracles.ClientProblem` (arrays of one client).
The estimator's arithmetic is elementwise in the client axis, so the same code is the client
half of both, with the same random words for client :math:`i`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "ClientOracle",
    "StackedClients",
    "GradientEstimator",
    "SVRGState",
    "plain",
    "fixed_control_variate",
    "svrg",
    "custom",
    "for_variant",
]


class ClientOracle(Protocol):
    """Gradient functions of one client or of a stack of clients (leading axis ``b``).

    ``batch_size`` is static; the minibatch key ``key`` is the step's batch key shared by all
    clients (client :math:`i` uses its own words of it)."""

    def full_grad(self, theta: jax.Array) -> jax.Array:
        """Exact :math:`\\nabla U_i(\\theta)`."""

    def batch_grad(self, key: jax.Array, theta: jax.Array, batch_size: int) -> jax.Array:
        """Minibatch :math:`(N_i/n)\\sum_{j\\in S_i}\\nabla U_{ij}(\\theta)` + prior share."""

    def batch_grad_diff(self, key: jax.Array, theta: jax.Array, zeta: jax.Array,
                        batch_size: int) -> jax.Array:
        """:math:`(N_i/n)\\sum_{j\\in S_i}[\\nabla U_{ij}(\\theta)-\\nabla U_{ij}(\\zeta)]` on
        one minibatch, plus the prior-share difference."""


class StackedClients(NamedTuple):
    """All clients of a partition as one :class:`ClientOracle` (arrays ``(b, d)``).

    :param potential: a :class:`~numpyro_fed.potential.FederatedPotential`.
    :param data: its :class:`~numpyro_fed.partition.ClientPartition` (a pytree: may be a
        traced state field).
    """

    potential: Any
    data: Any

    def full_grad(self, theta):
        return self.potential.full_grads(theta, self.data)

    def batch_grad(self, key, theta, batch_size):
        return self.potential.batch_grads(key, theta, self.data, batch_size)

    def batch_grad_diff(self, key, theta, zeta, batch_size):
        return self.potential.batch_grad_diffs(key, theta, zeta, self.data, batch_size)


class SVRGState(NamedTuple):
    """Client state of :func:`svrg` (QLSD++).

    - **zeta** -- control point :math:`\\zeta_k`, shape ``(d,)`` (the same on every client).
    - **grad_zeta** -- :math:`\\nabla U_i(\\zeta_k)`, shape ``(d,)`` for one client, ``(b, d)``
      stacked.
    - **refreshes** -- number of refreshes so far (int32).
    """

    zeta: jax.Array
    grad_zeta: jax.Array
    refreshes: jax.Array


class GradientEstimator(NamedTuple):
    """A client oracle :math:`H_i(\\theta)` of the QLSD family, as pure functions.

    - **init** ``(oracle, theta) -> state`` -- the estimator state at the chain's start.
    - **refresh** ``(oracle, point, state) -> state`` -- recentre the control variates at
      ``point`` (QLSD++'s :math:`\\zeta \\leftarrow \\theta_k`); identity for the others.
    - **estimate** ``(oracle, key, theta, state) -> H`` -- the oracle.
    - **refresh_every** -- the refresh period ``l`` (static), ``None`` if never.
    - **offset** -- the constant :math:`c` the server adds to the aggregate (QLSD*'s
      :math:`g^\\star`), ``0.0`` otherwise.
    """

    init: Callable[[ClientOracle, jax.Array], Any]
    refresh: Callable[[ClientOracle, jax.Array, Any], Any]
    estimate: Callable[[ClientOracle, jax.Array, jax.Array, Any], jax.Array]
    refresh_every: int | None = None
    offset: Any = 0.0

    def step_state(self, oracle: ClientOracle, step: jax.Array, theta: jax.Array,
                   state: Any) -> Any:
        """The state an in-process step ``step`` uses: refreshed at ``theta`` when
        ``step % refresh_every == 0``. The counter is shared by vectorized chains, so the
        ``lax.cond`` stays a real branch: the full local gradients are computed once every
        ``refresh_every`` steps, not every step."""
        if self.refresh_every is None:
            return state
        return lax.cond(step % self.refresh_every == 0,
                        lambda s: self.refresh(oracle, theta, s), lambda s: s, state)


def _no_state(oracle, theta):
    return ()


def _keep(oracle, point, state):
    return state


def plain(batch_size: int | None) -> GradientEstimator:
    """QLSD# (Vono et al. 2022, Alg. 1): the exact local gradient (``batch_size=None``) or
    the minibatch oracle."""

    def estimate(oracle, key, theta, state):
        if batch_size is None:
            return oracle.full_grad(theta)
        return oracle.batch_grad(key, theta, batch_size)

    return GradientEstimator(_no_state, _keep, estimate)


def fixed_control_variate(theta_star: jax.Array, grad_star: Any, g_star: jax.Array,
                          batch_size: int | None) -> GradientEstimator:
    """QLSD* (Vono et al. 2022, Alg. 2): control variates at a fixed :math:`\\theta^\\star`.

    :param theta_star: the centring point (flat, unconstrained).
    :param grad_star: :math:`\\nabla U_i(\\theta^\\star)` of the clients served (``(d,)`` for
        one client, ``(b, d)`` stacked); used only without minibatches.
    :param g_star: :math:`\\sum_i \\nabla U_i(\\theta^\\star)`, added by the server: with it
        :math:`\\sum_i H_i + g^\\star` is unbiased for :math:`\\nabla U(\\theta)` for *any*
        :math:`\\theta^\\star` (the paper sets it to 0, exact only at the minimiser).
    :param batch_size: ``None`` for exact local gradients.
    """

    def estimate(oracle, key, theta, state):
        if batch_size is None:
            return oracle.full_grad(theta) - grad_star
        return oracle.batch_grad_diff(key, theta, theta_star, batch_size)

    return GradientEstimator(_no_state, _keep, estimate, offset=g_star)


def svrg(batch_size: int | None, refresh_every: int) -> GradientEstimator:
    """QLSD++ (Vono et al. 2022, Alg. 2): SVRG control point :math:`\\zeta` refreshed every
    ``refresh_every`` steps. Each client computes :math:`\\nabla U_i(\\zeta)` from the
    :math:`\\theta_k` it has just received: the refresh costs computation, not communication.
    Without minibatches :math:`H_i = \\nabla U_i(\\theta)` exactly (the control variates
    cancel), and the estimator keeps no state."""
    if batch_size is None:
        return plain(None)

    def init(oracle, theta):
        proto = jax.eval_shape(oracle.full_grad, theta)
        return SVRGState(theta, jnp.zeros(proto.shape, proto.dtype), jnp.zeros((), jnp.int32))

    def refresh(oracle, point, state):
        return SVRGState(point, oracle.full_grad(point), state.refreshes + 1)

    def estimate(oracle, key, theta, state):
        return oracle.batch_grad_diff(key, theta, state.zeta, batch_size) + state.grad_zeta

    return GradientEstimator(init, refresh, estimate, refresh_every=refresh_every)


def custom(fn: Callable) -> GradientEstimator:
    """A user oracle ``fn(key, theta, data) -> H`` of shape ``(b, d)`` (QLSD# with any
    oracle satisfying the paper's H3), called with the client partition of a
    :class:`StackedClients` oracle (in process only: it sees every client's data)."""

    def estimate(oracle, key, theta, state):
        return fn(key, theta, oracle.data)

    return GradientEstimator(_no_state, _keep, estimate)


def for_variant(variant: str, batch_size: int | None, *, refresh_every: int = 100,
                theta_star: jax.Array | None = None, grad_star: Any = None,
                g_star: Any = 0.0, oracle: Callable | None = None) -> GradientEstimator:
    """The estimator of a QLSD variant (canonical code of
    :data:`numpyro_fed.algorithms.variants.VARIANTS`): ``"#"`` -> :func:`plain` (or
    :func:`custom` with a user ``oracle``), ``"*"`` -> :func:`fixed_control_variate` (needs
    ``theta_star``, and ``grad_star`` without minibatches), ``"++"`` -> :func:`svrg`. The
    in-process kernel and a deployed client choose their estimator here, with the same
    arguments (a client passes its own :math:`\\nabla U_i(\\theta^\\star)` and no
    :math:`g^\\star`, which the server adds)."""
    if variant == "#":
        return plain(batch_size) if oracle is None else custom(oracle)
    if variant == "*":
        if theta_star is None:
            raise ValueError("QLSD*'s estimator needs `theta_star` (found at the kernel's init).")
        return fixed_control_variate(theta_star, grad_star, g_star, batch_size)
    if variant == "++":
        return svrg(batch_size, refresh_every)
    raise ValueError(f"Unknown QLSD `variant`={variant!r}; use '#', '*' or '++'.")
