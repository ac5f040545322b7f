"""One federated algorithm as one value: :class:`FederatedAlgorithm`.

As NumPyro's ``hmc()`` returns the ``(init_kernel, sample_kernel)`` pair that the ``HMC`` class
binds, and BlackJAX's ``SamplingAlgorithm`` is an ``(init, step)`` pair of pure functions, a
federated algorithm of this package is one immutable value built and validated once
(:func:`numpyro_fed.algorithms.qlsd.algorithm`, :func:`numpyro_fed.algorithms.elf.algorithm`):
its options, its compressors, the one-off setup rounds *as data* (:class:`SetupRound`), and
pure functions for the client half and the server half of a round, with the client's and the
server's state as NamedTuples of the algorithm. Two drivers run it, and neither knows which
algorithm it runs:

* the NumPyro kernel (:class:`~numpyro_fed.kernels.driver.AlgorithmKernel`) applies the client
  functions to all clients at once (a :class:`~numpyro_fed.algorithms.estimators.StackedClients`
  oracle and state leaves with a leading client axis ``b``; the functions are elementwise in
  that axis, so this *is* ``vmap(client_step)`` over the clients, with the minibatch words of
  all clients drawn by one hash call), compresses the messages ``vmap``-ed over the clients,
  counts the bits and calls the server functions;
* the Flower deployment (:mod:`numpyro_fed.flower`) calls the client functions on one
  client's :class:`~numpyro_fed.algorithms.oracles.ClientProblem` and the server functions
  on the ``(b, d)`` decoded messages, with the wire codecs in between.

**One round** (``k``, model ``x_k``; ``setup`` the results of the setup rounds):

1. ``keys = round_keys(k_alg)`` -- the round's keys from the step's algorithm key (the
   *only* place the key conventions of an algorithm live; see also :func:`step_keys`,
   :func:`setup_key` and the salts :data:`X0_SALT`, :data:`SEARCH_SALT`); the participation
   mask is :func:`~numpyro_fed.algorithms.participation.participation_mask` of
   ``keys.participation``;
2. ``point = server_broadcast(noise_key, x, server, srv, setup)`` -- what the server sends:
   ``x_k`` (QLSD), or ``x_{k+1}`` after the server's move (ELF, ``moves_first=True``);
3. the drivers' broadcast channel: dense (``downlink=None``: the clients' model *view* is
   ``point``) or EF21-P (``downlink`` a compressor: ``view = view + Q(point - view)``,
   :func:`broadcast_message` / :func:`broadcast_apply`, the same float32 addition on the
   server and on every client);
4. clients: ``state = refresh(oracle, view, state)`` when ``k % refresh_every == 0`` (an
   SVRG control point), ``message = client_step(oracle, keys, view, state, setup)``, which
   the driver compresses with ``uplink`` (client ``i`` with ``split(keys.uplink, b)[i]``;
   ``uplink=None``: sent dense) into ``decoded``;
5. ``x_new, server = server_step(noise_key, x, point, server, decoded, mask, srv, setup)``
   on the ``(b, d)`` decoded messages (zero rows for absent clients);
6. ``state = commit(state, decoded, mask)`` -- the client's update that depends on the server
   having applied its message (QLSD's memory, EF21's estimator): in process at once, in a
   deployment when the server's next instruction acknowledges the round.

``srv`` is the server's oracle (``srv.server_grad(x)``: the gradient of its share of the
prior), ``oracle`` a :class:`~numpyro_fed.algorithms.estimators.ClientOracle`.

**Setup rounds** (:class:`SetupRound`): before the first step every client receives a point
and replies with its dense exact gradient there. The point is the clients' initial view
(``"start"``: ELF's :math:`g_i = \\nabla U_i(w_0)`, again after the target changed) or the
result of the federated search of :attr:`FederatedAlgorithm.search` (``"search"``: QLSD*'s
:math:`\\theta^\\star`, given or found). Their results (:class:`SetupResult`) are passed to
``init_client`` / ``init_server`` and to every round function as constants.

**An algorithm whose server step is not a Langevin move** fits the same value. Federated
MCMC-SAEM (Kuhn & Lavielle 2004; federated as in Vono et al. 2022's setting): ``x`` is the
hyperparameter :math:`\\theta_k`, broadcast dense (``server_broadcast`` returns ``x``); the
client state holds its latent chain :math:`z_i` and ``client_step`` runs its E-step kernel
(its keys from ``keys.batch``) and returns its sufficient statistics :math:`S_i(z_i)` as the
message; the server state holds the stochastic-approximation average :math:`s_k`, and
``server_step`` applies :math:`s_{k+1} = s_k + \\gamma_k(\\sum_i S_i - s_k)` and returns
:math:`\\theta_{k+1} = \\hat\\theta(s_{k+1})` (the M-step) as ``x_new``; ``commit`` is the
identity (nothing depends on acknowledgement), ``moves_first=False``. Both drivers run it
unchanged: the kernel's bits and divergence check apply as they are, the deployment's
client/server loop and wire codecs too (the statistics go dense, ``uplink=None``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed.compressors import Compressor

__all__ = [
    "X0_SALT",
    "SETUP_SALT",
    "SEARCH_SALT",
    "RoundKeys",
    "SetupRound",
    "SetupResult",
    "SearchPlan",
    "FederatedAlgorithm",
    "AlgorithmState",
    "step_keys",
    "setup_key",
    "broadcast_message",
    "broadcast_apply",
    "state_to_arrays",
    "state_from_arrays",
    "from_description",
]

#: Folded into a chain's key for its initial point (``pot.init_params(key, fold_in=X0_SALT)``).
X0_SALT = 1
#: Folded into a chain's key for the setup rounds (ELF's compressed :math:`w_0`).
SETUP_SALT = 2
#: Folded into a chain's key for the start of the federated search of a setup round.
SEARCH_SALT = 11


def step_keys(rng_key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(next rng_key, noise key, algorithm key)`` of one step: ``random.split(key, 3)``
    (as :class:`~numpyro_fed.kernels.langevin.ULA`, so that with equal gradients federated and
    centralised chains are equal)."""
    rng_key, k_noise, k_alg = random.split(rng_key, 3)
    return rng_key, k_noise, k_alg


