"""Langevin kernels: ULA and MALA on an ordinary NumPyro model, and federated Langevin.

* :class:`ULA` -- unadjusted Langevin algorithm, :math:`\\theta^+ = \\theta - \\gamma\\nabla
  U(\\theta) + \\sqrt{2\\gamma}Z` (Roberts & Tweedie 1996; the LSD baseline of Vono et al. 2022
  when run on pooled data).
* :class:`MALA` -- the same proposal with a Metropolis--Hastings correction; the step size is
  adapted during warmup by dual averaging towards a target acceptance rate (default 0.574,
  Roberts & Rosenthal 1998), as NumPyro's HMC adapts its own.
* :class:`FederatedLangevin` -- federated SGLD / ULA over a
  :class:`~numpyro_fed.partition.ClientPartition`: each client sends (optionally compressed)
  :math:`H_i(\\theta)`, the server adds the Langevin noise (Vono et al. 2022, Alg. 1, with the
  full-gradient or minibatch oracle). With the identity compressor this is the papers'
  uncompressed LSD / federated LMC baseline.

All three run inside :class:`numpyro.infer.MCMC`, including
``chain_method="vectorized"``, and return constrained samples and deterministic sites.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro.infer.hmc_util import dual_averaging
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.infer.util import initialize_model
from numpyro.util import identity

from numpyro_fed import _programs
from numpyro_fed._validation import check_bool, check_int
from numpyro_fed.algorithms import estimators
from numpyro_fed.algorithms import qlsd as qlsd_core
from numpyro_fed.algorithms.langevin import mala_log_ratio, mala_sq_residuals
from numpyro_fed.bits import (
    BitCounter,
    bits_add,
    count_times,
    counter_value,
    step_bits,
    sum_bits,
    totals_add,
    totals_counter,
    totals_zeros,
)
from numpyro_fed.compressors import Compressor, get_compressor
from numpyro_fed.kernels.base import (
    DivergenceGuard,
    chain_keys_list,
    check_compressor_dim,
    check_step_size,
    langevin_move,
    split_chain_keys,
)
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential

__all__ = [
    "LangevinState",
    "MALAState",
    "FedState",
    "ULA",
    "MALA",
    "FederatedKernel",
    "FederatedLangevin",
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


# ============================================================================ ULA / MALA
class LangevinState(NamedTuple):
    """State of :class:`ULA`.

    - **i** -- iteration counter.
    - **z** -- current sample, a dict of unconstrained site values.
    - **potential_energy** -- :math:`U(z)` (NaN with ``track_potential=False``).
    - **z_grad** -- :math:`\\nabla U(z)`.
    - **rng_key** -- random key.
    - **guard** -- :class:`~numpyro_fed.kernels.base.DivergenceGuard`: the first non-finite
      iteration (``-1``: none); a state that holds one raises
      :class:`~numpyro_fed.errors.DivergenceError` when it leaves compiled code.
    """

    i: jax.Array
    z: dict
    potential_energy: jax.Array
    z_grad: jax.Array
    rng_key: jax.Array
    guard: DivergenceGuard

    __getattr__ = _state_getattr
    __getitem__ = _state_getitem


class MALAState(NamedTuple):
    """State of :class:`MALA`.

    - **i** -- iteration counter.
    - **z** -- current sample (dict of unconstrained site values).
    - **potential_energy** -- :math:`U(z)`.
    - **z_grad** -- flat :math:`\\nabla U(z)`.
    - **accept_prob** -- acceptance probability of the last proposal.
    - **mean_accept_prob** -- running mean of ``accept_prob`` (reset after warmup).
    - **step_size** -- current step size (adapted during warmup).
    - **adapt_state** -- dual-averaging state on :math:`\\log` step size.
    - **rng_key** -- random key.
    - **guard** -- :class:`~numpyro_fed.kernels.base.DivergenceGuard` (see
      :class:`LangevinState`).
    """

    i: jax.Array
    z: dict
    potential_energy: jax.Array
    z_grad: jax.Array
    accept_prob: jax.Array
    mean_accept_prob: jax.Array
    step_size: jax.Array
    adapt_state: tuple
    rng_key: jax.Array
    guard: DivergenceGuard

    __getattr__ = _state_getattr
    __getitem__ = _state_getitem


class _ModelLangevinBase(MCMCKernel):
    """Common init/postprocess logic of ULA and MALA on a NumPyro model or potential."""

    sample_field = "z"

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable | None = None,
        *,
        step_size: float = 1e-3,
        init_strategy: Callable = init_to_uniform,
        check_finite: bool = True,
    ) -> None:
        if (model is None) == (potential_fn is None):
            raise ValueError("Give exactly one of `model` and `potential_fn`.")
        self._model = model
        self._potential_fn = potential_fn
        self._step_size = check_step_size(step_size)
        self._init_strategy = init_strategy
        self.check_finite = check_finite
        self._postprocess_fn = None
        self._pe_fn = None
        self._unravel = None
        self._vectorized = False

    @property
    def model(self):
        return self._model

    @property
    def step_size(self) -> float:
        return self._step_size

    # -- potential on flat vectors -------------------------------------------------------
    def _bind(self, model_args, model_kwargs, init_params, rng_key):
        """Build the flat potential for these model arguments; return flat initial points."""
        if self._model is not None:
            keys = chain_keys_list(rng_key) if self._vectorized else [rng_key]
            inits = []
            for k in keys:
                info = initialize_model(
                    k,
                    self._model,
                    model_args=model_args,
                    model_kwargs=model_kwargs,
                    init_strategy=self._init_strategy,
                    dynamic_args=True,
                )
                inits.append(info.param_info.z)
            pe_gen = info.potential_fn
            self._postprocess_fn = info.postprocess_fn
            z_proto = inits[0]

            def pe_dict(z, args, kwargs):
                return pe_gen(*args, **kwargs)(z)

        else:
            if init_params is None:
                raise ValueError("`init_params` must be provided with `potential_fn`.")
            inits = None
            z_proto = jax.tree.map(lambda v: v[0] if self._vectorized else v, init_params)

            def pe_dict(z, args, kwargs):
                return self._potential_fn(z)

        _, unravel = ravel_pytree(z_proto)
        self._unravel = unravel
        self._pe_dict = pe_dict
        if init_params is not None:
            inits = init_params
        elif self._vectorized:
            inits = jax.tree.map(lambda *v: jnp.stack(v), *inits)
        else:
            inits = inits[0]
        return inits

    def _flat_pe(self, model_args, model_kwargs):
        unravel, pe_dict = self._unravel, self._pe_dict
        return lambda x: pe_dict(unravel(x), model_args, model_kwargs)

    def postprocess_fn(self, model_args, model_kwargs):
        if self._postprocess_fn is None:
            return identity
        return self._postprocess_fn(*model_args, **model_kwargs)

    def _guard(self) -> DivergenceGuard:
        return DivergenceGuard.create(
            _DIVERGED.format(kernel=type(self).__name__, step_size=self._step_size)
        )

    def _maybe_vmap(self, fn, in_axes):
        return jax.vmap(fn, in_axes=in_axes) if self._vectorized else fn

    def refresh(self, state, model_args, model_kwargs):
        """Recompute the cached potential and gradient for new model arguments."""
        pe = self._flat_pe(model_args, model_kwargs)

        def one(s):
            u, g = jax.value_and_grad(pe)(ravel_pytree(s.z)[0])
            return s._replace(potential_energy=u, z_grad=g)

        return self._maybe_vmap(one, 0)(state)


class ULA(_ModelLangevinBase):
    """Unadjusted Langevin algorithm on a NumPyro model (or a potential function).

    :math:`z^+ = z - \\gamma \\nabla U(z) + \\sqrt{2\\gamma} Z` in unconstrained space.

    :param model: a NumPyro model (data passed to ``MCMC.run`` as usual).
    :param potential_fn: alternatively, a potential on dicts of unconstrained values
        (``init_params`` are then required).
    :param step_size: :math:`\\gamma`.
    :param init_strategy: NumPyro initialisation strategy for model latent sites.
    :param check_finite: stop with :class:`~numpyro_fed.errors.DivergenceError` when a
        chain becomes non-finite.

    :param track_potential: compute :math:`U(z)` at every step (state field
        ``potential_energy``, e.g. for ``extra_fields=("potential_energy",)``). ULA's
        recursion needs only :math:`\\nabla U`; with ``False`` the field holds NaN and each
        step skips the potential's own arithmetic (for a logistic likelihood one ``log1p``
        and one ``exp`` per row: about 20% of a step on CPU). The divergence check then
        watches the gradient.

    The random key of each step is split as ``(rng_key, k_noise, k_alg)``; the federated
    kernels use the same scheme, so that with identical gradients they produce identical
    chains.
    """

    def __init__(self, *args: Any, track_potential: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.track_potential = bool(track_potential)

    def _value_and_grad(self, pe, x):
        if self.track_potential:
            return jax.value_and_grad(pe)(x)
        return jnp.full((), jnp.nan, x.dtype), jax.grad(pe)(x)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        self._vectorized, rng_key = split_chain_keys(rng_key)
        z0 = self._bind(model_args, model_kwargs, init_params, rng_key)
        pe = self._flat_pe(model_args, model_kwargs)

        def init_one(z, key):
            u, g = self._value_and_grad(pe, ravel_pytree(z)[0])
            return LangevinState(jnp.zeros((), jnp.int32), z, u, g, key, self._guard())

        return self._maybe_vmap(init_one, (0, 0))(z0, rng_key)

    def refresh(self, state, model_args, model_kwargs):
        pe = self._flat_pe(model_args, model_kwargs)

        def one(s):
            u, g = self._value_and_grad(pe, ravel_pytree(s.z)[0])
            return s._replace(potential_energy=u, z_grad=g)

        return self._maybe_vmap(one, 0)(state)

    def sample(self, state, model_args, model_kwargs):
        pe = self._flat_pe(model_args, model_kwargs)
        gamma = self._step_size

        def one(s):
            rng_key, k_noise, _ = random.split(s.rng_key, 3)
            x = langevin_move(k_noise, ravel_pytree(s.z)[0], s.z_grad, gamma)
            u, g = self._value_and_grad(pe, x)
            guard = s.guard
            if self.check_finite:
                guard = guard.update(u if self.track_potential else g, s.i + 1)
            return LangevinState(s.i + 1, self._unravel(x), u, g, rng_key, guard)

        return self._maybe_vmap(one, 0)(state)

    def get_diagnostics_str(self, state):
        if not self.track_potential:
            return f"step size {self._step_size:.2e}"
        return f"step size {self._step_size:.2e}. U {float(state.potential_energy):.4g}"


class MALA(_ModelLangevinBase):
    """Metropolis-adjusted Langevin algorithm with step-size adaptation during warmup.

    Proposal :math:`y = z - \\gamma\\nabla U(z) + \\sqrt{2\\gamma}Z`, accepted with probability
    :math:`\\min\\{1, e^{U(z) - U(y)} q(z\\mid y)/q(y\\mid z)\\}`. During the ``num_warmup``
    iterations :math:`\\log\\gamma` follows NumPyro's dual-averaging scheme (Hoffman & Gelman
    2014) towards ``target_accept_prob``; afterwards the averaged step size is frozen.

    :param step_size: initial :math:`\\gamma`.
    :param adapt_step_size: adapt during warmup (default ``True``).
    :param target_accept_prob: target acceptance rate (default 0.574, optimal for MALA).
    """

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable | None = None,
        *,
        step_size: float = 1e-3,
        adapt_step_size: bool = True,
        target_accept_prob: float = 0.574,
        init_strategy: Callable = init_to_uniform,
        check_finite: bool = True,
    ) -> None:
        super().__init__(
            model,
            potential_fn,
            step_size=step_size,
            init_strategy=init_strategy,
            check_finite=check_finite,
        )
        if not 0.0 < target_accept_prob < 1.0:
            raise ValueError("`target_accept_prob` must lie in (0, 1).")
        self._adapt = adapt_step_size
        self._target = target_accept_prob
        self._num_warmup = 0

    @property
    def default_fields(self):
        return ("z", "accept_prob")

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        self._vectorized, rng_key = split_chain_keys(rng_key)
        self._num_warmup = int(num_warmup)
        z0 = self._bind(model_args, model_kwargs, init_params, rng_key)
        pe = self._flat_pe(model_args, model_kwargs)
        da_init, _ = dual_averaging()
        log_step = jnp.log(self._step_size)

        def init_one(z, key):
            x = ravel_pytree(z)[0]
            u, g = jax.value_and_grad(pe)(x)
            zero = jnp.zeros((), jnp.result_type(x))
            step = jnp.asarray(self._step_size, jnp.result_type(x))
            return MALAState(
                jnp.zeros((), jnp.int32), z, u, g, zero, zero, step,
                da_init(jnp.log(10.0) + log_step), key, self._guard(),
            )

        return self._maybe_vmap(init_one, (0, 0))(z0, rng_key)

    def sample(self, state, model_args, model_kwargs):
        pe = self._flat_pe(model_args, model_kwargs)
        _, da_update = dual_averaging()
        num_warmup, target, adapt = self._num_warmup, self._target, self._adapt

        def one(s):
            rng_key, k_noise, k_acc = random.split(s.rng_key, 3)
            x = ravel_pytree(s.z)[0]
            gamma = s.step_size
            y = langevin_move(k_noise, x, s.z_grad, gamma)
            u_y, g_y = jax.value_and_grad(pe)(y)
            # log q(x | y) - log q(y | x) for q(b | a) = N(a - gamma grad(a), 2 gamma I)
            fwd_sq, bwd_sq = mala_sq_residuals(x, y, s.z_grad, g_y, gamma)
            log_ratio = mala_log_ratio(s.potential_energy, u_y, fwd_sq, bwd_sq, gamma)
            accept_prob = jnp.clip(jnp.exp(jnp.minimum(log_ratio, 0.0)), 0.0, 1.0)
            accept = random.uniform(k_acc) < accept_prob
            x_new = jnp.where(accept, y, x)
            u_new = jnp.where(accept, u_y, s.potential_energy)
            g_new = jnp.where(accept, g_y, s.z_grad)
            i = s.i + 1
            # step-size adaptation (warmup only), NumPyro's dual averaging on log(step)
            if adapt:
                da = da_update(target - accept_prob, s.adapt_state)
                in_warmup = s.i < num_warmup
                last_warmup = s.i == num_warmup - 1
                step = jnp.where(
                    in_warmup,
                    jnp.where(last_warmup, jnp.exp(da[1]), jnp.exp(da[0])),
                    gamma,
                ).astype(gamma.dtype)
                da = jax.tree.map(lambda a, b: jnp.where(in_warmup, a, b), da, s.adapt_state)
            else:
                step, da = gamma, s.adapt_state
            n = jnp.where(s.i < num_warmup, s.i + 1, s.i + 1 - num_warmup).astype(gamma.dtype)
            restart = s.i == num_warmup
            mean_acc = jnp.where(
                restart, accept_prob, s.mean_accept_prob + (accept_prob - s.mean_accept_prob) / n
            )
            guard = s.guard.update(u_new, i) if self.check_finite else s.guard
            return MALAState(
                i, self._unravel(x_new), u_new, g_new, accept_prob, mean_acc, step, da, rng_key,
                guard,
            )

        return self._maybe_vmap(one, 0)(state)

    def get_diagnostics_str(self, state):
        return (
            f"step size {float(state.step_size):.2e}. "
            f"acc. prob={float(state.mean_accept_prob):.2f}"
        )


# ============================================================================ federated
class FedState(NamedTuple):
    """State of a federated kernel (one chain; vectorized chains add a leading axis to every
    field except ``i`` and ``data``).

    - **i** -- iteration counter, shared by vectorized chains.
    - **z** -- current sample: dict of unconstrained site values.
    - **bits** -- a :class:`~numpyro_fed.bits.BitCounter` of shape ``(2,)``: the bits of
      this step, ``(up, down)``, exact to :math:`2^{64}` in float32 mode (``uint32`` words
      ``(2, 2)``; on the host ``np.asarray(state.bits)`` is ``int64``). Up: client ->
      server, summed over clients; down: server -> clients, summed over the clients that
      receive the broadcast. Also readable as the properties ``bits_up`` and ``bits_down``.
    - **totals** -- a :class:`~numpyro_fed.bits.BitCounter` of shape ``(2,)``: the
      cumulative counters of both directions including warmup, thinned-out steps and
      one-off rounds at ``init`` (:func:`~numpyro_fed.bits.totals_add`); also the properties
      ``total_up`` and ``total_down``.
    - **extra** -- algorithm-specific state (memory terms, control variates, error feedback).
    - **rng_key** -- random key.
    - **data** -- the client partition (shared by chains).
    - **guard** -- :class:`~numpyro_fed.kernels.base.DivergenceGuard`, one per chain: the
      first non-finite iteration (``-1``: none). A state that holds one raises
      :class:`~numpyro_fed.errors.DivergenceError` when it leaves compiled code.
    - **energy** -- with ``track_potential=True``: :math:`U(z)` on all the data (readable
      as ``potential_energy``, e.g. ``extra_fields=("potential_energy",)``); ``None``
      otherwise, and then asking for ``potential_energy`` raises an ``AttributeError`` that
      says how to get it.

    The bits of a step are one array, not two fields, because NumPyro's sampling loop pays
    a guarded write per collected field and step (about 0.3 us on CPU, 4% of a small
    federated step); ``extra_fields=("bits_up", "bits_down")`` still collects them apart.
    """

    i: jax.Array
    z: dict
    bits: BitCounter
    totals: BitCounter
    extra: Any
    rng_key: jax.Array
    data: ClientPartition
    guard: DivergenceGuard
    energy: Any = None

    __getattr__ = _state_getattr
    __getitem__ = _state_getitem

    @property
    def potential_energy(self) -> jax.Array:
        """:math:`U(z)` (kernels built with ``track_potential=True`` only)."""
        if self.energy is None:
            raise AttributeError("potential_energy")  # -> __getattr__: the explanation
        return self.energy

    @property
    def bits_up(self) -> BitCounter:
        """Bits sent client -> server at this step (summed over clients); exact ``int64`` on
        the host (``np.asarray``), also as collected by ``extra_fields=("bits_up",)``."""
        return self.bits.component(0)

    @property
    def bits_down(self) -> BitCounter:
        """Bits sent server -> clients at this step."""
        return self.bits.component(1)

    @property
    def total_up(self) -> BitCounter:
        """Cumulative uplink bits (read with :func:`~numpyro_fed.bits.counter_value`)."""
        return totals_counter(self.totals, 0)

    @property
    def total_down(self) -> BitCounter:
        """Cumulative downlink bits."""
        return totals_counter(self.totals, 1)


class FederatedKernel(MCMCKernel):
    """Base class of the federated kernels: a NumPyro model + a client partition.

    Subclasses implement :meth:`init_extra` (per-chain algorithm state and one-off rounds)
    and :meth:`step` (one iteration on flat vectors). The base class builds the per-client
    potentials (:class:`~numpyro_fed.potential.FederatedPotential`), vectorises chains,
    counts bits, checks for divergence and binds the pooled data for ArviZ.

    :param model: an ordinary NumPyro model.
    :param partition: the client partition of the model's data.
    :param step_size: Langevin step size :math:`\\gamma`.
    :param batch_size: per-client minibatch size ``n`` (``None``: full local gradients).
    :param compressor: uplink compressor (a :class:`~numpyro_fed.compressors.Compressor` or
        a spec string); ``None`` is the identity.
    :param prior: who holds the prior, see :class:`~numpyro_fed.potential.FederatedPotential`.
    :param likelihood_weight: likelihood weight (temperature) per client, default 1.
    :param init_strategy: NumPyro initialisation strategy.
    :param check_finite: stop with a clear error when a chain becomes non-finite.
    :param postprocess_deterministic: return deterministic sites (replays the model on the
        pooled data for every kept draw; set ``False`` for speed on large data).
    :param track_potential: also compute :math:`U(z) = U_0(z) + \\sum_i U_i(z)` at every
        step, on all the rows of every client (whatever ``batch_size``), as NumPyro's HMC
        records it: state field ``energy``, collected with
        ``extra_fields=("potential_energy",)``. Each client sends its :math:`U_i` as one
        float32, counted as 32 bits per client and step on the uplink. Default ``False``:
        a minibatch kernel never touches all rows.
    """

    sample_field = "z"
    name = "federated"

    #: the constructor argument that holds the uplink compressor (named in errors)
    _compressor_arg = "compressor"

    def __init__(
        self,
        model: Callable,
        partition: ClientPartition,
        *,
        step_size: float,
        batch_size: int | None = None,
        compressor: Compressor | str | None = None,
        prior: str | Any = "split",
        likelihood_weight: float | Any = 1.0,
        init_strategy: Callable = init_to_uniform,
        check_finite: bool = True,
        postprocess_deterministic: bool = True,
        potential: FederatedPotential | None = None,
        track_potential: bool = False,
    ) -> None:
        self._step_size = check_step_size(step_size)
        self.track_potential = check_bool("track_potential", track_potential)
        if potential is None:
            potential = FederatedPotential(
                model, partition, prior=prior, likelihood_weight=likelihood_weight
            )
        self.potential = potential
        self.partition = partition
        batch_size = check_int("batch_size", batch_size, minimum=1, allow_none=True,
                               hint=" Use None for full-batch gradients.")
        if batch_size is not None:
            partition.check_batch_size(batch_size)
        self.batch_size = batch_size
        self.compressor = get_compressor(compressor)
        check_compressor_dim(self.compressor, potential.dim, potential.dtype,
                             self._compressor_arg)
        self._init_strategy = init_strategy
        self.check_finite = check_finite
        self._postprocess_det = postprocess_deterministic
        self._vectorized = False
        self._model = potential.pooled_model()

    # -- NumPyro kernel protocol ---------------------------------------------------------
    @property
    def model(self) -> Callable:
        """The user's model with the pooled data bound (what ArviZ replays)."""
        return self._model

    @property
    def step_size(self) -> float:
        return self._step_size

    @property
    def default_fields(self):
        return ("z", "bits")

    def postprocess_fn(self, model_args, model_kwargs):
        pot = self._bound(model_kwargs).potential
        constrain = pot.postprocess_fn(self._postprocess_det)
        return lambda z: constrain(pot.ravel(z))

    def _state_axes(self) -> FedState:
        return FedState(
            i=None, z=0, bits=0, totals=0, extra=0, rng_key=0, data=None, guard=0,
            energy=0 if self.track_potential else None,
        )

    def _display_name(self) -> str:
        """The kernel's name in messages."""
        return self.name

    def _guard(self) -> DivergenceGuard:
        return DivergenceGuard.create(
            _DIVERGED.format(kernel=self._display_name(), step_size=self._step_size)
        )

    def _check_run_args(self, model_args, model_kwargs) -> None:
        if model_args:
            raise ValueError(
                f"{type(self).__name__} takes its data from the ClientPartition; call "
                "`mcmc.run(rng_key)` without positional model arguments (put non-row "
                "arguments in `ClientPartition(..., shared={...})`)."
            )
        rows = set(self.partition.keys) & set(model_kwargs or {})
        if rows:
            raise ValueError(
                f"{type(self).__name__} takes its data from the ClientPartition; do not pass "
                f"the per-row arguments {sorted(rows)} to `mcmc.run` (only non-row keyword "
                "arguments, such as hyperparameters, may be given at run time)."
            )

    def _bound(self, model_kwargs) -> FederatedKernel:
        """This kernel with run-time (non-row) model keyword arguments bound into its
        potential; ``self`` when there are none."""
        if not model_kwargs:
            return self
        view = copy.copy(self)
        view.potential = self.potential.with_kwargs(model_kwargs)
        return view

    def wrap_model(self, wrapper: Callable) -> FederatedKernel:
        """A copy of this kernel on ``wrapper(model)`` (same partition and options): used by
        composite algorithms such as :class:`~numpyro_fed.saem.SAEM`, whose wrapped model
        receives hyperparameters as a run-time keyword argument."""
        new = copy.copy(self)
        wrapped = wrapper(self.potential.model)
        pot = self.potential
        new.potential = FederatedPotential(
            wrapped, self.partition, prior=pot.prior_weights if pot.prior_mode == "custom"
            else pot.prior_mode, likelihood_weight=pot.likelihood_weight,
        )
        new._model = new.potential.pooled_model()
        return new

    def refresh(self, state, model_args, model_kwargs):
        """Re-bind the chain to new run-time model arguments without moving it: recomputes
        what the algorithm caches about the target (:meth:`refresh_extra`)."""
        self._check_run_args(model_args, model_kwargs)
        kern = self._bound(model_kwargs)
        pot = kern.potential

        def one(s):
            extra, up, down = kern.refresh_extra(s.extra, pot.ravel(s.z), s.data)
            return s._replace(extra=extra, totals=totals_add(s.totals, up, down))

        if self._vectorized:
            axes = self._state_axes()
            return jax.vmap(one, in_axes=(axes,), out_axes=axes)(state)
        return one(state)

    def refresh_extra(self, extra, x, data):
        """Update the algorithm state after the target changed (e.g. new hyperparameters in
        an SAEM E-step). Default: nothing is cached.

        :return: ``(extra, bits_up, bits_down)`` -- the bits of any communication round
            this needs are added to the cumulative counters.
        """
        return extra, 0, 0

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        self._check_run_args(model_args, model_kwargs)
        self._vectorized, rng_key = split_chain_keys(rng_key)
        keys = chain_keys_list(rng_key) if self._vectorized else [rng_key]
        kern = self._bound(model_kwargs)
        pot = kern.potential
        x0s = []
        for c, k in enumerate(keys):
            if init_params is None:
                x0s.append(pot.init_params(k, self._init_strategy, fold_in=1))
            else:
                params = init_params
                if self._vectorized:
                    params = jax.tree.map(lambda v, c=c: jnp.asarray(v)[c], init_params)
                x0s.append(pot.ravel(params))
        x0 = jnp.stack(x0s) if self._vectorized else x0s[0]
        data = self.partition
        self._num_warmup = int(num_warmup)

        def init_one(x, key, data):
            # the chain key itself is left untouched (as in ULA), so that with equal
            # gradients federated and centralised chains are identical
            extra, up, down = kern.init_extra(random.fold_in(key, 2), x, data)
            energy, e_bits = self._energy(pot, x, data)
            up = up if e_bits is None else bits_add(up, e_bits)
            return FedState(
                jnp.zeros((), jnp.int32), pot.unravel(x), step_bits(0, 0),
                totals_add(totals_zeros(), up, down), extra, key, data, self._guard(), energy,
            )

        # one compiled program (run eagerly, the algorithm's initial round -- ELF's full
        # gradients, U(x0) -- compiles each of its operations: ~130 programs, 4-5 s on a
        # 2-core CPU for B-ELF on the 20 x 500 x 20 toy), traced on every call and compiled
        # once per program content (numpyro_fed._programs): a changed attribute, compressor
        # or model is seen, an unchanged kernel (or an equal new one) compiles nothing
        if self._vectorized:
            axes = self._state_axes()
            fn = jax.vmap(init_one, in_axes=(0, 0, None), out_axes=axes)
        else:
            fn = init_one
        return _programs.compile_program(fn, (x0, rng_key, data),
                                         tag="kernel init")(x0, rng_key, data)

    def sample(self, state, model_args, model_kwargs):
        kern = self._bound(model_kwargs)
        pot = kern.potential
        i, data = state.i, state.data

        def one(s):
            rng_key, k_noise, k_alg = random.split(s.rng_key, 3)
            x = pot.ravel(s.z)
            x_new, extra, up, down = kern.step(k_alg, k_noise, i, x, s.extra, data)
            energy, e_bits = self._energy(pot, x_new, data)
            bits = step_bits(up if e_bits is None else bits_add(up, e_bits), down)
            guard = s.guard.update(x_new, i + 1) if self.check_finite else s.guard
            if energy is not None and self.check_finite:
                guard = guard.update(energy, i + 1)
            return FedState(
                s.i, pot.unravel(x_new), bits, totals_add(s.totals, bits),
                extra, rng_key, s.data, guard, energy,
            )

        if self._vectorized:
            axes = self._state_axes()
            new = jax.vmap(one, in_axes=(axes,), out_axes=axes)(state)
        else:
            new = one(state)
        return new._replace(i=i + 1)

    def _energy(self, pot, x, data):
        """``(U(x), its uplink bits)`` with ``track_potential``, else ``(None, None)``."""
        if not self.track_potential:
            return None, None
        return pot.potential(x, data), 32 * data.num_clients

    def get_diagnostics_str(self, state):
        up = float(np.sum(counter_value(state.bits_up))) / 1e3
        total = float(np.sum(counter_value(state.total_up) + counter_value(state.total_down))) / 8e6
        return f"step size {self._step_size:.2e}. {up:.1f} kbit up/step, {total:.3g} MB total"

    # -- algorithm interface -------------------------------------------------------------
    def init_extra(self, key, x, data):
        """Per-chain algorithm state and the bits of one-off rounds at initialisation.

        :return: ``(extra, bits_up, bits_down)``; bits are Python ints, non-negative int32
            arrays (below :math:`2^{31}`) or :class:`~numpyro_fed.bits.BitCounter`.
        """
        return (), 0, self.broadcast_bits(data)

    @abstractmethod
    def step(self, key, noise_key, i, x, extra, data):
        """One iteration from flat ``x``; returns ``(x_new, extra, bits_up, bits_down)``, the
        bits as in :meth:`init_extra` (counted exactly, see :mod:`numpyro_fed.bits`)."""

    # -- helpers shared by subclasses ----------------------------------------------------
    def broadcast_bits(self, data: ClientPartition) -> int:
        """Bits of broadcasting a dense float32 vector of size ``d`` to every client."""
        return data.num_clients * 32 * self.potential.dim

    def oracle(self, key, x, data):
        """Client gradients :math:`H_i(x)`, shape ``(b, d)``: exact or minibatch
        (:func:`numpyro_fed.algorithms.estimators.plain` on all clients at once)."""
        oracle = estimators.StackedClients(self.potential, data)
        return estimators.plain(self.batch_size).estimate(oracle, key, x, ())

    def compress_all(self, key, messages, compressor: Compressor | None = None,
                     mask: jax.Array | None = None):
        """Compress each client's message (vmapped); return ``(decoded, total bits)``, the
        total over the clients where ``mask`` holds (all by default), see
        :meth:`client_bits`."""
        comp = self.compressor if compressor is None else compressor
        keys = random.split(key, messages.shape[0])
        decoded, bits = jax.vmap(comp)(keys, messages)
        return decoded, self.client_bits(bits, comp, messages.shape[-1], mask)

    @staticmethod
    def client_bits(bits, comp: Compressor, d: int, mask: jax.Array | None = None):
        """Exact total of the clients' coded lengths ``bits`` (one per client, ``int32`` or
        :class:`~numpyro_fed.bits.BitCounter`) of messages of dimension ``d`` compressed by
        ``comp``, over the clients where ``mask`` holds (all when ``None``).

        A static coded length (``comp.static_bits``) gives a Python int (all clients) or a
        dynamic count of clients times that length; otherwise the lengths are summed in
        ``int32`` while ``comp.max_bits`` bounds the sum below :math:`2^{31}`, else in two
        words (:func:`~numpyro_fed.bits.sum_bits`)."""
        b = jax.tree.leaves(bits)[0].shape[0]
        if comp.static_bits is not None:
            length = int(comp.static_bits(d))
            if mask is None:
                return b * length
            return count_times(jnp.sum(mask, dtype=jnp.int32), length, max_count=b)
        bound = None if comp.max_bits is None else int(comp.max_bits(d))
        return sum_bits(bits, max_each=bound, mask=mask)

    def count_clients_bits(self, mask: jax.Array, length: int):
        """Exact bits of a message of static ``length`` to or from the clients where ``mask``
        holds."""
        return count_times(jnp.sum(mask, dtype=jnp.int32), length, max_count=mask.shape[0])

    def communication(self, state) -> dict:
        """Cumulative bits of a state (per chain): ``{"up": ..., "down": ..., "total": ...}``."""
        up = counter_value(state.total_up)
        down = counter_value(state.total_down)
        return {"up": up, "down": down, "total": up + down}


