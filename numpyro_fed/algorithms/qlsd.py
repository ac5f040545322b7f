"""QLSD's client and server halves as pure functions (Vono et al. 2022, Alg. 1 and Alg. 2).

One round of every QLSD variant, with the client oracle :math:`H_i` of the variant given by a
:class:`~numpyro_fed.algorithms.estimators.GradientEstimator` and memory rate
:math:`\\alpha`:

.. math::

    \\text{client } i:&\\quad g_i = \\mathcal{C}\\big(H_i(\\theta_k) - \\eta^{(i)}_k\\big),
    \\qquad \\eta^{(i)}_{k+1} = \\eta^{(i)}_k + \\alpha g_i \\\\
    \\text{server}:&\\quad g = \\eta_k + \\textstyle\\sum_i g_i, \\qquad
    \\eta_{k+1} = \\eta_k + \\alpha \\textstyle\\sum_i g_i, \\qquad
    \\theta_{k+1} = \\theta_k - \\gamma\\,[g + c + \\nabla U_0(\\theta_k)]
    + \\sqrt{2\\gamma}\\,Z_{k+1}

(text of Sec. 2 and Table 1; the pseudo-code of Alg. 2 swaps the "QLSD*" / "QLSD++" labels of
the memory update). With partial participation the server applies the ratio weights
:math:`b/|S_k|` to the received messages and only the senders update their memory
(:mod:`numpyro_fed.algorithms.participation`).

The functions are written for one client *or* a stack of clients (a leading axis ``b``):
the in-process kernel (:class:`~numpyro_fed.kernels.qlsd.QLSD`) applies
:func:`client_message` / :func:`client_commit` to all clients at once and the compressor
``vmap``-ed over them; a deployed client (:mod:`numpyro_fed.flower`) calls them on its own
arrays and its wire codec. The server half (:func:`server_aggregate`, :func:`server_move`)
takes the decoded messages as a ``(b, d)`` array with zero rows for the clients that sent
nothing, in process and deployed alike, so both sum in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed._validation import check_float, check_int, check_positive_float
from numpyro_fed.algorithms import estimators
from numpyro_fed.algorithms.federated import (
    FederatedAlgorithm,
    RoundKeys,
    SearchPlan,
    SetupResult,
    SetupRound,
)
from numpyro_fed.algorithms.langevin import langevin_move
from numpyro_fed.algorithms.participation import check_participation, ratio_weights
from numpyro_fed.algorithms.theta_star import METHODS
from numpyro_fed.algorithms.variants import canonical_variant, variant_info
from numpyro_fed.compressors import Compressor, get_compressor

__all__ = ["QLSDClientState", "QLSDServerState", "algorithm", "client_message",
           "client_commit", "server_aggregate", "server_move"]


class QLSDClientState(NamedTuple):
    """What a QLSD client keeps between rounds (``(d,)`` leaves for one client, ``(b, d)``
    stacked).

    - **eta** -- memory term :math:`\\eta^{(i)}_k` (shape ``(0,)`` without memory).
    - **estimator** -- the gradient estimator's state (QLSD++:
      :class:`~numpyro_fed.algorithms.estimators.SVRGState`; ``()`` otherwise).
    """

    eta: jax.Array
    estimator: Any


def client_message(h: jax.Array, eta: jax.Array, memory_rate: float) -> jax.Array:
    """The vector client :math:`i` compresses: :math:`H_i - \\eta^{(i)}` with memory,
    :math:`H_i` without."""
    return h - eta if memory_rate > 0 else h


def client_commit(eta: jax.Array, decoded: jax.Array, memory_rate: float) -> jax.Array:
    """The client's memory after the server applied its message ``decoded``:
    :math:`\\eta^{(i)} + \\alpha\\, g_i` (unchanged without memory)."""
    return eta + memory_rate * decoded if memory_rate > 0 else eta


def server_aggregate(decoded: jax.Array, eta: jax.Array, memory_rate: float,
                     mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The server's gradient estimate :math:`g` and its new memory :math:`\\eta`.

    :param decoded: ``(b, d)`` decoded client messages :math:`g_i` (rows of absent clients:
        any finite value with ``mask``, zeros by convention).
    :param eta: the server memory :math:`\\eta_k = \\sum_i \\eta^{(i)}_k` (``(0,)`` without
        memory).
    :param memory_rate: :math:`\\alpha`.
    :param mask: ``(b,)`` booleans of the clients whose message is applied; ``None``: all,
        without reweighting.
    :return: ``(g, eta)``.
    """
    if mask is None:
        total = jnp.sum(decoded, 0)
        applied = decoded
    else:
        weights = ratio_weights(mask).astype(decoded.dtype)
        total = jnp.sum(weights[:, None] * decoded, 0)
        applied = jnp.where(mask[:, None], decoded, 0.0)
    if memory_rate > 0:
        return eta + total, eta + memory_rate * jnp.sum(applied, 0)
    return total, eta


