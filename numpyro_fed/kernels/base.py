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

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from numpyro.util import is_prng_key

from numpyro_fed._validation import check_positive_float
from numpyro_fed.algorithms.langevin import langevin_move  # noqa: F401  (re-exported)
from numpyro_fed.errors import DivergenceError  # re-exported: its home before errors.py

__all__ = [
    "split_chain_keys",
    "check_step_size",
    "langevin_move",
    "raise_if_nonfinite",
    "DivergenceError",
    "DivergenceGuard",
]


_DIVERGED = (
    "numpyro_fed: {kernel} chain{{chain}} became non-finite at iteration {{iteration}} "
    "(counting warmup) with step_size={step_size:.3g}. Reduce `step_size` (or check the "
    "model for invalid values)."
)


_FIELD_HINTS = {
    ("FedState", "potential_energy"): (
        "the kernel was built without `track_potential=True` (clients send gradients only; "
        "with it, every client also evaluates U_i on all its rows and sends it, 32 bits per "
        "client and step)"),
    ("FedState", "accept_prob"): "the federated kernels are unadjusted (no accept step)",
    ("LangevinState", "accept_prob"): "ULA is unadjusted (no accept step); MALA records it",
    ("FedState", "diverging"): (
        "a chain that becomes non-finite stops the run with numpyro_fed.DivergenceError"),
    ("LangevinState", "diverging"): (
        "a chain that becomes non-finite stops the run with numpyro_fed.DivergenceError"),
    ("MALAState", "diverging"): (
        "MALA has no energy-error divergence: a non-finite chain stops the run with "
        "numpyro_fed.DivergenceError, and non-finite proposals are rejected"),
}


def _missing_field(state: Any, name: str) -> AttributeError:
    """The error for a field NumPyro users request of HMC (``extra_fields=...``) that this
    kernel's state does not have: it names the field, says why, and lists what exists."""
    cls = type(state).__name__
    if name.startswith("__"):
        return AttributeError(name)
    hint = _FIELD_HINTS.get((cls, name))
    props = [n for n in ("bits_up", "bits_down") if hasattr(type(state), n)]
    return AttributeError(
        f"{cls} has no field {name!r}" + (f": {hint}" if hint else "") + ". Fields that "
        f"`extra_fields` can collect: {list(state._fields) + props} (and dotted sub-fields "
        "such as 'extra.participants')."
    )


def _state_getattr(state: Any, name: str):
    """``__getattr__`` of the kernels' states: a missing field is explained."""
    raise _missing_field(state, name)


def _state_getitem(state: Any, key):
    """``__getitem__`` of the kernels' states: NumPyro's field getter tries ``state[name]``
    after ``getattr``, which must explain a missing field too."""
    if isinstance(key, str):
        raise _missing_field(state, key)
    return tuple.__getitem__(state, key)


def split_chain_keys(rng_key) -> tuple[bool, Any]:
    """Return ``(vectorized, keys)``: a single key, or a batch of per-chain keys.

    :raises TypeError: for anything but a JAX PRNG key or a batch of them (e.g. an int
        seed), saying how to make a key.
    """
    if is_prng_key(rng_key):
        return False, rng_key
    arr = rng_key if isinstance(rng_key, jax.Array) else None
    typed = arr is not None and jax.dtypes.issubdtype(arr.dtype, jax.dtypes.prng_key)
    legacy = arr is not None and arr.dtype == jnp.uint32 and arr.ndim == 2 and arr.shape[-1] == 2
    if not (typed and arr.ndim == 1) and not legacy:
        raise TypeError(
            f"`rng_key` must be a JAX random key, got {type(rng_key).__name__} {rng_key!r}: "
            "NumPyro's MCMC.run takes a key, not an int seed; use "
            "mcmc.run(jax.random.key(0)) or mcmc.run(jax.random.PRNGKey(0))."
        )
    return True, rng_key


def chain_keys_list(keys) -> list:
    """Per-chain keys of a batch as a Python list (init time only)."""
    return [keys[c] for c in range(keys.shape[0])]


def check_compressor_dim(compressor, dim: int, dtype, arg: str) -> None:
    """Trace ``compressor`` once on a message of the model's dimension (shapes only, no
    computation), so that a compressor that cannot apply to it (e.g. ``top_k(k)`` with
    ``k > d``) is refused when the kernel is built, naming the argument, rather than when
    ``MCMC.run`` first compiles the step."""
    import jax
    from jax import random

    try:
        jax.eval_shape(compressor.fn, random.key(0), jax.ShapeDtypeStruct((int(dim),), dtype))
    except ValueError as err:
        raise ValueError(f"`{arg}` ({compressor.name}) cannot compress the model's "
                         f"d={dim} unconstrained parameters: {err}") from None


