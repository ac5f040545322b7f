"""Shared machinery of the kernels: chain vectorisation, divergence checks, Langevin moves.

NumPyro's ``MCMC(..., chain_method="vectorized")`` hands a kernel a *batch* of keys at
``init`` and expects the kernel to vectorise itself (as :class:`~numpyro.infer.hmc.HMC`
does). Our kernels vmap a single-chain step over the leading chain axis of every state field
except those declared *shared*: the iteration counter (so that schedules such as QLSD++'s
every-``l``-steps refresh stay a real ``lax.cond`` instead of a select that computes both
branches) and the client data.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from numpyro.util import is_prng_key

from numpyro_fed.algorithms.langevin import langevin_move  # noqa: F401  (re-exported)

__all__ = [
    "split_chain_keys",
    "check_step_size",
    "langevin_move",
    "raise_if_nonfinite",
    "DivergenceError",
]


class DivergenceError(FloatingPointError):
    """A chain left the finite numbers (usually: the step size is too large)."""


def split_chain_keys(rng_key) -> tuple[bool, Any]:
    """Return ``(vectorized, keys)``: a single key, or a batch of per-chain keys."""
    if is_prng_key(rng_key):
        return False, rng_key
    return True, rng_key


def chain_keys_list(keys) -> list:
    """Per-chain keys of a batch as a Python list (init time only)."""
    return [keys[c] for c in range(keys.shape[0])]


def check_step_size(step_size, name: str = "step_size") -> float:
    """Validate a positive, finite step size."""
    try:
        value = float(step_size)
    except (TypeError, ValueError) as err:
        raise TypeError(f"`{name}` must be a positive number, got {step_size!r}.") from err
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be positive and finite, got {step_size!r}.")
    return value


def _raise_divergence(bad, iteration, message):
    if bool(np.any(bad)):
        it = int(np.max(np.asarray(iteration)))
        raise DivergenceError(message.format(iteration=it))


def raise_if_nonfinite(x, iteration, message: str) -> None:
    """Stop the run with a :class:`DivergenceError` as soon as ``x`` is not finite.

    The host callback runs only on the branch taken when a non-finite value appears, so the
    cost on the hot path is one reduction and one predicate per step. The predicate is
    :math:`\\sum_k 0\\cdot x_k \\ne 0`, which holds exactly when some :math:`x_k` is NaN or
    infinite (``0 * inf`` is NaN); XLA on CPU compiles it to one fewer unfused operation than
    ``~all(isfinite(x))``. ``message`` may use ``{iteration}``.
    """
    bad = jnp.sum(x * jnp.zeros((), jnp.result_type(x))) != 0

    def _report():
        io_callback(lambda b, i: _raise_divergence(b, i, message), None, bad, iteration)

    lax.cond(bad, _report, lambda: None)