def server_move(key: jax.Array, x: jax.Array, g: jax.Array, offset: Any,
                server_grad: jax.Array, step_size: float) -> jax.Array:
    """The Langevin move :math:`\\theta - \\gamma[g + c + \\nabla U_0(\\theta)] +
    \\sqrt{2\\gamma}Z` with the noise drawn from ``key``."""
    return langevin_move(key, x, g + offset + server_grad, step_size)


# ============================================================================ the algorithm
class QLSDServerState(NamedTuple):
    """What the QLSD server keeps between rounds: **eta** -- its memory
    :math:`\\eta_k = \\sum_i \\eta^{(i)}_k` (shape ``(0,)`` without memory)."""

    eta: jax.Array


#: The QLSD variants' setup rounds: QLSD* collects :math:`\\nabla U_i(\\theta^\\star)` once.
_STAR = SetupRound("star", "search", "QLSD* g* round")


def _estimator_for(variant: str, batch_size: int | None, refresh_every: int,
                   oracle: Callable | None) -> Callable[[Mapping[str, Any]], Any]:
    """``setup -> GradientEstimator`` of a variant of the table
    (:data:`numpyro_fed.algorithms.variants.VARIANTS`): where a new QLSD variant selects its
    estimator (:mod:`numpyro_fed.algorithms.estimators`)."""
    if variant == "*":  # the control variate at theta*, from the setup round
        return lambda setup: estimators.fixed_control_variate(
            setup["star"].point, setup["star"].grads, 0.0, batch_size)
    est = estimators.for_variant(variant, batch_size, refresh_every=refresh_every,
                                 oracle=oracle)
    return lambda setup: est


