"""The package's exception and warning types, in one module at the bottom of the layers.

Every module of :mod:`numpyro_fed` raises and warns with these (plus Python's
:class:`ValueError` / :class:`TypeError` for misused arguments, see
:mod:`numpyro_fed._validation`); users catch them by these names, also exported from the
root package (``numpyro_fed.DivergenceError``) and, for compatibility, from the modules
that defined them before (``numpyro_fed.kernels.base``, ``numpyro_fed.saem``,
``numpyro_fed.saem.result``). This module imports nothing from the package, so that any
layer may use it.

* :class:`DivergenceError` -- a chain left the finite numbers (kernels, SAEM, deployments).
* :class:`ConvergenceWarning` -- an SAEM fit shows signs of not having converged; its
  subclass :class:`SingularFitWarning` -- a variance ends at the boundary 0 of its support.
* :class:`LikelihoodWarning` -- an importance-sampling -2LL whose weights are too
  heavy-tailed for its reported Monte Carlo error to be trusted.
* :class:`DeploymentError` -- a Flower deployment cannot go on (its subclasses
  :class:`ClientMismatchError`, :class:`ParticipationError`); :class:`WireFormatError` -- a
  malformed message on the wire (also exported by :mod:`numpyro_fed.flower`).
* :class:`NumPyroVersionWarning` -- :class:`~numpyro_fed.CachedMCMC` found a NumPyro it was
  not tested with and runs NumPyro's own sampling loop.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "DivergenceError",
    "ConvergenceWarning",
    "SingularFitWarning",
    "LikelihoodWarning",
    "DeploymentError",
    "ClientMismatchError",
    "ParticipationError",
    "WireFormatError",
    "NumPyroVersionWarning",
]


class DivergenceError(FloatingPointError):
    """A chain left the finite numbers (usually: the step size is too large).

    Raised directly by ``MCMC.run`` (not wrapped in a JAX runtime error). Attributes:
    ``iteration`` -- the first non-finite iteration (counting warmup, from 1) when known;
    ``chain`` -- the index of the first diverging vectorized chain, or ``None``.
    """

    iteration: int | None = None
    chain: int | None = None


class ConvergenceWarning(UserWarning):
    """The SAEM fit shows signs of not having converged (see
    :meth:`SAEMResult.check_convergence <numpyro_fed.saem.SAEMResult.check_convergence>`);
    its standard errors and -2LL are then not to be trusted, and say so."""


class SingularFitWarning(ConvergenceWarning):
    """A boundary (singular) fit: a variance (or scale) ends at the boundary 0 of its support,
    its maximum-likelihood value (lme4's "boundary (singular) fit"). The estimates are the
    maximum on the boundary; standard errors there are not regular (see
    :attr:`SAEMResult.singular <numpyro_fed.saem.SAEMResult.singular>`)."""


class LikelihoodWarning(UserWarning):
    """The importance-sampling -2LL and its Monte Carlo SE cannot be trusted as reported:
    the importance weights of some subject (connected group) are too heavy-tailed (Pareto
    :math:`\\hat k` above :data:`numpyro_fed.saem.likelihood.PARETO_K_WARN`) even after
    :data:`~numpyro_fed.saem.likelihood.MAX_ROUNDS` rounds of draws."""


# ====================================================================== deployments
class DeploymentError(RuntimeError):
    """A Flower deployment cannot go on without sampling another target than its spec's:
    clients missing or announcing the same partition id at ``hello``, a client running
    another model or other settings (:class:`ClientMismatchError`), clients that stopped
    answering (:class:`ParticipationError`). The message names the clients / rounds at fault
    and what to do."""


class ClientMismatchError(DeploymentError):
    """A client computes another potential than the server's model and spec (another model
    or version of the model module, another likelihood weight, other settings).

    ``clients``: the partition ids of the refused clients."""

    clients: list[int]

    def __init__(self, message: str, clients: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.clients = [int(i) for i in clients]


class ParticipationError(DeploymentError):
    """The clients stopped answering: too many consecutive rounds without a participant,
    or a share of answered requests far below ``min_participation``.

    ``rounds``: the rounds at fault (0-based step indices)."""

    rounds: list[int]

    def __init__(self, message: str, rounds: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rounds = [int(k) for k in rounds]


class WireFormatError(ValueError):
    """A received message is malformed, oversized or inconsistent with its codec."""


# ====================================================================== dependencies
class NumPyroVersionWarning(UserWarning):
    """:class:`~numpyro_fed.CachedMCMC` relies on private internals of NumPyro's ``MCMC``
    (its sampling loop) and was tested on the versions of
    :data:`numpyro_fed.cached_mcmc.TESTED_NUMPYRO`; with another NumPyro it warns this and
    runs NumPyro's own loop instead (the draws of ``numpyro.infer.MCMC``, compiled at every
    run). The message names the installed version and the fix."""