def setup_key(chain_key: jax.Array) -> jax.Array:
    """The key of a chain's setup rounds: ``fold_in(chain_key, SETUP_SALT)``."""
    return random.fold_in(chain_key, SETUP_SALT)


class RoundKeys(NamedTuple):
    """The keys of one round, from the step's algorithm key.

    - **batch** -- the minibatch key (client ``i`` uses its own words of it,
      :func:`~numpyro_fed.potential.client_bits`).
    - **uplink** -- client ``i`` compresses with ``random.split(uplink, b)[i]``.
    - **downlink** -- the server's compression of its broadcast (``None``: dense).
    - **participation** -- the participation mask is drawn from it.
    """

    batch: jax.Array
    uplink: jax.Array
    downlink: Any
    participation: jax.Array


class SetupRound(NamedTuple):
    """A one-off round before the first step: the server sends a point, every client replies
    with :math:`\\nabla U_i` there, dense (``32 d`` bits each way per client).

    - **name** -- the round's name (its phase on the wire, its key in ``setup``).
    - **point** -- ``"start"``: the clients' initial view (sent by the initial broadcast,
      redone when the target changes); ``"search"``: the point of the algorithm's
      :class:`SearchPlan` (given, or found by federated minimisation of :math:`U`).
    - **label** -- the round in messages.
    """

    name: str
    point: str
    label: str


class SetupResult(NamedTuple):
    """What a setup round gave: **point**; **grads** -- :math:`\\nabla U_i(\\text{point})`
    (``(d,)`` on one client, ``(b, d)`` stacked or on the server); **total** -- their sum
    (server; ``None`` on a client)."""

    point: jax.Array
    grads: jax.Array
    total: Any = None