def algorithm(
    variant: str = "#",
    *,
    step_size: float,
    compressor: Compressor | str | None = None,
    memory_rate: float | None = None,
    refresh_every: int = 100,
    batch_size: int | None = None,
    participation: float = 1.0,
    theta_star: Mapping[str, Any] | Any | None = None,
    theta_star_method: str = "bb",
    theta_star_maxiter: int = 2000,
    theta_star_gtol: float = 1e-5,
    theta_star_lr: float = 1e-2,
    oracle: Callable | None = None,
    estimator: Any = None,
    dim: int | None = None,
    name: str | None = None,
    factory: str = "numpyro_fed.algorithms.qlsd:algorithm",
    warn_stacklevel: int = 2,
) -> FederatedAlgorithm:
    """QLSD#, QLSD* or QLSD++ (Vono et al. 2022, Alg. 1-2) as a
    :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm`, validated here once.

    :param variant: any spelling of :data:`~numpyro_fed.algorithms.variants.VARIANTS`.
    :param step_size: :math:`\\gamma`.
    :param compressor: an *unbiased* compressor (or its spec); ``None``: identity (LSD).
    :param memory_rate: :math:`\\alpha`; ``None``: :math:`1/(\\omega+1)` for QLSD++ (needs
        ``dim``), 0 otherwise; above that bound warns, outside [0, 1] raises.
    :param refresh_every: QLSD++'s control-point period ``l``.
    :param batch_size: per-client minibatch ``n``; ``None``: exact local gradients.
    :param participation: probability that a client takes part in a round.
    :param theta_star: QLSD*: given constrained site values of :math:`\\theta^\\star`
        (``None``: federated search with ``theta_star_method`` / ``_maxiter`` / ``_gtol`` /
        ``_lr``).
    :param oracle: QLSD# only: a custom stacked oracle ``(key, theta, data) -> (b, d)`` (in
        process only: not deployable).
    :param estimator: a :class:`~numpyro_fed.algorithms.estimators.GradientEstimator` to use
        instead of the variant's (a variant defined outside the package: see
        CONTRIBUTING.md); with ``name`` and ``factory`` for its messages and its description.
    :param dim: the model's dimension (for the default memory rate and its bound).
    :raises ValueError: for a biased compressor, an option of another variant, a memory rate
        outside [0, 1], naming the argument.
    """
    variant = canonical_variant("qlsd", variant)
    step_size = check_positive_float("step_size", step_size)
    participation = check_participation(participation)
    batch_size = check_int("batch_size", batch_size, minimum=1, allow_none=True,
                           hint=" Use None for full-batch gradients.")
    refresh_every = check_int("refresh_every", refresh_every, minimum=1)
    comp = get_compressor(compressor)
    if not comp.unbiased or comp.omega is None:
        raise ValueError(
            f"QLSD needs an unbiased compressor (H2), got {comp.name}; use quantize(...), "
            "rand_k(...) or identity(). Biased/contractive compressors belong to ELF."
        )
    if memory_rate is None:
        if variant == "++" and dim is None:
            raise ValueError("QLSD++'s default `memory_rate` 1/(omega+1) needs the model's "
                             "`dim`; give `memory_rate`.")
        memory_rate = 1.0 / (float(comp.omega(dim)) + 1.0) if variant == "++" else 0.0
    if dim is not None:
        bound = 1.0 / (float(comp.omega(dim)) + 1.0)
        what = (f" (QLSD Thm. 3 asks for at most 1/(omega+1) = {bound:.4g} for {comp.name} "
                f"in dimension {dim}; 0 switches memory off)")
    else:
        bound, what = None, " (0 switches QLSD's memory off)"
    alpha = check_float("memory_rate", memory_rate, low=0.0, high=1.0, what=what)
    if bound is not None and alpha > bound * (1 + 1e-9):
        warnings.warn(
            f"`memory_rate`={alpha:.4g} exceeds the theoretical bound 1/(omega+1) = "
            f"{bound:.4g} of {comp.name} in dimension {dim} (QLSD Thm. 3); the memory terms "
            "may amplify the compression noise.",
            stacklevel=warn_stacklevel + 1,
        )
    if oracle is not None and variant != "#":
        raise ValueError("A custom `oracle` is only used by variant='#' (QLSD, Alg. 1).")
    if theta_star is not None and variant != "*":
        raise ValueError("`theta_star` is only used by variant='*' (QLSD*).")
    search = None
    if variant == "*":
        if theta_star_method not in theta_star_methods():
            raise ValueError(f"`theta_star_method` must be one of {theta_star_methods()}, got "
                             f"{theta_star_method!r}.")
        search = SearchPlan(
            theta_star, theta_star_method,
            check_int("theta_star_maxiter", theta_star_maxiter, minimum=0),
            check_positive_float("theta_star_gtol", theta_star_gtol),
            check_positive_float("theta_star_lr", theta_star_lr))
    est_for = (_estimator_for(variant, batch_size, refresh_every, oracle) if estimator is None
               else (lambda setup: estimator))
    refresh_period = est_for({"star": SetupResult(None, None)}).refresh_every
    mem = alpha > 0

    def round_keys(k_alg):
        k_batch, k_comp = random.split(k_alg)
        return RoundKeys(k_batch, k_comp, None, k_alg)

    def init_client(oracle_, view, setup):
        proto = jax.eval_shape(oracle_.full_grad, view)
        eta = (jnp.zeros(proto.shape, view.dtype) if mem else jnp.zeros((0,), view.dtype))
        return QLSDClientState(eta, est_for(setup).init(oracle_, view))

    def init_server(x, setup, srv):
        return QLSDServerState(jnp.zeros(x.shape, x.dtype) if mem
                               else jnp.zeros((0,), x.dtype))

    def refresh(oracle_, point, state):
        return state._replace(estimator=est_for({}).refresh(oracle_, point, state.estimator))

    def client_step(oracle_, keys, view, state, setup):
        h = est_for(setup).estimate(oracle_, keys.batch, view, state.estimator)
        return client_message(h, state.eta, alpha)

    def commit(state, decoded, mask=None):
        applied = decoded if mask is None else jnp.where(mask[:, None], decoded, 0.0)
        return state._replace(eta=client_commit(state.eta, applied, alpha))

    def server_broadcast(noise_key, x, server, srv, setup):
        return x

    def server_step(noise_key, x, point, server, decoded, mask, srv, setup):
        g, eta = server_aggregate(decoded, server.eta, alpha, mask)
        offset = setup["star"].total if variant == "*" else 0.0
        return server_move(noise_key, x, g, offset, srv.server_grad(x), step_size), \
            QLSDServerState(eta)

    options = {
        "variant": variant, "step_size": step_size, "batch_size": batch_size,
        "compressor": None if comp.spec is None else comp.spec.text,
        "memory_rate": alpha, "refresh_every": refresh_every, "participation": participation,
    }
    if search is not None:
        options.update(theta_star=_jsonable(theta_star), theta_star_method=search.method,
                       theta_star_maxiter=search.maxiter, theta_star_gtol=search.gtol,
                       theta_star_lr=search.learning_rate)
    description: dict[str, Any] = {"factory": factory, "options": options}
    if oracle is not None:
        description["error"] = "A custom QLSD `oracle` cannot be deployed (it is not data)."
    elif comp.spec is None:
        description["error"] = (f"`compressor`={comp.name} has no `spec`: a custom "
                                "compressor cannot be deployed.")
    return FederatedAlgorithm(
        name=name or variant_info("qlsd", variant).display, description=description,
        step_size=step_size, batch_size=batch_size, participation=participation,
        uplink=comp, downlink=None, compressed_start=False,
        setup=(_STAR,) if variant == "*" else (), search=search, moves_first=False,
        refresh_every=refresh_period, round_keys=round_keys, init_client=init_client,
        init_server=init_server, refresh=refresh, client_step=client_step, commit=commit,
        server_broadcast=server_broadcast, server_step=server_step)


