"""The Langevin move and the MALA acceptance ratio: the one copy used by every kernel.

Both are pure functions on arrays. The kernels (:mod:`numpyro_fed.kernels.langevin`) and the
MCMC-SAEM E-step (:mod:`numpyro_fed.saem.estep`) call them; the E-step applies the ratio per
block (one subject's random effects) with a per-block step size and preconditioner, by
passing whitened forward and backward residuals.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import random

__all__ = ["langevin_move", "mala_log_ratio"]


def langevin_move(key, x, grad, step_size):
    """One Euler--Maruyama step of the overdamped Langevin diffusion,
    :math:`x - \\gamma g + \\sqrt{2\\gamma} Z` (Vono et al. 2022, Alg. 1, last line;
    Karagulyan & Richtárik 2023, eq. (2); the ULA/MALA proposal of Gruffaz et al. 2024,
    Sec. 2.3). ``step_size`` may be an array
    broadcastable to ``x`` (a per-coordinate step, i.e. a diagonal preconditioner)."""
    noise = random.normal(key, jnp.shape(x), dtype=jnp.result_type(x))
    return x - step_size * grad + jnp.sqrt(2.0 * step_size) * noise


def mala_log_ratio(u_x, u_y, fwd_sq, bwd_sq, step_size):
    """Log Metropolis--Hastings ratio of a MALA proposal (Roberts & Tweedie 1996; Gruffaz et al.
    2024, Sec. 2.3):

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
