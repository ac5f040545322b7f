"""The two halves of an MCMC-SAEM iteration, declared: :class:`EStep` and :class:`MStep`.

The fit loop (:func:`~numpyro_fed.saem.fit.fit_saem`) calls nothing else on them: every
member it uses is declared here, none is looked up by name at run time. Both are
Optax-style ``init``/``update`` pairs on a state of their own (a NamedTuple or any pytree of
arrays, carried by :class:`~numpyro_fed.saem.fit.SAEMState`), as in Dynamax's ``fit_em``
over ``e_step``/``m_step``:

- :class:`EStep` -- a Markov kernel leaving :math:`p(z\\mid y;\\theta)` invariant, run on
  ``C`` chains of the flat unconstrained latents ``z`` ``(C, d_z)``
  (:class:`~numpyro_fed.saem.estep.LangevinEStep`,
  :class:`~numpyro_fed.saem.estep.NumPyroEStep`);
- :class:`MStep` -- the stochastic approximation of the statistics and the maximisation
  :math:`\\theta^+ = \\hat\\theta(s^+)` (Gruffaz et al. 2024, eq. (2)) on the flat
  unconstrained :math:`\\theta` (:class:`~numpyro_fed.saem.mstep.GaussianMStep`,
  :class:`~numpyro_fed.saem.mstep.NewtonMStep`,
  :class:`~numpyro_fed.saem.mstep.UserMStep`).

``data`` is always the model's ``(args, kwargs)``. A new E-step or M-step implements the
protocol (structurally, or by subclassing it to inherit the defaults of its optional
members) and is passed to :class:`~numpyro_fed.saem.SAEM` as ``kernel=`` or ``mstep=``;
its coordinates are those of the model's :class:`~numpyro_fed.saem.model.ModelInfo`
(``theta_u``: the ``param`` sites in order, flattened, unconstrained; ``z``: the latent
sites likewise). :func:`check_estep` and :func:`check_mstep` refuse an object that lacks
a member with a :class:`TypeError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

__all__ = ["EStep", "MStep", "check_estep", "check_mstep"]


@runtime_checkable
class EStep(Protocol):
    """An E-step: ``init`` a state at the chains' latents, then ``step`` it once per SAEM
    iteration at the current :math:`\\theta`. All methods but ``step_size_summary`` are
    traced (pure JAX); the state is a pytree of arrays of fixed shapes."""

    def init(self, key: jax.Array, z: jax.Array, theta_u: jax.Array, data: tuple,
             ids: Any = None) -> Any:
        """The state at the chains' latents ``z`` ``(C, d_z)`` and :math:`\\theta`."""
        ...

    def step(self, key: jax.Array, state: Any, theta_u: jax.Array, data: tuple,
             num_steps: jax.Array, adapt: jax.Array, ids: Any = None
             ) -> tuple[Any, jax.Array, jax.Array]:
        """``num_steps`` (traced int) moves at :math:`\\theta`; ``adapt`` (traced bool): the
        exploration phase. Returns ``(state, mean acceptance, finite)``, ``finite`` a traced
        bool: the new latents (and whatever the kernel tracks) are finite."""
        ...

    def latents(self, state: Any) -> jax.Array:
        """The chains' flat unconstrained latents ``(C, d_z)`` in ``state``."""
        ...

    def move(self, state: Any, fn: Callable[[jax.Array], jax.Array]) -> Any:
        """The state with every chain moved by ``fn`` (flat ``(d_z,) -> (d_z,)``: SAEM's
        centring shift or the M-step's transport after :math:`\\theta` moved); an E-step
        whose state is not its own to move returns it unchanged."""
        return state

    def step_size_summary(self, state: Any) -> str:
        """A short description of the step size (host side, for error messages)."""
        return type(self).__name__