def check_step_size(step_size, name: str = "step_size") -> float:
    """Validate a positive, finite step size (:func:`~numpyro_fed._validation.check_positive_float`:
    :class:`TypeError` for a non-number, :class:`ValueError` for one that is not finite and
    ``> 0``)."""
    return check_positive_float(name, step_size)


def _check_guard(first_bad: Any, message: str) -> None:
    """Raise the :class:`DivergenceError` of a concrete guard leaf that recorded a non-finite
    iteration; do nothing for tracers, shape structs, axis specs or ``None``."""
    if isinstance(first_bad, Tracer):
        return
    if isinstance(first_bad, jax.Array):
        if first_bad.is_deleted() or not first_bad.is_fully_addressable:
            return
    elif not isinstance(first_bad, np.ndarray):
        return
    v = np.asarray(first_bad)
    if not np.issubdtype(v.dtype, np.integer) or not np.any(v >= 0):
        return
    flat = np.where(v >= 0, v, np.iinfo(v.dtype).max).ravel()
    pos = int(np.argmin(flat))
    iteration = int(flat[pos])
    chain = pos if v.size > 1 else None
    where = f" {pos}" if chain is not None else ""
    err = DivergenceError(message.format(iteration=iteration, chain=where))
    err.iteration, err.chain = iteration, chain
    raise err


@jax.tree_util.register_pytree_node_class
class DivergenceGuard:
    """Divergence check carried in a kernel's state: raises :class:`DivergenceError` on the
    host as soon as a state that saw a non-finite value comes out of a compiled function.

    Its only leaf, ``first_bad`` (``int32``, one per vectorized chain), is the first
    iteration at which the watched quantity was not finite, ``-1`` while it is finite; the
    message template (``{iteration}``, ``{chain}``) is static pytree metadata. JAX rebuilds
    the outputs of a jitted, ``pmap``-ed or eager ``lax`` computation on the host with
    concrete arrays, through :meth:`tree_unflatten`, which raises the error there. So
    NumPyro's ``MCMC.run`` stops with a :class:`DivergenceError` (catchable by that name, no
    host callback, no second traceback): at the diverging step with ``progress_bar=True``
    (one compiled step per iteration), at the end of the compiled loop with
    ``progress_bar=False`` (the remaining steps run on NaN, which costs what a finite step
    costs: measured, see :func:`raise_if_nonfinite`).

    Inside traced code (``jit``, ``vmap``, ``scan``) the leaf is a tracer and nothing is
    checked; unflattening with anything but a concrete integer array (axis specs, ``None``,
    ``jax.ShapeDtypeStruct``) does not check either.
    """

    __slots__ = ("first_bad", "message")

    def __init__(self, first_bad: Any, message: str) -> None:
        self.first_bad = first_bad
        self.message = message

    @classmethod
    def create(cls, message: str) -> DivergenceGuard:
        """A guard that has seen only finite values (``first_bad = -1``).

        :param message: error template; may use ``{iteration}`` and ``{chain}`` (``" c"``
            for chain ``c`` of vectorized chains, empty otherwise).
        """
        return cls(jnp.full((), -1, jnp.int32), message)

    def update(self, x: Any, iteration: Any) -> DivergenceGuard:
        """Record ``iteration`` if ``x`` is not finite and nothing was recorded before.

        The predicate is :math:`\\sum_k 0\\cdot x_k \\ne 0`, which holds exactly when some
        :math:`x_k` is NaN or infinite (``0 * inf`` is NaN); XLA on CPU compiles it to one
        fewer unfused operation than ``~all(isfinite(x))``. Cost per step: that reduction
        and one scalar select (no branch, no host callback).
        """
        bad = jnp.sum(x * jnp.zeros((), jnp.result_type(x))) != 0
        fb = self.first_bad
        first = jnp.where(bad & (fb < 0), jnp.asarray(iteration, fb.dtype), fb)
        return DivergenceGuard(first, self.message)

    def check(self) -> None:
        """Raise now if a non-finite value was recorded (host side, concrete leaf)."""
        _check_guard(self.first_bad, self.message)

    def tree_flatten(self):
        return (self.first_bad,), self.message

    @classmethod
    def tree_unflatten(cls, message, leaves):
        (first_bad,) = leaves
        _check_guard(first_bad, message)
        return cls(first_bad, message)

    def __repr__(self) -> str:
        return f"DivergenceGuard(first_bad={self.first_bad!r})"


def raise_if_nonfinite(x, iteration, message: str) -> None:
    """Raise :class:`DivergenceError` now if the concrete ``x`` is not finite (host side).

    The kernels do not call this in their step: they carry a :class:`DivergenceGuard` in
    their state instead (no host callback in the compiled step). ``message`` may use
    ``{iteration}`` and ``{chain}``.
    """
    if not bool(np.all(np.isfinite(np.asarray(x)))):
        err = DivergenceError(message.format(iteration=int(np.max(iteration)), chain=""))
        err.iteration, err.chain = int(np.max(iteration)), None
        raise err