class FederatedLangevin(FederatedKernel):
    """Federated Langevin dynamics (federated SGLD / ULA; Vono et al. 2022, Alg. 1).

    Each client :math:`i` computes :math:`H_i(\\theta)` (full local gradient when
    ``batch_size`` is ``None``, else the minibatch oracle :math:`(N_i/n)\\sum_{j\\in S}\\nabla
    U_{ij}`), sends :math:`\\mathcal{C}(H_i)` to the server, which updates

    .. math:: \\theta^+ = \\theta - \\gamma\\,[\\nabla U_0(\\theta) + \\textstyle\\sum_i
              \\mathcal{C}(H_i(\\theta))] + \\sqrt{2\\gamma}\\, Z

    and broadcasts :math:`\\theta^+` (dense float32). With the identity compressor this is
    the uncompressed baseline (LSD, federated LMC); with an unbiased compressor it is QLSD.
    See :mod:`numpyro_fed.kernels.qlsd` for the variance-reduced variants.

    **Example**

    .. code-block:: python

        kernel = FederatedLangevin(model, clients, step_size=1e-4, batch_size=32)
        mcmc = MCMC(kernel, num_warmup=1000, num_samples=5000)
        mcmc.run(random.key(0))
        idata = numpyro_fed.to_inference_data(mcmc)  # bits_up / bits_down in
        # idata.sample_stats (az.from_numpyro: one `bits` variable, axis (up, down))
    """

    name = "FederatedLangevin"

    def step(self, key, noise_key, i, x, extra, data):
        # a compressor that ignores its key (identity, top-k) needs none: the minibatch
        # takes the algorithm key itself, saving one key derivation per step
        k_batch, k_comp = random.split(key) if self.compressor.randomised else (key, key)
        # QLSD#'s round without memory (numpyro_fed.algorithms.qlsd)
        h = self.oracle(k_batch, x, data)
        decoded, up = self.compress_all(k_comp, h)
        g, _ = qlsd_core.server_aggregate(decoded, (), 0.0)
        x_new = qlsd_core.server_move(noise_key, x, g, 0.0, self.potential.server_grad(x),
                                      self._step_size)
        return x_new, extra, up, self.broadcast_bits(data)