class SearchPlan(NamedTuple):
    """The point of a ``"search"`` setup round: **value** -- given constrained site values
    (``None``: search); the search's **method** (``"bb"``, ``"adam"``; ``"bfgs"`` in process
    only), **maxiter**, **gtol**, **learning_rate**
    (:func:`~numpyro_fed.kernels.qlsd.find_theta_star`)."""

    value: Any = None
    method: str = "bb"
    maxiter: int = 2000
    gtol: float = 1e-5
    learning_rate: float = 1e-2

    def options(self) -> dict[str, Any]:
        """The search's keyword arguments."""
        return {"method": self.method, "maxiter": self.maxiter, "gtol": self.gtol,
                "learning_rate": self.learning_rate}


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm: options, compressors, setup rounds and the pure functions of a
    round (see the module docstring for the order in which the drivers call them).

    - **name** -- its display name (``"QLSD++"``, ``"B-ELF"``), in messages and errors.
    - **description** -- ``{"factory": "module:function", "options": {...}}``, JSON: calling
      the factory with the options builds this value again (:func:`from_description`; what a
      deployed client does).
    - **step_size**, **batch_size** (``None``: exact local gradients), **participation**.
    - **uplink** -- the compressor of the client messages; ``None``: sent dense, uncompressed.
    - **downlink** -- ``None``: the model is broadcast dense; a compressor: EF21-P broadcast
      of the model's change (the clients keep a view).
    - **compressed_start** -- the initial view is :math:`\\mathcal{Q}^P(x_0)` (ELF eq. (3)),
      else :math:`x_0`.
    - **setup** -- the :class:`SetupRound` s, in order; **search** -- the
      :class:`SearchPlan` of a ``"search"`` round (else ``None``).
    - **moves_first** -- the server moves before the clients compute (ELF): the message of
      round ``k`` then moves :math:`x_{k+2}`, not :math:`x_{k+1}`.
    - **refresh_every** -- the clients' ``refresh`` period (``None``: never).
    - **round_keys** ``(k_alg) -> RoundKeys``.
    - **init_client** ``(oracle, view, setup) -> client state``.
    - **init_server** ``(x, setup, srv) -> server state``.
    - **refresh** ``(oracle, point, state) -> state``.
    - **client_step** ``(oracle, keys, view, state, setup) -> message``.
    - **commit** ``(state, decoded, mask) -> state`` (``mask``: ``(b,)`` booleans of the
      applied messages of a stack, or ``None``).
    - **server_broadcast** ``(noise_key, x, server, srv, setup) -> point``.
    - **server_step** ``(noise_key, x, point, server, decoded, mask, srv, setup) ->
      (x_new, server)``.
    """

    name: str
    description: Mapping[str, Any]
    step_size: float
    batch_size: int | None
    participation: float
    uplink: Compressor | None
    downlink: Compressor | None
    compressed_start: bool
    setup: tuple[SetupRound, ...]
    search: SearchPlan | None
    moves_first: bool
    refresh_every: int | None
    round_keys: Callable[[jax.Array], RoundKeys]
    init_client: Callable[..., Any]
    init_server: Callable[..., Any]
    refresh: Callable[..., Any]
    client_step: Callable[..., jax.Array]
    commit: Callable[..., Any]
    server_broadcast: Callable[..., jax.Array]
    server_step: Callable[..., tuple[jax.Array, Any]]

    @property
    def keeps_view(self) -> bool:
        """Whether the clients' model view is state of its own (an EF21-P broadcast, or
        client state computed at the view by a ``"start"`` setup round)."""
        return self.downlink is not None or any(r.point == "start" for r in self.setup)


class AlgorithmState(NamedTuple):
    """The algorithm state of a chain in the NumPyro kernel (``FedState.extra``).

    - **clients** -- the client states stacked (leading client axis ``b`` on the per-client
      leaves).
    - **server** -- the server state.
    - **view** -- the model the clients hold (``()`` when not kept:
      :attr:`FederatedAlgorithm.keeps_view`).
    - **participants** -- with ``participation < 1``: boolean ``(b,)`` mask of the clients
      whose message was applied in the last round; ``()`` otherwise.
    """

    clients: Any
    server: Any
    view: Any = ()
    participants: Any = ()


def broadcast_message(point: jax.Array, view: jax.Array) -> jax.Array:
    """The vector an EF21-P broadcast compresses: :math:`x_{k+1} - w_k`."""
    return point - view


def broadcast_apply(view: jax.Array, decoded: jax.Array) -> jax.Array:
    """:math:`w + \\mathcal{Q}^P(\\cdot)`: the same float32 addition on the server and on every
    client (so that their views are equal bit for bit)."""
    return view + decoded


# ----------------------------------------------------------------------------- serialisation
def _paths(tree: Any) -> list[tuple[str, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in leaves:
        parts = []
        for p in path:
            parts.append(str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))))
        out.append((".".join(parts), leaf))
    return out


def state_to_arrays(state: Any, prefix: str = "state.") -> dict[str, np.ndarray]:
    """A client state as ``{prefix + field path: numpy array}`` (nested NamedTuple fields
    joined by dots: ``"state.estimator.zeta"``)."""
    return {prefix + name: np.asarray(leaf) for name, leaf in _paths(state)}


def state_from_arrays(template: Any, arrays: Mapping[str, Any], prefix: str = "state.") -> Any:
    """The state of ``template``'s structure (e.g. ``jax.eval_shape`` of ``init_client``)
    from :func:`state_to_arrays`' dict.

    :raises ValueError: naming a missing field.
    """
    leaves = []
    for name, proto in _paths(template):
        if prefix + name not in arrays:
            raise ValueError(f"client state without its field {name!r}: the client lost its "
                             "state")
        leaves.append(jnp.asarray(arrays[prefix + name], getattr(proto, "dtype", None)))
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def from_description(description: Mapping[str, Any]) -> FederatedAlgorithm:
    """The algorithm of a :attr:`FederatedAlgorithm.description`: its factory
    (``"package.module:function"``, imported) called with its options.

    :raises ValueError: for a malformed reference, or a factory that does not return a
        :class:`FederatedAlgorithm`.
    """
    ref = description.get("factory", "")
    module, sep, attr = str(ref).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"`algorithm` factory must be an import reference "
                         f"'package.module:function', got {ref!r}.")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    alg = obj(**dict(description.get("options", {})))
    if not isinstance(alg, FederatedAlgorithm):
        raise ValueError(f"`algorithm` factory {ref!r} returned {type(alg).__name__}, not a "
                         "FederatedAlgorithm.")
    return alg
