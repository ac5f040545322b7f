"""QLSD's client and server halves as pure functions (Vono et al. 2022, Alg. 1 and Alg. 2).

One round of every QLSD variant, with the client oracle :math:`H_i` of the variant given by a
:class:`~numpyro_fed.algorithms.estimators.GradientEstimator` and memory rate
:math:`\\alpha`:

.. math::

    \\text{client } i:&\\quad g_i = \\mathcal{C}\\big(H_i(\\theta_k) - \\eta^{(i)}_k\\big),
    \\qquad \\eta^{(i)}_{k+1} = \\eta^{(i)}_k + \\alpha g_i \\\\
    \\text{server}:&\\quad g = \\eta_k + \\textstyle\\sum_i g_i, \\qquad
    \\eta_{k+1} = \\eta_k + \\alpha \\textstyle\\sum_i g_i, \\qquad
    \\theta_{k+1} = \\theta_k - \\gamma\\,[g + c + \\nabla U_0(\\theta_k)]
    + \\sqrt{2\\gamma}\\,Z_{k+1}

(text of Sec. 2 and Table 1; the pseudo-code of Alg. 2 swaps the "QLSD*" / "QLSD++" labels of
the memory update). With partial participation the server applies the ratio weights
:math:`b/|S_k|` to the received messages and only the senders update their memory
(:mod:`numpyro_fed.algorithms.participation`).

The functions are written for one client *or* a stack of clients (a leading axis ``b``):
the in-process kernel (:class:`~numpyro_fed.kernels.qlsd.QLSD`) applies
:func:`client_message` / :func:`client_commit` to all clients at once and the compressor
``vmap``-ed over them; a deployed client (:mod:`numpyro_fed.flower`) calls them on its own
arrays and its wire codec. The server half (:func:`server_aggregate`, :func:`server_move`)
takes the decoded messages as a ``(b, d)`` array with zero rows for the clients that sent
nothing, in process and deployed alike, so both sum in the same order.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.algorithms.langevin import langevin_move
from numpyro_fed.algorithms.participation import ratio_weights

__all__ = ["QLSDClientState", "client_message", "client_commit", "server_aggregate",
           "server_move"]


class QLSDClientState(NamedTuple):
    """What a QLSD client keeps between rounds (``(d,)`` leaves for one client, ``(b, d)``
    stacked).

    - **eta** -- memory term :math:`\\eta^{(i)}_k` (shape ``(0,)`` without memory).
    - **estimator** -- the gradient estimator's state (QLSD++:
      :class:`~numpyro_fed.algorithms.estimators.SVRGState`; ``()`` otherwise).
    """

    eta: jax.Array
    estimator: Any


def client_message(h: jax.Array, eta: jax.Array, memory_rate: float) -> jax.Array:
    """The vector client :math:`i` compresses: :math:`H_i - \\eta^{(i)}` with memory,
    :math:`H_i` without."""
    return h - eta if memory_rate > 0 else h


def client_commit(eta: jax.Array, decoded: jax.Array, memory_rate: float) -> jax.Array:
    """The client's memory after the server applied its message ``decoded``:
    :math:`\\eta^{(i)} + \\alpha\\, g_i` (unchanged without memory)."""
    return eta + memory_rate * decoded if memory_rate > 0 else eta


def server_aggregate(decoded: jax.Array, eta: jax.Array, memory_rate: float,
                     mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The server's gradient estimate :math:`g` and its new memory :math:`\\eta`.

    :param decoded: ``(b, d)`` decoded client messages :math:`g_i` (rows of absent clients:
        any finite value with ``mask``, zeros by convention).
    :param eta: the server memory :math:`\\eta_k = \\sum_i \\eta^{(i)}_k` (``(0,)`` without
        memory).
    :param memory_rate: :math:`\\alpha`.
    :param mask: ``(b,)`` booleans of the clients whose message is applied; ``None``: all,
        without reweighting.
    :return: ``(g, eta)``.
    """
    if mask is None:
        total = jnp.sum(decoded, 0)
        applied = decoded
    else:
        weights = ratio_weights(mask).astype(decoded.dtype)
        total = jnp.sum(weights[:, None] * decoded, 0)
        applied = jnp.where(mask[:, None], decoded, 0.0)
    if memory_rate > 0:
        return eta + total, eta + memory_rate * jnp.sum(applied, 0)
    return total, eta


def server_move(key: jax.Array, x: jax.Array, g: jax.Array, offset: Any,
                server_grad: jax.Array, step_size: float) -> jax.Array:
    """The Langevin move :math:`\\theta - \\gamma[g + c + \\nabla U_0(\\theta)] +
    \\sqrt{2\\gamma}Z` with the noise drawn from ``key``."""
    return langevin_move(key, x, g + offset + server_grad, step_size)
