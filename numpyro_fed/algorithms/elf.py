"""ELF's client and server halves as pure functions (Karagulyan & Richtárik 2023, Alg. 1-3).

One round of D-ELF (EF21 on the uplink), P-ELF (EF21-P on the downlink) or B-ELF (both), in the
order of Algorithm 3 (sum convention :math:`U = U_0 + \\sum_i U_i`, see
:mod:`numpyro_fed.kernels.elf`):

.. math::

    \\text{server}:&\\quad x_{k+1} = x_k - \\gamma[\\nabla U_0(x_k) + g_k] + \\sqrt{2\\gamma}Z_k,
    \\qquad w_{k+1} = w_k + \\mathcal{Q}^P(x_{k+1} - w_k) \\;(\\text{P, B; D: } w = x) \\\\
    \\text{client } i:&\\quad c_i = \\mathcal{Q}^D(H_i(w_{k+1}) - g^i_k),\\quad
    g^i_{k+1} = g^i_k + c_i \\;(\\text{D, B; P: } g^i_{k+1} = H_i(w_{k+1}) \\text{ dense}) \\\\
    \\text{server}:&\\quad g_{k+1} = g_k + \\textstyle\\sum_i c_i \\;(\\text{P: }
    \\textstyle\\sum_i g^i_{k+1})

With partial participation only the senders' corrections are applied (no reweighting: error
feedback absorbs the missing updates, and :math:`g = \\sum_i g^i` keeps holding).

As in :mod:`numpyro_fed.algorithms.qlsd`, the client functions serve one client or a stack of
clients, and the server half takes the decoded messages as a ``(b, d)`` array (zero rows for
absent clients), in process (:class:`~numpyro_fed.kernels.elf.ELF`) and deployed
(:mod:`numpyro_fed.flower`) alike.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.algorithms.langevin import langevin_move

__all__ = ["ELFServerState", "server_move", "downlink_message", "shadow_update",
           "client_message", "client_commit", "server_aggregate"]


class ELFServerState(NamedTuple):
    """What the ELF server keeps: **g** -- its estimator :math:`g_k` ``(d,)``; **w** -- the
    shadow model :math:`w_k` the clients hold (P-/B-ELF; :math:`x_k` for D-ELF)."""

    g: jax.Array
    w: jax.Array


def server_move(key: jax.Array, x: jax.Array, g: jax.Array, server_grad: jax.Array,
                step_size: float) -> jax.Array:
    """:math:`x_{k+1} = x_k - \\gamma[\\nabla U_0(x_k) + g_k] + \\sqrt{2\\gamma}Z_k`."""
    return langevin_move(key, x, server_grad + g, step_size)


def downlink_message(x_new: jax.Array, w: jax.Array) -> jax.Array:
    """The vector the server compresses for the EF21-P broadcast: :math:`x_{k+1} - w_k`."""
    return x_new - w


def shadow_update(w: jax.Array, decoded: jax.Array) -> jax.Array:
    """:math:`w + \\mathcal{Q}^P(\\cdot)`: the same float32 addition on the server and on every
    client (so that their shadow models are equal bit for bit)."""
    return w + decoded


def client_message(h: jax.Array, g_local: jax.Array, error_feedback: bool) -> jax.Array:
    """The vector client :math:`i` sends: :math:`H_i(w_{k+1}) - g^i_k` (D-, B-ELF, to be
    compressed) or :math:`H_i(w_{k+1})` (P-ELF, dense)."""
    return h - g_local if error_feedback else h


def client_commit(g_local: jax.Array, decoded: jax.Array, error_feedback: bool) -> jax.Array:
    """The client's estimator after the server applied its message:
    :math:`g^i + c_i` (EF21) or the dense gradient it sent (P-ELF)."""
    return g_local + decoded if error_feedback else decoded


def server_aggregate(g: jax.Array, decoded: jax.Array, error_feedback: bool,
                     table: jax.Array | None = None,
                     mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """The server's new estimator :math:`g_{k+1}`.

    :param g: :math:`g_k`.
    :param decoded: ``(b, d)`` decoded messages (zero rows for absent clients).
    :param error_feedback: D-/B-ELF (``True``: add the corrections) or P-ELF (``False``:
        dense gradients replace the clients' last ones).
    :param table: P-ELF: ``(b, d)`` the last dense gradient of every client (the server's
        copy of the :math:`g^i`); ignored otherwise.
    :param mask: ``(b,)`` booleans of the applied messages; ``None``: all.
    :return: ``(g_{k+1}, table)`` (P-ELF's updated table, else ``table`` unchanged).
    """
    if error_feedback:
        c = decoded if mask is None else jnp.where(mask[:, None], decoded, 0.0)
        return g + jnp.sum(c, axis=0), table
    if mask is None:
        return jnp.sum(decoded, axis=0), decoded
    new = jnp.where(mask[:, None], decoded, table)
    return g + jnp.sum(new - table, axis=0), new