def theta_star_methods() -> tuple[str, ...]:
    """The methods of QLSD*'s search (:data:`~numpyro_fed.algorithms.theta_star.METHODS` and
    ``"bfgs"``, in process only)."""
    return (*METHODS, "bfgs")


def _jsonable(value: Any) -> Any:
    """Constrained site values as JSON (``{name: nested list}``; a bare array as ``{"":
    ...}``, mapped to the model's only site)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        value = {"": value}
    return {k: np.asarray(v, np.float64).tolist() for k, v in value.items()}


def from_fields(fields: Mapping[str, Any]) -> FederatedAlgorithm:
    """The QLSD algorithm of a deployment's flat settings
    (:class:`~numpyro_fed.flower.spec.FlowerSpec` fields: ``variant``, ``compressor``,
    ``memory_rate``, ``refresh_every``, ``batch_size`` (0: exact), ``theta_star`` (JSON) and
    its search options, ``step_size``, ``participation``; ``downlink`` and ``w0`` must keep
    their defaults)."""
    if fields.get("downlink", "identity") not in ("identity", None):
        raise ValueError(f"`downlink`={fields['downlink']!r} is only used by P-ELF and B-ELF "
                         "(QLSD broadcasts the dense model).")
    if fields.get("w0", "x0") != "x0":
        raise ValueError("`w0='compressed'` (ELF eq. (3)) needs algorithm 'pelf' or 'belf'.")
    star = fields.get("theta_star") or None
    if isinstance(star, str):
        import json

        try:
            star = json.loads(star)
        except json.JSONDecodeError as err:
            raise ValueError(f"`theta_star` must be JSON of site values: {err}") from err
        if not isinstance(star, dict) or not star:
            raise ValueError("`theta_star` must be a JSON object of constrained site values, "
                             "e.g. '{\"w\": [0.1, -0.2]}'.")
    variant = canonical_variant("qlsd", fields.get("variant", "#"))
    search = {}
    if variant == "*":
        search = {k: fields[k] for k in ("theta_star_method", "theta_star_maxiter",
                                         "theta_star_gtol", "theta_star_lr") if k in fields}
    return algorithm(
        variant, step_size=fields["step_size"], compressor=fields.get("compressor"),
        memory_rate=fields.get("memory_rate", 0.0),
        refresh_every=fields.get("refresh_every", 100),
        batch_size=fields.get("batch_size") or None,
        participation=fields.get("participation", 1.0), theta_star=star, **search)


def to_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """The deployment's flat settings of :func:`algorithm`'s ``options`` (its description):
    the inverse of :func:`from_fields`."""
    out = {"algorithm": variant_info("qlsd", options["variant"]).algorithm,
           "variant": options["variant"], "compressor": options["compressor"],
           "memory_rate": options["memory_rate"], "refresh_every": options["refresh_every"],
           "batch_size": options["batch_size"] or 0, "step_size": options["step_size"],
           "participation": options["participation"]}
    if options["variant"] == "*":
        import json

        if options.get("theta_star") is not None:
            out["theta_star"] = json.dumps(options["theta_star"])
        out.update({k: options[k] for k in ("theta_star_method", "theta_star_maxiter",
                                            "theta_star_gtol", "theta_star_lr")})
    return out