@runtime_checkable
class MStep(Protocol):
    """An M-step: ``prepare`` data-dependent constants once (inside the compiled program),
    ``init`` the statistics at the first draws, then ``update`` once per SAEM iteration.

    :cvar kind: its name in :attr:`~numpyro_fed.saem.SAEMResult.mstep` and the settings.
    :cvar needs_score: ``update`` receives the chain-averaged complete-data score and
        Hessian ``(g (k,), H (k, k))`` in the centred coordinates (else ``None``).
    :cvar transport: ``None`` (the chains move along the centring design,
        :math:`z - M\\Delta\\theta`), or ``transport(state, zf, theta_old, theta_new, aux)
        -> zf``: how each chain moves when :math:`\\theta` does (the interweaving M-step's
        non-centred path).

    Optional attribute (not a member of the protocol): ``score_idx``, the ``k`` unconstrained
    coordinates of :math:`\\theta` whose score and Hessian ``update`` reads (an int array;
    the Hessian is then computed in those coordinates only); without it, all ``d``.
    """

    kind: str
    needs_score: bool = False
    transport: Callable | None = None

    def prepare(self, theta_u: jax.Array, z: jax.Array, data: tuple, M: jax.Array) -> Any:
        """Constants of the fit (``aux``) at :math:`\\theta_0` and the first latents ``z``
        ``(C, d_z)``; ``M`` is the centring design ``(d_z, d)``."""
        ...

    def init(self, theta_u: jax.Array, z: jax.Array, data: tuple, aux: Any) -> Any:
        """The state (the statistics at the draws ``z``)."""
        ...

    def update(self, state: Any, gamma: jax.Array, theta_u: jax.Array, z: jax.Array,
               data: tuple, aux: Any, anneal: jax.Array,
               score_hess: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, Any]:
        """:math:`s^+ = s + \\gamma(S(z) - s)`, :math:`\\theta^+ = \\hat\\theta(s^+)` (with
        simulated annealing of the variances while ``anneal``, a traced bool). Returns
        ``(theta_u+, state+)``; a non-finite :math:`\\theta^+` stops the fit with a
        :class:`~numpyro_fed.errors.DivergenceError` that blames the M-step."""
        ...

    def describe(self) -> dict:
        """Entries for :attr:`SAEMResult.settings <numpyro_fed.saem.SAEMResult.settings>`:
        ``interweave``, ``variance_coords`` (flat constrained indices of the standard
        deviations of Gaussian sites), ``mvn_covariances`` (``(site, rule, params)``)."""
        return {"interweave": False, "variance_coords": [], "mvn_covariances": []}


_ESTEP_MEMBERS = ("init", "step", "latents", "move", "step_size_summary")
_MSTEP_MEMBERS = ("kind", "needs_score", "transport", "prepare", "init", "update", "describe")


def _require(obj: Any, members: tuple[str, ...], what: str, kind: str, protocol: str,
             optional: str) -> None:
    """A :class:`TypeError` naming the ``members`` that ``obj`` lacks, if any."""
    missing = [m for m in members if not hasattr(obj, m)]
    if missing:
        raise TypeError(
            f"`{what}`: {type(obj).__name__} is not an {kind}: it lacks "
            + ", ".join(f"`{m}`" for m in missing)
            + f" (see numpyro_fed.saem.protocols.{protocol}; subclass it for the defaults of "
            f"{optional})."
        )


def check_estep(obj: Any, what: str = "kernel") -> EStep:
    """``obj`` if it implements :class:`EStep`, else a :class:`TypeError` naming the
    members it lacks."""
    _require(obj, _ESTEP_MEMBERS, what, "E-step", "EStep", "`move` and `step_size_summary`")
    return obj


def check_mstep(obj: Any, what: str = "mstep") -> MStep:
    """``obj`` if it implements :class:`MStep`, else a :class:`TypeError` naming the
    members it lacks."""
    _require(obj, _MSTEP_MEMBERS, what, "M-step", "MStep", "`transport` and `describe`")
    if not isinstance(obj.kind, str) or not isinstance(obj.needs_score, bool):
        raise TypeError(
            f"`{what}`: {type(obj).__name__}.kind must be a str and .needs_score a bool, got "
            f"{obj.kind!r} and {obj.needs_score!r}."
        )
    return obj
