"""Per-client potentials and gradient oracles built from an ordinary NumPyro model.

The target is :math:`\\pi(\\theta) \\propto \\exp(-U(\\theta))` in NumPyro's *unconstrained*
space, with the finite-sum decomposition over the :math:`b` clients of a
:class:`~numpyro_fed.partition.ClientPartition` (Vono et al. 2022, eq. (1);
Karagulyan & Richtárik 2023, eq. (1))

.. math::

    U(\\theta) = U_0(\\theta) + \\sum_{i=1}^b U_i(\\theta), \\qquad
    U_i(\\theta) = -\\tau_i \\sum_{j=1}^{N_i} \\log p(y_{ij} \\mid \\theta)
                   - w_i \\,[\\log p(\\theta) + \\log |J(\\theta)|],

where :math:`J` is the Jacobian of the map from unconstrained to constrained values,
:math:`w_i` is the client's share of the prior (:math:`\\sum_{i=0}^b w_i = 1`; :math:`w_0` is
held by the server) and :math:`\\tau_i` is a likelihood weight (temperature, default 1).

The model is an ordinary NumPyro model. Its keyword arguments named in the partition are
per-data-point arrays (leading axis = data points); the observed sites (and any
``numpyro.factor``) must factorise over that axis, which is checked once at construction on
row sets of the pooled data (also when every client holds one row). An observed site or
factor that does not depend on the rows (a penalty) is held like the prior (counted once, in
the prior shares :math:`w_i`); a prior computed from the data rows (``Normal(0, 1 / N)``,
an autoscaled ``Normal(mean(x), 2.5 std(x))``) is refused with the site named: pass such
values through the partition's ``shared=`` arguments.
The log-likelihood of a batch of rows is computed by ``vmap``-ing the model over single rows,
so padded rows can be masked exactly whatever the plate layout of the model.

Gradient oracles (all vmapped over clients, no Python loop):

* :meth:`FederatedPotential.full_grads` -- :math:`\\nabla U_i(\\theta)` for every client;
* :meth:`FederatedPotential.batch_grads` -- the minibatch oracle
  :math:`(N_i/n)\\sum_{j\\in S_i} \\nabla U_{ij}(\\theta)` of QLSD# (Vono et al. 2022, Alg. 1), plus
  the
  exact prior share;
* :meth:`FederatedPotential.batch_grad_diffs` --
  :math:`(N_i/n)\\sum_{j\\in S_i} [\\nabla U_{ij}(\\theta) - \\nabla U_{ij}(\\zeta)]` on the same
  minibatch (control variates of QLSD* / QLSD++, Vono et al. 2022,
  Alg. 2).

**Minibatch scheme.** Each client draws its :math:`n` indices uniformly *with replacement*
from its :math:`N_i` rows, independently across clients and steps
(:mod:`numpyro_fed.minibatch`, which also says why).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import random
from jax.flatten_util import ravel_pytree
from numpyro import handlers
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.util import _unconstrain_reparam, constrain_fn, initialize_model, transform_fn

from numpyro_fed import _programs
from numpyro_fed.minibatch import (  # batch_indices, client_bits re-exported
    batch_indices,
    client_bits,
    clients_batch_indices,
)
from numpyro_fed.partition import ClientPartition

Array = jax.Array

__all__ = ["FederatedPotential", "PRIOR_MODES", "batch_indices", "client_bits", "prior_weights"]

PRIOR_MODES = ("split", "size", "server")


def prior_weights(mode: str, sizes: Any) -> tuple[np.ndarray, float]:
    """The prior shares of a named ``prior`` mode: ``(w, w0)``, the clients' weights
    :math:`w_i` and the server's :math:`w_0` (summing to 1).

    ``"split"``: :math:`w_i = 1/b` (the papers' convention); ``"size"``: :math:`w_i =
    N_i/N`; ``"server"``: :math:`w_0 = 1`. Used by :class:`FederatedPotential` and by a
    deployment's server (:mod:`numpyro_fed.flower`), which knows the clients' sizes only.

    :raises ValueError: for another mode.
    """
    sizes = np.asarray(sizes, dtype=float)
    b = sizes.shape[0]
    if mode == "split":
        return np.full(b, 1.0 / b), 0.0
    if mode == "size":
        return sizes / sizes.sum(), 0.0
    if mode == "server":
        return np.zeros(b), 1.0
    raise ValueError(
        f"Unknown `prior`={mode!r}; use one of {PRIOR_MODES} or an array of {b} client "
        "weights summing to 1."
    )


def _is_log_det_site(name: str, latent: set[str]) -> bool:
    return name.startswith("_") and name.endswith("_log_det") and name[1:-8] in latent


def _site_log_densities(model, kwargs: Mapping[str, Any], params: Mapping[str, Array],
                        summed: bool = True) -> dict:
    """Log-density (summed unless ``summed`` is false) and observedness of every ``sample``
    site (latent, observed, ``numpyro.factor`` and log-Jacobian sites) of ``model`` at
    unconstrained ``params``, by site name."""
    seeded = handlers.seed(model, rng_seed=0)
    subs = handlers.substitute(seeded, substitute_fn=partial(_unconstrain_reparam, params))
    tr = handlers.trace(subs).get_trace(**kwargs)
    out = {}
    for name, site in tr.items():
        if site["type"] != "sample":
            continue
        lp = site["fn"].log_prob(site["value"])
        if site["scale"] is not None:
            lp = site["scale"] * lp
        if site.get("mask") is not None:
            lp = jnp.where(site["mask"], lp, 0.0)
        out[name] = (jnp.sum(lp) if summed else lp, site["is_observed"])
    return out


def _log_parts(model, kwargs: Mapping[str, Any], params: Mapping[str, Array], latent: set[str],
               prior_sites: frozenset[str] = frozenset()):
    """Return ``(log prior + log|J|, log likelihood)`` of ``model`` at unconstrained ``params``.

    ``prior_sites`` are observed sites that do not depend on the data rows (a penalty
    ``numpyro.factor``): they count once, with the prior."""
    prior = jnp.zeros(())
    lik = jnp.zeros(())
    for name, (lp, observed) in _site_log_densities(model, kwargs, params).items():
        if not observed or _is_log_det_site(name, latent) or name in prior_sites:
            prior = prior + lp
        else:
            lik = lik + lp
    return prior, lik


#: errors JAX raises when Python needs the value of a traced array (``if x[0] > 0``,
#: ``float(x.sum())``, ``np.asarray(x)``)
_CONCRETE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


#: XLA options of the construction-time check program, which runs once: compiled for
#: compile speed (no LLVM optimisation, XLA:CPU's classic emitters; as
#: ``numpyro_fed.saem.model.ONCE_COMPILER_OPTIONS``)
_ONCE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                          "xla_cpu_use_fusion_emitters": False}


def _model_parameters(model) -> tuple[str, ...] | None:
    """Names of the model's parameters (``None`` if its signature cannot be read)."""
    try:
        return tuple(inspect.signature(model).parameters)
    except (TypeError, ValueError):
        return None


def _control_flow_error(model, rows: Mapping[str, Any], shared: Mapping[str, Any],
                        err: Exception) -> ValueError:
    """A clear error for a model that uses Python control flow on data values, naming the
    data arguments whose values it needs (each traced alone)."""
    culprits = []
    for key in rows:
        def run(v, key=key):
            handlers.trace(handlers.seed(model, 0)).get_trace(**{**rows, key: v}, **shared)

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                jax.eval_shape(run, rows[key])
        except _CONCRETE_ERRORS:
            culprits.append(key)
        except Exception:  # noqa: BLE001 -- only the concretisation errors name a culprit
            pass
    which = f"data argument(s) {culprits}" if culprits else "its data arguments"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ValueError(
        f"The model uses Python control flow (if/while, bool(), float(), int(), np.asarray) "
        f"on the values of {which}. The federated kernels evaluate the model under "
        "jax.jit/vmap, where data values are abstract: use jnp.where or jax.lax.cond instead, "
        "or compute the value once on the pooled data and pass it through the partition's "
        f"`shared=` argument. (JAX: {first})"
    )


class _SiteFailure(Exception):
    """Raised inside :func:`_failing_site`'s abstract evaluation: the site that failed (or
    that the model's code was about to reach) and the error."""

    def __init__(self, site: str | None, err: Exception) -> None:
        super().__init__(site)
        self.site, self.err = site, err


def _site_kinds(model, kwargs: Mapping[str, Any]) -> dict[str, str]:
    """``{name: kind}`` of the sites of ``model`` traced (abstractly) on ``kwargs``, in trace
    order; kind is ``"observed"``, ``"latent"`` or the site type (``"deterministic"``,
    ``"plate"``, ...)."""
    kinds: dict[str, str] = {}

    def run():
        tr = handlers.trace(handlers.seed(model, rng_seed=0)).get_trace(**kwargs)
        for name, site in tr.items():
            if site["type"] == "sample":
                kinds[name] = "observed" if site["is_observed"] else "latent"
            else:
                kinds[name] = site["type"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax.eval_shape(run)
    return kinds


def _failing_site(model, kwargs: Mapping[str, Any], params: Mapping[str, Array],
                  site_order: tuple[str, ...]) -> tuple[str | None, Exception | None]:
    """Evaluate ``model`` abstractly (nothing is compiled) on ``kwargs`` at unconstrained
    ``params``, site by site, and return ``(site, error)``: the first ``sample`` site whose
    log-density fails, or, when the model's own code fails, the site it was about to reach
    (the first site of ``site_order``, the model's sites in the order of its trace on the
    pooled data, that it did not reach); ``(None, None)`` when everything evaluates or the
    failure cannot be put on a site."""
    def run(params):
        seeded = handlers.seed(model, rng_seed=0)
        subs = handlers.substitute(seeded, substitute_fn=partial(_unconstrain_reparam, params))
        tracer = handlers.trace(subs)
        try:
            tr = tracer.get_trace(**kwargs)
        except _CONCRETE_ERRORS:
            raise
        except Exception as err:  # noqa: BLE001 -- reported with the site it stopped before
            reached = set(getattr(tracer, "trace", None) or ())
            raise _SiteFailure(next((n for n in site_order if n not in reached), None),
                               err) from None
        for name, site in tr.items():
            if site["type"] != "sample":
                continue
            try:
                site["fn"].log_prob(site["value"])
            except Exception as err:  # noqa: BLE001 -- reported with its site
                raise _SiteFailure(name, err) from None

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.eval_shape(run, params)
    except _SiteFailure as f:
        return f.site, f.err
    except Exception:  # noqa: BLE001 -- not a failure that a site explains
        return None, None
    return None, None


class FederatedPotential:
    """Per-client potentials :math:`U_i` of a NumPyro model on a client partition.

    :param model: an ordinary NumPyro model; it is called with keyword arguments only: the
        partition's data keys (one row at a time, or the pooled data) plus ``partition.shared``.
    :param partition: the client partition of the model's data.
    :param prior: who holds the prior and the log-Jacobian term: ``"split"`` (equal shares
        :math:`w_i = 1/b`, the papers' convention), ``"size"`` (:math:`w_i = N_i/N`),
        ``"server"`` (:math:`w_0 = 1`, clients hold likelihood only), or an array of ``b``
        non-negative client weights summing to 1.
    :param likelihood_weight: :math:`\\tau_i`, a scalar or an array of ``b`` per-client weights.
        The default 1 gives the true posterior; the tempered target of Karagulyan &
        Richtárik 2023,
        :math:`F = \\frac1b\\sum_i [\\frac1{N_i}\\sum_j \\ell_{ij} + \\frac\\lambda2\\|x\\|^2]`
        is ``likelihood_weight = 1/(b N_i)`` with ``prior="split"``.
    :param check: verify once, on row sets of the pooled data, that the observed sites
        factorise over data rows, that no latent site is local to a row and that no prior
        depends on the rows; the model is also traced on abstract rows, so Python control
        flow on data values is reported here. With ``check=False`` (deployed clients) the
        data-independent observed sites are still found (a cheaper test on the first row).
    :raises ValueError: naming the site, argument or key and the fix, for: a prior that
        depends on the data rows, a non-factorising likelihood, a row-local or discrete
        latent site, missing observations, Python control flow on data values, prior or
        likelihood weights of the wrong length.
    """

    def __init__(
        self,
        model: Callable,
        partition: ClientPartition,
        *,
        prior: str | Any = "split",
        likelihood_weight: float | Any = 1.0,
        check: bool = True,
    ) -> None:
        if not isinstance(partition, ClientPartition):
            raise TypeError(
                f"`partition` must be a numpyro_fed.ClientPartition, got {type(partition)}; "
                "build one with ClientPartition.iid / .dirichlet / .from_clients."
            )
        partition.check_model(model)
        self.model = model
        self.partition = partition
        self.shared = dict(partition.shared)
        b = partition.num_clients
        sizes = np.asarray(partition.sizes_np, dtype=float)

        if isinstance(prior, str):
            w, w0 = prior_weights(prior, sizes)
        else:
            try:
                w = np.asarray(prior, dtype=float)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"`prior` must be one of {PRIOR_MODES} or an array of {b} client weights "
                    f"(one per client) summing to 1; got {prior!r}."
                ) from err
            if w.shape != (b,) or np.any(~(w >= 0)) or not np.isclose(w.sum(), 1.0):
                raise ValueError(
                    f"`prior` weights must be {b} non-negative numbers summing to 1, one per "
                    f"client of the partition (num_clients={b}); got shape {w.shape}, sum "
                    f"{w.sum():.4g}."
                )
            w0 = 0.0
        self.prior_mode = prior if isinstance(prior, str) else "custom"
        self.prior_weights = w
        self.server_prior_weight = w0

        try:
            tau = np.asarray(likelihood_weight, dtype=float)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"`likelihood_weight` must be a positive number or an array of {b} positive "
                f"numbers (one per client); got {likelihood_weight!r}."
            ) from err
        if tau.ndim > 1 or (tau.ndim == 1 and tau.shape[0] not in (1, b)):
            raise ValueError(
                f"`likelihood_weight` must be a scalar or an array with one weight per client: "
                f"got length {tau.shape[0] if tau.ndim == 1 else tau.shape} but the partition "
                f"has {b} clients (num_clients={b}); pass {b} weights or one scalar."
            )
        tau = np.broadcast_to(tau, (b,)).copy()
        if np.any(~np.isfinite(tau)) or np.any(tau <= 0):
            raise ValueError(
                f"`likelihood_weight` must be positive and finite, got {likelihood_weight!r}."
            )
        self.likelihood_weight = tau

        # --- structure of the model: latent sites, transforms, deterministic sites -------
        # the pooled data in the USER's row order (not the clients'): every per-row output
        # computed by replaying the model on them (deterministic sites, ArviZ's observed
        # data and log-likelihood) is then in the order of the user's arrays, whatever the
        # plate layout, with no row axis to guess
        pooled = {**partition.pooled(order="user"), **self.shared}
        self._pooled_kwargs = pooled
        self._first_row = {k: np.asarray(v[0, 0]) for k, v in partition.data.items()}
        # compiled initialisers per init strategy (:meth:`init_params`); the analysis below
        # uses the default one, which the kernels' ``init`` then reuses
        init_first = _Initializer(model, pooled, init_to_uniform)
        self._initializers: dict[int, _Initializer] = {id(init_to_uniform): init_first}
        try:
            with warnings.catch_warnings():  # discrete latents are refused below
                warnings.filterwarnings("ignore", "Some algorithms will automatically enumerate",
                                        FutureWarning)
                info = init_first(random.PRNGKey(0))
        except Exception:
            self._check_sites(info=None)  # a clearer error for the common causes, if any
            raise
        self._check_sites(info)
        self._inv_transforms = _inverse_transforms(info)
        z0 = info.param_info.z
        if not z0:
            raise ValueError("The model has no latent `sample` site to sample.")
        self.latent_names = tuple(sorted(z0))
        self._latent = set(self.latent_names)
        flat, unravel = ravel_pytree(z0)
        self.unravel: Callable[[Array], dict] = unravel
        self.dim = int(flat.shape[0])
        self.dtype = flat.dtype
        trace = info.model_trace
        self.deterministic_names = tuple(
            n for n, s in trace.items() if s["type"] == "deterministic"
        )
        observed = tuple(
            n
            for n, s in trace.items()
            if s["type"] == "sample" and s["is_observed"] and not _is_log_det_site(n, self._latent)
        )
        self._w = jnp.asarray(w)
        self._tau = jnp.asarray(tau)
        #: observed sites that do not depend on the data rows (a penalty ``numpyro.factor``):
        #: held with the prior (counted once, shared by ``prior_weights`` and the server)
        self.global_site_names: tuple[str, ...] = ()
        self._prior_sites: frozenset[str] = frozenset()
        if check:
            self._check_latent_shapes(z0)
        self.global_site_names = self._classify_sites(flat, observed, check)
        self._prior_sites = frozenset(self.global_site_names)
        self.observed_names = tuple(n for n in observed if n not in self._prior_sites)
        if not self.observed_names:
            raise ValueError(
                "The model has no observed site that depends on the data rows when called "
                f"with the partition's data keys {partition.keys}"
                + (f" (its data-independent sites {list(self.global_site_names)} are held "
                   "like the prior)" if self.global_site_names else "")
                + "; pass the observations (e.g. `y`) in the partition."
            )

    def with_kwargs(self, kwargs: Mapping[str, Any] | None) -> FederatedPotential:
        """A view of this potential whose model receives extra (non-row) keyword arguments,
        e.g. hyperparameters that change between calls (the E-step of
        :class:`~numpyro_fed.saem.SAEM`). Cheap: shares everything else, safe under ``jit``
        (the values may be tracers)."""
        if not kwargs:
            return self
        rows = set(self.partition.keys) & set(kwargs)
        if rows:
            raise ValueError(
                f"Model arguments {sorted(rows)} are per-row data held by the partition; pass "
                "only non-row arguments at run time."
            )
        view = copy.copy(self)
        view.shared = {**self.shared, **kwargs}
        view._pooled_kwargs = {**self._pooled_kwargs, **kwargs}
        view._initializers = {}  # theirs bake in the kwargs of this potential
        return view

    # ------------------------------------------------------------------ pure functions
    def ravel(self, params: Mapping[str, Array]) -> Array:
        """Flatten a dict of unconstrained values (sorted by site name) to a vector."""
        return ravel_pytree({k: params[k] for k in self.latent_names})[0]

    def _row_kwargs(self, row: Mapping[str, Array]) -> dict:
        return {**{k: v[None] for k, v in row.items()}, **self.shared}

    def log_prior(self, theta: Array) -> Array:
        """:math:`\\log p(\\theta) + \\log|J(\\theta)|` at flat unconstrained ``theta``."""
        # one data row, only to run the model (the prior does not depend on it): taken on the
        # host, as a small constant -- indexing the partition's arrays here, inside a traced
        # program, would put the whole partition in the program as a constant
        row = self._first_row
        prior, _ = _log_parts(self.model, self._row_kwargs(row), self.unravel(theta), self._latent,
                              self._prior_sites)
        return prior

    def point_loglik(self, theta: Array, row: Mapping[str, Array]) -> Array:
        """Log-likelihood of one data row (arrays without the leading data axis)."""
        _, lik = _log_parts(self.model, self._row_kwargs(row), self.unravel(theta), self._latent,
                            self._prior_sites)
        return lik

    def rows_loglik(self, theta: Array, rows: Mapping[str, Array]) -> Array:
        """Per-row log-likelihoods, shape ``(M,)``, of rows with leading axis ``M``."""
        return jax.vmap(self.point_loglik, in_axes=(None, 0))(theta, rows)

    def _client_lik_potential(self, theta, rows, mask, tau):
        ll = self.rows_loglik(theta, rows)
        return -tau * jnp.sum(jnp.where(mask, ll, 0.0))

    def _client_batch_potential(self, theta, rows, size, tau, batch_size):
        ll = self.rows_loglik(theta, rows)
        return -tau * (size / batch_size) * jnp.sum(ll)

    def prior_grad(self, theta: Array) -> Array:
        """:math:`-\\nabla[\\log p + \\log|J|]` (the whole prior potential's gradient)."""
        return jax.grad(lambda t: -self.log_prior(t))(theta)

    def client_potentials(self, theta: Array, data: ClientPartition) -> Array:
        """:math:`(U_1(\\theta), \\dots, U_b(\\theta))`, shape ``(b,)``."""
        lik = jax.vmap(self._client_lik_potential, in_axes=(None, 0, 0, 0))(
            theta, data.data, data.mask, self._tau
        )
        return lik - self._w * self.log_prior(theta)

    def potential(self, theta: Array, data: ClientPartition) -> Array:
        """:math:`U(\\theta) = U_0 + \\sum_i U_i` (NumPyro's potential energy on pooled data)."""
        return jnp.sum(self.client_potentials(theta, data)) - self.server_prior_weight * (
            self.log_prior(theta)
        )

    def full_grads(self, theta: Array, data: ClientPartition) -> Array:
        """Exact local gradients :math:`\\nabla U_i(\\theta)`, shape ``(b, d)``."""
        g = jax.vmap(jax.grad(self._client_lik_potential), in_axes=(None, 0, 0, 0))(
            theta, data.data, data.mask, self._tau
        )
        return g + self._w[:, None] * self.prior_grad(theta)

    def server_grad(self, theta: Array) -> Array:
        """Gradient of the server-held prior share :math:`\\nabla U_0(\\theta)`."""
        if self.server_prior_weight == 0.0:
            return jnp.zeros_like(theta)
        return self.server_prior_weight * self.prior_grad(theta)

    def sample_batch(self, key: Array, data: ClientPartition, batch_size: int) -> dict:
        """Rows of each client's minibatch, leading axes ``(b, n)`` (uniform, with replacement).

        Indices use the multiply-shift map :math:`j = \\lfloor u N_i / 2^{32}\\rfloor` of a
        32-bit random word :math:`u` (Lemire 2019; the words of all clients come from one
        Threefry call on the counters ``(client, j)``,
        :func:`~numpyro_fed.minibatch.client_bits`), in exact integer arithmetic: every row has
        probability within a relative :math:`N_i/2^{32}` (< 1.6e-5) of :math:`1/N_i`. It is
        4x faster and compiles 2x faster than ``random.randint`` with per-client bounds.
        Clients with :math:`\\ge 2^{16}` rows use ``random.randint``."""
        idx = clients_batch_indices(key, data.sizes, batch_size, data.max_size)
        return jax.vmap(lambda rows, ix: jax.tree.map(lambda a: a[ix], rows))(data.data, idx)

    def batch_grads(self, key: Array, theta: Array, data: ClientPartition, batch_size: int):
        """Minibatch oracle of QLSD# (Vono et al. 2022, Alg. 1): shape ``(b, d)``, unbiased for
        :math:`\\nabla U_i(\\theta)`; the prior share is exact, not subsampled."""
        rows = self.sample_batch(key, data, batch_size)
        g = jax.vmap(jax.grad(self._client_batch_potential), in_axes=(None, 0, 0, 0, None))(
            theta, rows, data.sizes, self._tau, batch_size
        )
        return g + self._w[:, None] * self.prior_grad(theta)

    def batch_grad_diffs(
        self, key: Array, theta: Array, zeta: Array, data: ClientPartition, batch_size: int
    ) -> Array:
        """:math:`(N_i/n)\\sum_{j\\in S_i}[\\nabla U_{ij}(\\theta)-\\nabla U_{ij}(\\zeta)]`
        on one shared minibatch per client, plus the exact prior-share difference; shape
        ``(b, d)``. Add :math:`\\nabla U_i(\\zeta)` for an unbiased oracle (Vono et al.
        2022, Alg. 2)."""
        rows = self.sample_batch(key, data, batch_size)
        grad_fn = jax.grad(self._client_batch_potential)

        def one(r, size, tau):
            g_theta = grad_fn(theta, r, size, tau, batch_size)
            return g_theta - grad_fn(zeta, r, size, tau, batch_size)

        g = jax.vmap(one)(rows, data.sizes, self._tau)
        return g + self._w[:, None] * (self.prior_grad(theta) - self.prior_grad(zeta))

    def pointwise_loglik(self, theta: Array, data: ClientPartition) -> Array:
        """Per-row log-likelihood, shape ``(b, N_max)``; padded rows are ``0``."""
        ll = jax.vmap(self.rows_loglik, in_axes=(None, 0))(theta, data.data)
        return jnp.where(data.mask, ll, 0.0)

    # ------------------------------------------------------------------ model plumbing
    def constrain(self, theta: Array, *, deterministic: bool = True) -> dict:
        """Constrained values of the latent sites at flat ``theta`` and, when the model has
        deterministic sites and ``deterministic`` is true, those sites evaluated on the pooled
        data in the user's row order (:meth:`~numpyro_fed.partition.ClientPartition.user_order`;
        this replays the model on all rows): a per-row site lines up with the user's ``X``
        and ``y`` as it would from NUTS on the same arrays."""
        params = self.unravel(theta)
        if deterministic and self.deterministic_names:
            return constrain_fn(
                self.model, (), self._pooled_kwargs, params, return_deterministic=True
            )
        return transform_fn(self._inv_transforms, params)

    def postprocess_fn(self, deterministic: bool = True) -> Callable[[Array], dict]:
        """Map flat unconstrained draws to constrained sites (+ deterministic sites)."""
        return partial(self.constrain, deterministic=deterministic)

    def pooled_model(self) -> Callable:
        """The user's model, bound to the pooled data when called without data.

        Called with none of the partition's data arguments (``model()``, or only non-row
        arguments), it runs on the pooled data in the user's row order
        (:meth:`~numpyro_fed.partition.ClientPartition.user_order`): this is what ArviZ replays
        (``az.from_numpyro`` calls ``mcmc.sampler.model()`` with the ``args`` given to
        ``MCMC.run``, which are empty here because the data travel in the partition). As soon
        as the caller passes any of the partition's data arguments (by position or by name),
        none of them is bound (only ``shared`` and run-time arguments are): the others take
        the model's defaults, so ``Predictive(kernel.model, samples)(key, X=X_new)`` predicts
        ``y`` for the new rows instead of returning the training labels."""
        model, pooled = self.model, self._pooled_kwargs
        row_keys = frozenset(self.partition.keys)
        names = _model_parameters(model)

        def pooled_model(*args, **kwargs):
            if args and names is None:
                positional: list[str] = list(row_keys)  # unknown signature: assume data
            else:
                positional = list(names[: len(args)]) if args else []
            given = set(positional) | set(kwargs)
            if given & row_keys:
                bound = {k: v for k, v in pooled.items() if k not in row_keys}
            else:
                bound = dict(pooled)
            for name in positional:
                bound.pop(name, None)
            bound.update(kwargs)
            return model(*args, **bound)

        pooled_model.__name__ = getattr(model, "__name__", "model")
        pooled_model.__doc__ = model.__doc__
        pooled_model.__wrapped__ = model
        return pooled_model

    def init_params(
        self,
        rng_key: Array,
        init_strategy: Callable = init_to_uniform,
        init_params: Mapping[str, Any] | None = None,
        fold_in: int | None = None,
    ) -> Array:
        """Initial flat unconstrained point for one chain.

        ``init_params`` are *constrained* values (as in ``MCMC.run(init_params=...)`` for
        NumPyro models with :func:`~numpyro.infer.initialization.init_to_value`); missing
        sites are drawn by ``init_strategy``. With ``fold_in`` the point is drawn with
        ``random.fold_in(rng_key, fold_in)`` (folded inside the initialisation's compiled
        program: an eager ``fold_in`` is a program of its own, 0.06-0.1 s to compile)."""
        if init_params is not None:
            from numpyro.infer.initialization import init_to_value

            unknown = set(init_params) - self._latent
            if unknown:
                raise ValueError(
                    f"`init_params` has unknown sites {sorted(unknown)}; latent sites are "
                    f"{list(self.latent_names)}."
                )
            init_strategy = init_to_value(values=dict(init_params))
            init = _Initializer(self.model, self._pooled_kwargs, init_strategy)
        else:  # one compiled program per strategy, for every chain and run
            init = self._initializers.get(id(init_strategy))
            if init is None or init.init_strategy is not init_strategy:
                init = _Initializer(self.model, self._pooled_kwargs, init_strategy)
                self._initializers[id(init_strategy)] = init
        return self.ravel(init(rng_key, fold_in).param_info.z)

    def unconstrain(self, values: Mapping[str, Any]) -> Array:
        """Flat unconstrained vector of *constrained* latent values (e.g. a user's MAP)."""
        missing = self._latent - set(values)
        if missing:
            raise ValueError(f"Values for latent sites {sorted(missing)} are missing.")
        params = {k: jnp.asarray(values[k]) for k in self.latent_names}
        return self.ravel(transform_fn(self._inv_transforms, params, invert=True))

    # ------------------------------------------------------------------ construction checks
    def _missing_data_message(self, site: str | None = None) -> str | None:
        """If the model has parameters that neither the partition nor ``shared`` provides,
        a sentence naming them, the partition's keys and the fix (else ``None``)."""
        params = _model_parameters(self.model)
        if params is None:
            return None
        part = self.partition
        defaults = inspect.signature(self.model).parameters
        unprovided = [a for a in params if a not in part.keys and a not in self.shared
                      and defaults[a].default is None]
        if site is not None and site not in unprovided:
            return None
        if not unprovided:
            return None
        name = site or unprovided[0]
        return (
            f"the model's parameters are {params} and the partition has data keys "
            f"{part.keys}{' and shared keys ' + str(tuple(self.shared)) if self.shared else ''}"
            f", so {unprovided} get their defaults (None) and no observations reach the model"
            + (f" (site {site!r} is sampled as a latent site)" if site else "")
            + f". Put the observations in the partition under the model's argument name, e.g. "
            f"ClientPartition.iid({{..., {name!r}: {name}}}, num_clients, key=key)."
        )

    def _check_sites(self, info: Any) -> None:
        """Missing observations and discrete latent sites get a clear error (before NumPyro's
        enumeration machinery or its funsor import error). ``info`` is the result of
        ``initialize_model`` (its trace of the model on the pooled data), or ``None`` when it
        failed: then the model is traced here."""
        if info is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tr = handlers.trace(handlers.seed(self.model, 0)).get_trace(
                        **self._pooled_kwargs
                    )
            except Exception:  # noqa: BLE001 -- the caller re-raises the original error
                return
        else:
            tr = info.model_trace
        sites = {n: s for n, s in tr.items() if s["type"] == "sample"}
        if not any(s["is_observed"] and not n.endswith("_log_det") for n, s in sites.items()):
            hint = self._missing_data_message()
            raise ValueError(
                "The model has no observed site when called with the partition's data keys "
                f"{self.partition.keys}: "
                + (hint or "pass the observations (e.g. `y`) in the partition.")
            )
        rows = self.partition.total_size
        for name, site in sites.items():
            if site["is_observed"]:
                continue
            shape = jnp.shape(site["value"])
            hint = self._missing_data_message(name)
            if hint and (site["fn"].support.is_discrete or (shape and shape[0] == rows)):
                raise ValueError(f"Latent site {name!r} has no observations: {hint}")
            if site["fn"].support.is_discrete:
                raise ValueError(
                    f"Latent site {name!r} is discrete ({type(site['fn']).__name__}): federated "
                    "Langevin kernels need continuous latent sites (they move all latents by "
                    "gradient steps in an unconstrained real space). Marginalise it in the "
                    "likelihood (sum its values out, e.g. a mixture via "
                    "dist.MixtureSameFamily or a per-row numpyro.factor with logsumexp), or "
                    "make it a continuous relaxation."
                )

    def _raise_if_not_factorising(self, params: Mapping[str, Array], row_sets: list[dict],
                                  err: Exception) -> None:
        """Raise a :class:`ValueError` naming the site if the model, which runs on the pooled
        rows, fails on one of ``row_sets`` (subsets of the pooled rows, one dict of arrays
        each): its likelihood spans the rows (e.g. one ``MultivariateNormal`` over all
        observations), which the clients cannot evaluate apart. Returns when no site
        explains ``err`` (the caller re-raises it)."""
        model, shared = self.model, self.shared
        try:
            kinds = _site_kinds(model, self._pooled_kwargs)
        except Exception:  # noqa: BLE001 -- no diagnosis: the caller re-raises `err`
            return
        n = self.partition.total_size
        order = tuple(k for k, v in kinds.items() if v != "plate")
        for rows in row_sets:
            site, cause = _failing_site(model, {**rows, **shared}, params, order)
            if site is None:
                continue
            m = int(np.shape(next(iter(rows.values())))[0])
            kind = kinds.get(site)
            what = {"observed": "observed site", "latent": "latent site"}.get(
                kind, f"{kind} site" if kind else "site")
            text = str(cause).strip().splitlines()
            first = text[0] if text else ""
            lead = ("The model's log-likelihood does not" if kind == "observed"
                    else "The model does not")
            raise ValueError(
                f"{lead} factorise over the rows of the partition: {what} {site!r} cannot be "
                f"evaluated on {m} of the {n} rows of the partitioned arrays "
                f"{self.partition.keys} ({type(cause).__name__}: {first}), although the "
                f"model runs on all {n} rows. The federated kernels evaluate each client's "
                "rows apart (and single rows), so the likelihood must factorise over the rows "
                "of the partition: one term per row, with observed sites and numpyro.factor "
                "terms inside the data plate. A likelihood that spans the rows (one "
                "MultivariateNormal over all observations, a Gaussian process, a per-row "
                "array passed through `shared`) cannot be split across clients: write it row "
                "by row if the rows are independent given the parameters, or sample the "
                "pooled model with NumPyro's NUTS."
            ) from err

    def _row_sets(self, check: bool) -> tuple[dict, ...]:
        """Row sets of the pooled data for the site checks, grouped by number of rows, each
        with a leading set axis: ``(row 0, row 1)``, ``(rows {0, 1}, rows {0, 0})``, all
        rows; with ``check=False`` (or a single row) ``(row 0,)`` and ``(rows {0, 0},)``."""
        pooled = {k: np.asarray(v) for k, v in self.partition.pooled().items()}
        n = self.partition.total_size
        if not check or n < 2:
            return (
                {k: v[None, :1] for k, v in pooled.items()},
                {k: v[None, [0, 0]] for k, v in pooled.items()},
            )
        return (
            {k: np.stack([v[:1], v[1:2]]) for k, v in pooled.items()},
            {k: np.stack([v[:2], v[[0, 0]]]) for k, v in pooled.items()},
            {k: v[None] for k, v in pooled.items()},
        )

    def _check_latent_shapes(self, z0: dict) -> None:
        """Latent shapes must not depend on the number of rows (no row-local latents); the
        model is traced on one abstract row, which also catches Python control flow on
        data values."""
        part, shared, model = self.partition, self.shared, self.model
        one_row = {k: np.asarray(v)[:1] for k, v in self._pooled_kwargs.items()
                   if k in part.keys}

        def latent_values(rows):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tr = handlers.trace(handlers.seed(model, 0)).get_trace(**rows, **shared)
            return {n: tr[n]["value"] for n in self.latent_names}

        try:
            shapes_row = jax.eval_shape(latent_values, one_row)
        except _CONCRETE_ERRORS as err:
            raise _control_flow_error(model, one_row, shared, err) from None
        except Exception as err:
            self._raise_if_not_factorising(z0, [one_row], err)
            raise
        shapes_all = jax.eval_shape(partial(transform_fn, self._inv_transforms), z0)
        for name in self.latent_names:
            if shapes_row[name].shape != shapes_all[name].shape:
                hint = self._missing_data_message(name)
                raise ValueError(
                    f"Latent site {name!r} has shape {shapes_all[name].shape} on the pooled "
                    f"data but {shapes_row[name].shape} on one row: it is local to data rows. "
                    + (f"Did you forget its observations? {hint} " if hint else "")
                    + "The federated kernels sample global parameters only; integrate local "
                    "latents with numpyro_fed.saem or move them into the likelihood."
                )

    def _row_constant_shapes(self, z0: Array, observed: tuple[str, ...],
                             sets: tuple[dict, ...]) -> bool:
        """Whether some observed site's log-density has the same shape on one row and on
        two rows (a candidate data-independent site). Traced only, nothing compiled: with
        ``check=False`` (deployed clients) the value program runs only for such models."""
        model, shared, unravel = self.model, self.shared, self.unravel

        def shapes(rows):
            lp = _site_log_densities(model, {**rows, **shared}, unravel(z0), summed=False)
            return {k: v[0] for k, v in lp.items() if k in observed}

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                one, two = (jax.eval_shape(shapes, {k: v[0] for k, v in rows.items()})
                            for rows in sets[:2])
        except _CONCRETE_ERRORS as err:
            first = {k: v[0] for k, v in sets[0].items()}
            raise _control_flow_error(model, first, shared, err) from None
        except Exception as err:
            self._raise_if_not_factorising(
                unravel(z0), [{k: v[0] for k, v in rows.items()} for rows in sets[:2]], err)
            raise
        return any(k not in two or one[k].shape == two[k].shape for k in one)

    def _classify_sites(self, z0: Array, observed: tuple[str, ...], check: bool
                        ) -> tuple[str, ...]:
        """Evaluate every site's summed log-density at two unconstrained points on row sets
        of the pooled data (:meth:`_row_sets`, one compiled program) and return the observed
        sites that do not depend on the rows (held like the prior).

        An observed site is a likelihood when it adds up over rows (``f(A + B) = f(A) +
        f(B)``) and data independent when it is the same on every row set; with ``check``
        anything else raises, and so does a latent (or log-Jacobian) site whose
        log-density changes with the rows (a prior computed from the data)."""
        model, shared, unravel = self.model, self.shared, self.unravel
        sets = self._row_sets(check)
        if not check and not self._row_constant_shapes(z0, observed, sets):
            return ()  # every observed site grows with the rows: all are likelihood terms
        z0 = np.asarray(z0)  # numpy: no eager JAX operation (one compilation each)
        z1 = z0 + np.where(np.arange(z0.shape[0]) % 2 == 0, 0.37, -0.29).astype(z0.dtype)
        zs = np.stack([z0, z1])

        def table(zs, sets):
            def one(z, rows):
                lp = _site_log_densities(model, {**rows, **shared}, unravel(z))
                return {k: v[0] for k, v in lp.items()}

            over_z = jax.vmap(one, in_axes=(0, None))
            return [jax.vmap(over_z, in_axes=(None, 0))(zs, rows) for rows in sets]

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = _programs.Program(table, compiler_options=_ONCE_COMPILER_OPTIONS,
                                        tag="potential analysis")(zs, sets)
        except _CONCRETE_ERRORS as err:
            first = {k: v[0] for k, v in sets[0].items()}
            raise _control_flow_error(model, first, shared, err) from None
        except Exception as err:
            self._raise_if_not_factorising(
                unravel(z0), [{k: v[j] for k, v in rows.items()} for rows in sets
                              for j in range(len(next(iter(rows.values()))))], err)
            raise
        # values[name]: (row set, point), row sets ordered as in _row_sets
        names = set().union(*(t.keys() for t in out))
        values = {}
        for name in names:
            cols = [np.asarray(t[name], np.float64) if name in t
                    else np.full((len(next(iter(t.values()))), 2), np.nan) for t in out]
            values[name] = np.concatenate(cols, axis=0)

        def same(a, b):
            return bool(np.all((a == b) | (np.isfinite(a) & np.isfinite(b)
                                           & np.isclose(a, b, rtol=1e-4, atol=1e-4))))

        def close(a, b):
            return bool(np.all(np.isclose(a, b, rtol=1e-4, atol=1e-4)))

        full = check and len(sets) == 3
        n = self.partition.total_size
        if full:
            for name in sorted(names):
                if name in observed:
                    continue
                v = values[name]  # rows: row 0, row 1, rows {0,1}, rows {0,0}, all rows
                if all(same(v[0], v[j]) for j in range(1, 5)):
                    continue
                site = name[1:-8] if _is_log_det_site(name, self._latent) else name
                what = ("the log-Jacobian of the constraint of latent site" if site != name
                        else "the prior of latent site")
                raise ValueError(
                    f"{what[0].upper() + what[1:]} {site!r} depends on the data rows: at the "
                    f"same parameter value its log-density is {v[0, 0]:.6g} on row 0, "
                    f"{v[1, 0]:.6g} on row 1, {v[2, 0]:.6g} on rows 0-1 and {v[4, 0]:.6g} on "
                    f"all {n} rows. The federated potential evaluates the prior once, not on "
                    "the pooled data, so the posterior would be silently wrong. Compute the "
                    "data-dependent value (e.g. a scale from x.shape[0] or np.std(x)) once on "
                    "the pooled data, add a model argument for it and pass it through the "
                    "partition's `shared=` argument, e.g. ClientPartition.iid(data, b, "
                    "key=key, shared={'x_scale': float(np.std(x))})."
                )
        global_sites = []
        for name in observed:
            v = values.get(name)
            if v is None:
                continue
            if full:
                a0, a1, a01, a00, aall = v
                constant = all(same(a0, b) for b in (a1, a01, a00, aall))
                additive = close(a0 + a1, a01) and close(2 * a0, a00)
            else:
                a0, a00 = v[0], v[-1]
                constant = same(a0, a00)
                additive = close(2 * a0, a00)
                a1 = a01 = None
            if constant and not additive:
                global_sites.append(name)
            elif additive or not check or not np.all(np.isfinite(v)):
                continue
            elif a01 is None:  # a single row in all: only the duplicated row to compare
                raise ValueError(
                    "The model's log-likelihood does not factorise over the rows of the "
                    f"partitioned arrays {self.partition.keys}: observed site {name!r} gives "
                    f"{a0[0]:.6g} on one row but {a00[0]:.6g} on that row twice. Observed "
                    "sites and numpyro.factor terms must be per data row (inside the data "
                    "plate); put non-row arguments into `shared`."
                )
            else:
                raise ValueError(
                    "The model's log-likelihood does not factorise over the rows of the "
                    f"partitioned arrays {self.partition.keys}: observed site {name!r} gives "
                    f"{a0[0] + a1[0]:.6g} as the sum of two single-row calls but "
                    f"{a01[0]:.6g} on the same two rows, and it is not independent of the "
                    "rows either. Observed sites and numpyro.factor terms must be per data "
                    "row (inside the data plate); a numpyro.factor that does not use the data "
                    "rows (a penalty) is accepted and held like the prior; put non-row "
                    "arguments into `shared`."
                )
        return tuple(global_sites)


class _Initializer:
    """NumPyro's ``initialize_model(key, model, model_kwargs=..., init_strategy=...)`` with
    its computations in one compiled program, compiled once per model, data and strategy.

    Run eagerly, ``initialize_model`` compiles each of its operations (the model, the
    transforms, the potential and its gradient: 60-100 small programs) one by one, 2-3 s on a
    2-core CPU for a logistic regression; traced under one ``jax.jit`` it is one program
    (0.1-0.3 s). The model trace of the result is the traced one (its sites, shapes,
    distributions and supports; its values are tracers, not to be read), with the initial
    point ``param_info.z`` concrete.

    Falls back to the eager ``initialize_model`` (same values, NumPyro's own errors) when the
    model cannot be traced with its data as constants of a program (Python control flow on
    data values), when a latent site's support depends on traced values (its transform would
    hold tracers), and when no valid initial point was found (so that NumPyro raises its
    ``RuntimeError`` with its site-by-site diagnosis).
    """

    def __init__(self, model: Callable, model_kwargs: dict, init_strategy: Callable) -> None:
        self.model, self.model_kwargs, self.init_strategy = model, model_kwargs, init_strategy
        self.info: Any = None  # the traced ModelInfo (structure only)
        self.compiled: bool | None = None  # None: not tried yet
        # the data arrays are arguments of the program, not constants (a constant is copied
        # into the program: 1000 x 70 000 rows would take minutes to compile); scalars and
        # other leaves stay Python values
        leaves, self._treedef = jax.tree.flatten(model_kwargs)
        self._is_array = [isinstance(v, (np.ndarray, jax.Array)) and np.ndim(v) > 0
                          for v in leaves]
        self._leaves = leaves
        self._arrays = [v for v, a in zip(leaves, self._is_array, strict=True) if a]
        # traced on every call, compiled once per program content (numpyro_fed._programs):
        # a model that reads a global, a closure or a mutable object is traced as it is now
        self._program = _programs.Program(self._run, compiler_options=_ONCE_COMPILER_OPTIONS,
                                          tag="init_params")

    def _run(self, key, fold, arrays):
        # fold=(use, value): a traced choice, so that every call is one program
        use, value = fold
        key = jax.tree.map(partial(jnp.where, use), random.fold_in(key, value), key)
        it = iter(arrays)
        leaves = [next(it) if a else v
                  for v, a in zip(self._leaves, self._is_array, strict=True)]
        model_kwargs = jax.tree.unflatten(self._treedef, leaves)
        info = initialize_model(key, self.model, model_kwargs=model_kwargs,
                                init_strategy=self.init_strategy)
        self.info = info
        pe, grad = info.param_info.potential_energy, info.param_info.z_grad
        valid = jnp.isfinite(pe) & jnp.all(jnp.stack(
            [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grad)] or [jnp.array(True)]))
        return info.param_info.z, valid

    def __call__(self, rng_key: Array, fold_in: int | None = None) -> Any:
        """Initialise with ``rng_key`` (or ``random.fold_in(rng_key, fold_in)``)."""
        valid = False
        if self.compiled is not False:
            try:
                fold = (np.bool_(fold_in is not None), np.uint32(fold_in or 0))
                z, valid = self._program(rng_key, fold, self._arrays)
                # checked on every call: the trace is new
                self.compiled = not any(
                    isinstance(leaf, jax.core.Tracer)
                    for leaf in jax.tree.leaves(_inverse_transforms(self.info)))
            except Exception:  # noqa: BLE001 -- the eager call below: NumPyro's result/error
                self.compiled = False
        if not self.compiled or not bool(valid):
            if fold_in is not None:
                rng_key = random.fold_in(rng_key, fold_in)
            return initialize_model(rng_key, self.model, model_kwargs=self.model_kwargs,
                                    init_strategy=self.init_strategy)
        info = self.info
        return info._replace(param_info=info.param_info._replace(z=z, potential_energy=None,
                                                                 z_grad=None))


def _inverse_transforms(info) -> dict:
    """Bijections unconstrained -> constrained of every latent site of a model trace."""
    from numpyro.distributions.transforms import biject_to

    out = {}
    for name, site in info.model_trace.items():
        if site["type"] == "sample" and not site["is_observed"]:
            out[name] = biject_to(site["fn"].support)
    return out
