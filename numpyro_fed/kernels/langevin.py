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

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro.infer.hmc_util import dual_averaging
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.infer.util import initialize_model
from numpyro.util import identity

from numpyro_fed.algorithms import qlsd as qlsd_core
from numpyro_fed.algorithms.langevin import mala_log_ratio, mala_sq_residuals
from numpyro_fed.kernels.base import (
    _DIVERGED,  # also imported from here by numpyro_fed.flower.protocol
    DivergenceGuard,
    _state_getattr,
    _state_getitem,
    chain_keys_list,
    check_step_size,
    langevin_move,
    split_chain_keys,
)
from numpyro_fed.kernels.federated import FederatedKernel, FedState  # re-exported

__all__ = [
    "LangevinState",
    "MALAState",
    "FedState",
    "ULA",
    "MALA",
    "FederatedKernel",
    "FederatedLangevin",
]


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
