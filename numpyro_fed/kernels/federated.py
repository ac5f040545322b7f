"""The base class of the federated kernels (:class:`FederatedKernel`) and their state
(:class:`FedState`).

A federated kernel is a NumPyro ``MCMCKernel`` on an ordinary NumPyro model and a
:class:`~numpyro_fed.partition.ClientPartition` of its data: the base class builds the
per-client potentials, vectorises chains, counts the bits of every round exactly and carries
the :class:`~numpyro_fed.kernels.base.DivergenceGuard`; a subclass implements the algorithm
(:meth:`FederatedKernel.init_extra` and :meth:`FederatedKernel.step` on flat vectors):
:class:`~numpyro_fed.kernels.langevin.FederatedLangevin`,
:class:`~numpyro_fed.kernels.qlsd.QLSD`, :class:`~numpyro_fed.kernels.elf.ELF`.
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
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel

from numpyro_fed import _programs
from numpyro_fed._validation import check_bool, check_int
from numpyro_fed.algorithms import estimators
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
    _DIVERGED,
    DivergenceGuard,
    _state_getattr,
    _state_getitem,
    chain_keys_list,
    check_compressor_dim,
    check_step_size,
    split_chain_keys,
)
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential

__all__ = ["FedState", "FederatedKernel"]


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
