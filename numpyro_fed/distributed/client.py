"""Compatibility location of :class:`~numpyro_fed.algorithms.oracles.ClientProblem` and
:func:`~numpyro_fed.algorithms.oracles.client_key` (one client's gradient oracles are algorithm
pieces: they live in :mod:`numpyro_fed.algorithms.oracles`)."""

from numpyro_fed.algorithms.oracles import ClientProblem, batch_indices, client_key

__all__ = ["ClientProblem", "client_key", "batch_indices"]
