"""QLSD*'s federated search for :math:`\\theta^\\star` as an ``(init, update)`` pair.

QLSD* (Vono et al. 2022, Alg. 2) centres its control variates at a point :math:`\\theta^\\star`
near the minimiser of :math:`U = U_0 + \\sum_i U_i`. Without a user-given point it is found by
full-gradient descent, one communication round per gradient evaluation: the server broadcasts
:math:`\\theta` and every client returns :math:`\\nabla U_i(\\theta)`. Two optimisers, in the
style of Optax's ``(init, update)`` pairs with a state NamedTuple:

* ``"bb"`` -- Barzilai--Borwein step sizes (Barzilai & Borwein 1988, the "long" step
  :math:`s^\\top s / s^\\top y`), gradients only, robust in float32; the first step moves by
  :math:`10^{-3}\\max(1, \\|x\\|)`;
* ``"adam"`` -- Adam (Kingma & Ba 2015) with step size ``learning_rate``.

The search stops when :math:`\\|\\nabla U\\| \\le` ``gtol`` :math:`\\cdot\\max(1, \\|\\nabla
U(x_0)\\|)`, after ``maxiter`` updates, or at a non-finite gradient (:func:`keep_going`).
The in-process kernel drives it in a ``lax.while_loop``
(:func:`~numpyro_fed.kernels.qlsd.find_theta_star`) and the Flower server in a Python loop of
rounds; both call the same :func:`update`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["METHODS", "SearchState", "ThetaStarSearch", "init", "update", "keep_going",
           "tolerance", "converged", "centring"]

#: The gradient-only optimisers of the search (``"bfgs"`` also needs potential values and is
#: in-process only).
METHODS = ("bb", "adam")

_B1, _B2, _EPS = 0.9, 0.999, 1e-8


class SearchState(NamedTuple):
    """State of the search at iterate ``x`` (whose gradient ``g`` the clients just sent).

    - **k** -- number of updates so far.
    - **x**, **g** -- current point and :math:`\\nabla U(x)`.
    - **x_prev**, **g_prev** -- previous point and gradient (BB).
    - **m**, **v** -- Adam's moment estimates.
    """

    k: jax.Array
    x: jax.Array
    g: jax.Array
    x_prev: jax.Array
    g_prev: jax.Array
    m: jax.Array
    v: jax.Array


class ThetaStarSearch(NamedTuple):
    """Communication and outcome of QLSD*'s federated search for :math:`\\theta^\\star`.

    - **method** -- ``"bb"``, ``"adam"``, ``"bfgs"`` or ``"user"`` (given by the user: no search).
    - **rounds** -- communication rounds of the search (one per gradient evaluation).
    - **bits_up** / **bits_down** -- bits of the search, uplink (summed over clients) and
      downlink (broadcasts to all clients).
    - **grad_norm** -- :math:`\\|\\nabla U(\\theta^\\star)\\|` at the point found.
    - **converged** -- whether the optimiser met its tolerance.
    """

    method: str
    rounds: int
    bits_up: int
    bits_down: int
    grad_norm: float
    converged: bool


def init(x0: jax.Array, g0: jax.Array) -> SearchState:
    """The search state at :math:`x_0` with gradient :math:`g_0 = \\nabla U(x_0)`."""
    z = jnp.zeros_like(x0)
    return SearchState(jnp.zeros((), jnp.int32), x0, g0, x0, g0, z, z)


def update(method: str, state: SearchState, learning_rate: float = 1e-2) -> SearchState:
    """One optimiser step from ``state``: the new point, with its gradient field still the
    old one (the caller evaluates :math:`\\nabla U` at the new ``x`` -- one round -- and
    stores it with ``state._replace(g=...)``)."""
    k, x, g = state.k, state.x, state.g
    if method == "bb":
        s, y = x - state.x_prev, g - state.g_prev
        sy = jnp.vdot(s, y)
        gnorm = jnp.linalg.norm(g)
        first = 1e-3 * jnp.maximum(1.0, jnp.linalg.norm(x)) / jnp.maximum(gnorm, 1e-30)
        lr = jnp.where((k > 0) & (sy > 0), jnp.vdot(s, s) / jnp.where(sy > 0, sy, 1.0), first)
        return state._replace(k=k + 1, x=x - lr * g, x_prev=x, g_prev=g)
    if method == "adam":
        m = _B1 * state.m + (1 - _B1) * g
        v = _B2 * state.v + (1 - _B2) * g**2
        t = (k + 1).astype(x.dtype)
        x_new = x - learning_rate * (m / (1 - _B1**t)) / (jnp.sqrt(v / (1 - _B2**t)) + _EPS)
        return state._replace(k=k + 1, x=x_new, m=m, v=v)
    raise ValueError(f"Unknown theta* search `method`={method!r}; use one of {METHODS}.")


def tolerance(gtol: float, g0_norm):
    """The stopping tolerance :math:`\\text{gtol}\\cdot\\max(1, \\|\\nabla U(x_0)\\|)`."""
    return gtol * jnp.maximum(1.0, g0_norm)


def keep_going(state: SearchState, tol, maxiter: int):
    """Whether to take another step: fewer than ``maxiter`` updates, gradient norm above
    ``tol`` and finite."""
    gnorm = jnp.linalg.norm(state.g)
    return (state.k < maxiter) & (gnorm > tol) & jnp.isfinite(gnorm)


def converged(g_final: float, g_start: float, gtol: float) -> bool:
    """The search's verdict: a finite final gradient norm within the tolerance."""
    return bool(np.isfinite(g_final) and g_final <= gtol * max(1.0, g_start) * 1.0001)


def centring(grads: jax.Array, server_grad: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """QLSD*'s server offset from the clients' gradients at :math:`\\theta^\\star`.

    :param grads: :math:`(\\nabla U_i(\\theta^\\star))_i`, shape ``(b, d)``.
    :param server_grad: :math:`\\nabla U_0(\\theta^\\star)`, shape ``(d,)``.
    :return: ``(g_star, grad_norm, scale)``: :math:`g^\\star = \\sum_i \\nabla
        U_i(\\theta^\\star)` (Vono et al. 2022, Alg. 2), :math:`\\|g^\\star + \\nabla
        U_0\\|` (how far :math:`\\theta^\\star` is from a minimiser) and the norm of all the
        clients' gradients (the scale it is judged against). The kernel and the Flower server
        both call it under ``jax.jit`` (one program, not one per operation).
    """
    g_star = jnp.sum(grads, 0)
    return g_star, jnp.linalg.norm(g_star + server_grad), jnp.sqrt(jnp.sum(grads**2))
