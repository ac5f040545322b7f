"""Partial participation of clients: who takes part in a round and how the server reweights.

The same definitions serve the in-process kernels (``QLSD(..., participation=p)``,
``ELF(..., participation=p)``) and the Flower deployment (:mod:`numpyro_fed.flower`), so a
deployment without faults reproduces the in-process chain.

**Who is asked.** In round :math:`k` each client is asked independently with probability
:math:`p`: :math:`m_i \\sim \\mathrm{Bernoulli}(p)` drawn from
``random.fold_in(k_alg, PARTICIPATION_SALT)``, where ``k_alg`` is the algorithm key of the
step (the third key of ``random.split(rng_key, 3)``). With ``p = 1`` no mask is drawn and the
kernels are unchanged. In a deployment, a client that is asked but does not answer in time,
or whose message is rejected, is absent too: :math:`S_k` = the clients whose message was
applied.

**Unbiased reweighting (QLSD-style kernels).** With :math:`|S_k| \\ge 1` the server uses the
ratio (Hájek) estimator

.. math:: \\widehat{\\textstyle\\sum_i} g_i = \\frac{b}{|S_k|} \\sum_{i \\in S_k} g_i ,

which is unbiased for :math:`\\sum_{i=1}^b g_i` conditionally on :math:`|S_k|` whenever
absence is independent of the messages (missing completely at random): given its size,
:math:`S_k` is a uniformly random subset (exactly so under Bernoulli sampling). Unlike the
Horvitz--Thompson weight :math:`1/p` it needs no knowledge of the drop-out rate, so the same
estimator serves sampled and faulty clients. A round with :math:`S_k = \\emptyset` contributes
no client term (the memory :math:`\\eta` and the server's prior share still apply). Memory
terms are updated only from messages that were applied, so :math:`\\eta = \\sum_i \\eta_i`
keeps holding.

**Empty rounds.** A round is empty with probability :math:`(1-p)^b`: it moves the chain by
the server's prior share, the memory term and the Langevin noise only. When this expected
fraction reaches :data:`EMPTY_ROUND_WARNING` (10%), the kernels and ``FlowerSpec`` warn
(:class:`UserWarning`, :func:`warn_if_many_empty_rounds`) with the fraction and the expected
number of empty rounds per 1000, and the smallest ``p`` that keeps it below 10%; they do not
refuse, since a run with sparse participation is valid, only inefficient.

**Error feedback (ELF).** No reweighting: an absent client's :math:`g_i` stays stale and
the server adds only the applied corrections, so :math:`g = \\sum_i g_i` keeps holding
(Karagulyan & Richtárik 2023, Sec. 2; EF21 with partial participation).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import random

from numpyro_fed._validation import check_probability

__all__ = [
    "EMPTY_ROUND_WARNING",
    "PARTICIPATION_SALT",
    "check_participation",
    "empty_round_fraction",
    "warn_if_many_empty_rounds",
    "participation_mask",
    "ratio_weights",
]

#: Folded into the step's algorithm key to draw the participation mask (so that ``p = 1``
#: leaves every other random number of the kernels unchanged).
PARTICIPATION_SALT = 0x5A4D


def check_participation(participation: float) -> float:
    """Validate a participation probability ``0 < p <= 1``.

    :raises TypeError: if it is not a number.
    :raises ValueError: naming the argument and the admissible range.
    """
    return check_probability(
        "participation", participation,
        what=" (the probability that a client takes part in a round; 1 = every client every "
             "round)")


#: Expected fraction of empty rounds, :math:`(1-p)^b`, from which a warning is given.
EMPTY_ROUND_WARNING = 0.1


def empty_round_fraction(participation: float, num_clients: int) -> float:
    """Expected fraction of rounds in which no client takes part, :math:`(1-p)^b`."""
    return float((1.0 - participation) ** num_clients)


def warn_if_many_empty_rounds(participation: float, num_clients: int,
                              stacklevel: int = 3) -> float:
    """Warn (:class:`UserWarning`) when at least :data:`EMPTY_ROUND_WARNING` of the rounds are
    expected to have no client; return the expected fraction :math:`(1-p)^b`."""
    frac = empty_round_fraction(participation, num_clients)
    if participation < 1.0 and frac >= EMPTY_ROUND_WARNING:
        p_min = 1.0 - EMPTY_ROUND_WARNING ** (1.0 / num_clients)
        warnings.warn(
            f"`participation`={participation:g} with {num_clients} clients: a round has no "
            f"client with probability (1-p)^b = {frac:.3g}, i.e. about {1000 * frac:.0f} "
            "empty rounds per 1000 (they move the chain by the prior, memory and noise "
            f"only). Use participation >= {p_min:.3g} for fewer than "
            f"{100 * EMPTY_ROUND_WARNING:.0f}% empty rounds.",
            UserWarning,
            stacklevel=stacklevel,
        )
    return frac


def participation_mask(key: jax.Array, participation: float, num_clients: int) -> jax.Array:
    """The clients asked in this round, a boolean ``(b,)`` mask.

    :param key: the step's algorithm key (``k_alg``).
    :param participation: probability ``p`` that a client is asked.
    :param num_clients: ``b``.
    """
    return random.bernoulli(random.fold_in(key, PARTICIPATION_SALT), participation, (num_clients,))


def ratio_weights(mask: jax.Array) -> jax.Array:
    """Per-client weights :math:`\\mathbb{1}\\{i\\in S\\}\\, b / \\max(|S|, 1)` of the ratio
    estimator (see the module docstring)."""
    m = jnp.asarray(mask)
    b = m.shape[0]
    count = jnp.maximum(jnp.sum(m.astype(jnp.int32)), 1)
    return jnp.where(m, b / count, 0.0)
