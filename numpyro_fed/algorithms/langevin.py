"""The Langevin move and the MALA acceptance ratio: the one copy used by every kernel.

All are pure functions on arrays. The kernels (:mod:`numpyro_fed.kernels.langevin`,
:mod:`numpyro_fed.kernels.qlsd`, :mod:`numpyro_fed.kernels.elf`), the Flower deployment, the
MCMC-SAEM E-step (:mod:`numpyro_fed.saem.estep`) and the annealed importance sampler of
:mod:`numpyro_fed.saem.likelihood` call them. The E-step moves each subject's block of random
effects with its own step size and preconditioner (a :class:`Preconditioner` from
:func:`block_preconditioner`) and applies the ratio per block, by passing whitened forward
and backward residuals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import random

__all__ = [
    "Preconditioner",
    "block_preconditioner",
    "langevin_move",
    "langevin_noise",
    "langevin_proposal",
    "mala_log_ratio",
    "mala_sq_residuals",
]


class Preconditioner(NamedTuple):
    """A preconditioner :math:`M = LL^\\top` given by the products with its factor.

    - **mul_L** -- :math:`v \\mapsto Lv`.
    - **mul_Lt** -- :math:`v \\mapsto L^\\top v`.
    """

    mul_L: Callable[[jax.Array], jax.Array]
    mul_Lt: Callable[[jax.Array], jax.Array]


def block_preconditioner(L: jax.Array, full: bool) -> Preconditioner:
    """Per-block factors :math:`L_i` applied to vectors of shape ``(C, n, q)`` (``C`` chains,
    ``n`` blocks of ``q`` coordinates).

    :param L: ``(n, q, q)`` lower-triangular factors (``full``), or ``(n, q)`` square roots of
        diagonal preconditioners.
    :param full: whether ``L`` holds full factors.
    """
    if full:
        return Preconditioner(lambda v: jnp.einsum("nij,cnj->cni", L, v),
                              lambda v: jnp.einsum("nji,cnj->cni", L, v))
    return Preconditioner(lambda v: L * v, lambda v: L * v)


def langevin_noise(key: jax.Array, x: jax.Array) -> jax.Array:
    """The standard normal :math:`Z` of one Langevin move from ``x`` (its shape and dtype)."""
    return random.normal(key, jnp.shape(x), dtype=jnp.result_type(x))


def langevin_proposal(x: jax.Array, grad: jax.Array, step_size, noise: jax.Array,
                      precond: Preconditioner | None = None) -> jax.Array:
    """One Euler--Maruyama step of the (preconditioned) overdamped Langevin diffusion for a
    given noise :math:`Z`,

    .. math::

        x - \\gamma M g + \\sqrt{2\\gamma}\\, L Z, \\qquad M = LL^\\top

    (:math:`L = I` when ``precond`` is ``None``): Vono, Plassier, Durmus, Dieuleveut &
    Moulines (2022), QLSD, Algorithm 1, last line; Karagulyan & Richtárik (2023), ELF,
    eq. (2); the ULA/MALA proposal of Roberts & Tweedie (1996), which the MCMC-SAEM E-step
    applies per subject. ``step_size`` may be an array broadcastable to ``x`` (a
    per-coordinate or per-block step).
    """
    if precond is None:
        return x - step_size * grad + jnp.sqrt(2.0 * step_size) * noise
    return (x - step_size * precond.mul_L(precond.mul_Lt(grad))
            + jnp.sqrt(2.0 * step_size) * precond.mul_L(noise))


def langevin_move(key: jax.Array, x: jax.Array, grad: jax.Array, step_size,
                  precond: Preconditioner | None = None) -> jax.Array:
    """One Langevin move from ``x``: :func:`langevin_proposal` with the noise
    :func:`langevin_noise` draws from ``key``."""
    return langevin_proposal(x, grad, step_size, langevin_noise(key, x), precond)


def mala_log_ratio(u_x, u_y, fwd_sq, bwd_sq, step_size):
    """Log Metropolis--Hastings ratio of a MALA proposal (Roberts & Tweedie 1996; Gruffaz et al.

    .. math::

        \\log\\alpha = U(x) - U(y) + \\frac{\\lVert r_{\\to}\\rVert^2 -
        \\lVert r_{\\leftarrow}\\rVert^2}{4\\gamma},

    where :math:`r_{\\to} = L^{-1}(y - x) + \\gamma L^\\top\\nabla U(x)` and
    :math:`r_{\\leftarrow} = L^{-1}(x - y) + \\gamma L^\\top\\nabla U(y)` are the whitened
    forward and backward residuals of the proposal
    :math:`y = x - \\gamma M\\nabla U(x) + \\sqrt{2\\gamma}LZ` with :math:`M = LL^\\top`
    (:math:`L = I`: the plain MALA). ``fwd_sq``/``bwd_sq`` are their squared norms (per block
    for a blocked test); NaN ratios (a proposal outside the support) become :math:`-\\infty`.
    """
    lr = u_x - u_y + (fwd_sq - bwd_sq) / (4.0 * step_size)
    return jnp.where(jnp.isnan(lr), -jnp.inf, lr)


def mala_sq_residuals(x, y, grad_x, grad_y, step_size):
    """Squared norms of the forward and backward residuals of a plain (:math:`L = I`) MALA
    proposal :math:`y` from :math:`x`, the ``fwd_sq``/``bwd_sq`` of :func:`mala_log_ratio`:
    :math:`\\lVert y - x + \\gamma\\nabla U(x)\\rVert^2` and
    :math:`\\lVert x - y + \\gamma\\nabla U(y)\\rVert^2` (``grad_*`` are gradients of the
    potential :math:`U`, not of the log-density)."""
    fwd = y - x + step_size * grad_x
    bwd = x - y + step_size * grad_y
    return jnp.sum(fwd**2), jnp.sum(bwd**2)
