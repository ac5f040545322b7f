"""The NumPyro kernel of any :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm`.

:class:`AlgorithmKernel` runs an algorithm value as NumPyro's ``HMC`` runs ``hmc()``: the
client functions on all clients at once (a
:class:`~numpyro_fed.algorithms.estimators.StackedClients` oracle and stacked client states),
each client's compression ``vmap``-ed, the server functions, the bits (exactly, see
:mod:`numpyro_fed.bits`) and the setup rounds (QLSD*'s search and centring, ELF's initial
gradients). :class:`~numpyro_fed.kernels.qlsd.QLSD` and :class:`~numpyro_fed.kernels.elf.ELF`
are constructors over it; an algorithm built elsewhere (a new variant) runs with
``AlgorithmKernel(model, partition, algorithm=alg)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed import _programs
from numpyro_fed.algorithms import estimators
from numpyro_fed.algorithms import theta_star as search_alg
from numpyro_fed.algorithms.federated import (
    SEARCH_SALT,
    AlgorithmState,
    FederatedAlgorithm,
    SetupResult,
    broadcast_apply,
    broadcast_message,
)
from numpyro_fed.algorithms.participation import participation_mask, warn_if_many_empty_rounds
from numpyro_fed.algorithms.theta_star import ThetaStarSearch
from numpyro_fed.bits import scale_bits
from numpyro_fed.kernels.base import check_compressor_dim, split_chain_keys
from numpyro_fed.kernels.langevin import FederatedKernel
from numpyro_fed.partition import ClientPartition

__all__ = ["AlgorithmKernel", "check_theta_star", "centring_at", "find_theta_star"]


# ============================================================================ search rounds
def check_theta_star(pot, value: Mapping[str, Any]) -> jax.Array:
    """Validate QLSD*'s user-given :math:`\\theta^\\star` (constrained site values) against the
    model's latent sites and return it flat and unconstrained.

    :raises ValueError: naming the site for an unknown or missing site, a wrong shape, a
        non-finite value or a value outside the site's support.
    """
    names = list(pot.latent_names)
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"`theta_star` has unknown sites {unknown}; the model's latent sites "
                         f"are {names}.")
    missing = sorted(set(names) - set(value))
    if missing:
        raise ValueError(f"`theta_star` lacks the sites {missing}: give a constrained value for "
                         f"every latent site {names} (or theta_star=None to search for it).")
    proto = jax.eval_shape(lambda x: pot.constrain(x, deterministic=False),
                           jax.ShapeDtypeStruct((pot.dim,), pot.dtype))
    for name in names:
        v = np.asarray(value[name], np.float64)
        want = tuple(np.shape(proto[name]))
        if v.shape != want:
            raise ValueError(f"`theta_star[{name!r}]` has shape {v.shape}, but site {name!r} has "
                             f"shape {want}.")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"`theta_star[{name!r}]` has non-finite values.")
        t = pot._inv_transforms[name]
        u = np.asarray(t.inv(jnp.asarray(v, pot.dtype)))
        if not np.all(np.isfinite(u)):
            raise ValueError(
                f"`theta_star[{name!r}]` = {np.array2string(v, precision=4)} is outside the "
                f"support of site {name!r} ({t.codomain}); give a value inside it.")
    return pot.unconstrain(value)


def user_point(pot, value: Any) -> jax.Array:
    """A given search point (constrained site values; an array for a one-site model; JSON's
    ``{"": ...}`` for the model's only site) as a flat unconstrained vector, checked site by
    site (:func:`check_theta_star`)."""
    if isinstance(value, Mapping) and list(value) == [""]:
        value = value[""]
    if not isinstance(value, Mapping):
        if len(pot.latent_names) != 1:
            raise ValueError(
                "`theta_star` must be a dict of constrained site values "
                f"{list(pot.latent_names)}; an array is accepted only for one site."
            )
        value = {pot.latent_names[0]: value}
    value = {k: np.asarray(v) if isinstance(v, list) else v for k, v in value.items()}
    return check_theta_star(pot, value).astype(pot.dtype)


def centring_at(pot, theta: jax.Array, *, data: ClientPartition | None = None,
                grads: jax.Array | None = None) -> tuple[jax.Array, jax.Array, float, float]:
    """A ``"search"`` setup round at ``theta`` (QLSD*'s centring): the clients' gradients and
    :func:`~numpyro_fed.algorithms.theta_star.centring`, in one program.

    :param data: the client partition, whose gradients are computed here (in process), or
    :param grads: the ``(b, d)`` gradients the clients sent (the Flower server).
    :return: ``(grads, g_star, grad_norm, scale)`` (the norms as Python floats).
    """
    def run(t, data, grads):
        grads = pot.full_grads(t, data) if grads is None else grads
        return (grads, *search_alg.centring(grads, pot.server_grad(t)))

    grads, g_star, gnorm, scale = _programs.Program(run)(theta, data, grads)
    return grads, g_star, float(gnorm), float(scale)


def centring_warning(name: str, gnorm: float, scale: float) -> str | None:
    """The warning of a search point far from a minimiser of :math:`U`, or ``None``."""
    if gnorm > 1e-2 * max(1.0, scale):
        return (
            f"{name}: ||grad U(theta*)|| = {gnorm:.3g} is large (clients' gradients at "
            f"theta* have norm {scale:.3g}): theta* is not a minimiser of the unconstrained "
            "potential. The chain stays unbiased because g* = sum_i grad U_i(theta*) is "
            "added on the server, but the control variates are less effective; give a "
            "better `theta_star` or tighten `theta_star_kwargs`.")
    return None


def find_theta_star(
    potential,
    data: ClientPartition,
    x0: jax.Array,
    *,
    method: str = "bb",
    maxiter: int = 2000,
    gtol: float = 1e-5,
    learning_rate: float = 1e-2,
) -> tuple[jax.Array, ThetaStarSearch]:
    """Federated minimisation of :math:`U = U_0 + \\sum_i U_i` from ``x0`` (one compiled loop).

    Each iteration is one communication round: the server broadcasts :math:`\\theta`
    (``b`` dense float32 vectors), every client returns :math:`\\nabla U_i(\\theta)` (and, for
    BFGS's line search, the scalar :math:`U_i(\\theta)`).

    :param potential: a :class:`~numpyro_fed.potential.FederatedPotential`.
    :param data: the client partition.
    :param x0: flat unconstrained starting point.
    :param method: ``"bb"`` (default: full-gradient descent with Barzilai--Borwein step sizes,
        gradients only, robust in float32), ``"adam"`` (full-gradient Adam) -- both in a
        ``lax.while_loop`` that stops when :math:`\\|\\nabla U\\| \\le` ``gtol``
        :math:`\\cdot\\max(1, \\|\\nabla U(x_0)\\|)` -- or ``"bfgs"``
        (``jax.scipy.optimize.minimize``; its line search needs accurate potential values,
        prefer float64).
    :param maxiter: maximal number of iterations (rounds).
    :param gtol: relative gradient tolerance.
    :param learning_rate: Adam's step size.
    :return: ``(theta_star, ThetaStarSearch)``.
    """
    b, d = data.num_clients, potential.dim

    def grad_u(x):
        return jnp.sum(potential.full_grads(x, data), 0) + potential.server_grad(x)

    if method == "bfgs":
        from jax.scipy.optimize import minimize

        fun = lambda x: potential.potential(x, data)  # noqa: E731
        g0 = jnp.linalg.norm(_programs.Program(grad_u)(x0))
        res = _programs.Program(
            lambda x: minimize(fun, x, method="BFGS",
                               options={"maxiter": maxiter, "gtol": gtol * max(1.0, float(g0))})
        )(x0)
        theta, rounds = res.x, int(res.nfev)
        up_per_round = b * (32 * d + 32)  # gradient + value for the line search
    elif method in search_alg.METHODS:

        def search(x):
            g = grad_u(x)
            tol = search_alg.tolerance(gtol, jnp.linalg.norm(g))

            def body(st):
                st = search_alg.update(method, st, learning_rate)
                return st._replace(g=grad_u(st.x))

            out = lax.while_loop(lambda st: search_alg.keep_going(st, tol, maxiter), body,
                                 search_alg.init(x, g))
            return out.k, out.x

        k, theta = _programs.Program(search)(x0)
        rounds = int(k) + 1  # + the gradient at x0
        up_per_round = b * 32 * d
    else:
        raise ValueError(
            f"Unknown theta* search `method`={method!r}; use 'bb', 'adam' or 'bfgs'."
        )
    g_final = float(jnp.linalg.norm(_programs.Program(grad_u)(theta)))
    g_start = float(jnp.linalg.norm(_programs.Program(grad_u)(x0)))
    info = ThetaStarSearch(
        method=method,
        rounds=rounds,
        bits_up=rounds * up_per_round,
        bits_down=rounds * b * 32 * d,
        grad_norm=g_final,
        converged=search_alg.converged(g_final, g_start, gtol),
    )
    return theta, info


# ============================================================================ the kernel
class AlgorithmKernel(FederatedKernel):
    """A NumPyro ``MCMCKernel`` running a
    :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` over a client partition.

    The chain's ``state.extra`` is an
    :class:`~numpyro_fed.algorithms.federated.AlgorithmState` (``clients``, ``server``,
    ``view``, ``participants``); bits per step are the sample field ``bits``, the setup rounds
    are in the cumulative counters.

    :param model: an ordinary NumPyro model.
    :param partition: the client partition of its data.
    :param algorithm: the algorithm value (its ``step_size``, ``batch_size`` and ``uplink``
        are the kernel's).
    :param kwargs: :class:`~numpyro_fed.kernels.langevin.FederatedKernel` options (``prior``,
        ``likelihood_weight``, ``init_strategy``, ``check_finite``,
        ``postprocess_deterministic``, ``potential``, ``track_potential``).
    """

    name = "AlgorithmKernel"
    #: the class of ``state.extra`` (a subclass of AlgorithmState naming the fields of a
    #: family's state, e.g. ``QLSDExtra``)
    extra_type: type = AlgorithmState

    def __init__(self, model: Callable, partition: ClientPartition, *,
                 algorithm: FederatedAlgorithm, init_strategy: Callable = init_to_uniform,
                 **kwargs: Any) -> None:
        if not isinstance(algorithm, FederatedAlgorithm):
            raise TypeError(f"`algorithm` must be a FederatedAlgorithm, got "
                            f"{type(algorithm).__name__}.")
        super().__init__(model, partition, step_size=algorithm.step_size,
                         batch_size=algorithm.batch_size, compressor=algorithm.uplink,
                         init_strategy=init_strategy, **kwargs)
        self._algorithm = algorithm
        self.participation = algorithm.participation
        warn_if_many_empty_rounds(self.participation, partition.num_clients)
        self._check_downlink(algorithm)
        self._init_setup()

    def _check_downlink(self, alg: FederatedAlgorithm) -> None:
        if alg.downlink is not None:
            check_compressor_dim(alg.downlink, self.potential.dim, self.potential.dtype,
                                 "downlink")

    def _init_setup(self) -> None:
        self.theta_star: jax.Array | None = None
        self.theta_star_search: ThetaStarSearch | None = None
        self.g_star: jax.Array | None = None
        self._grads_star: jax.Array | None = None
        self._star_fingerprint = None
        self._star_bits: tuple[int, int] = (0, 0)
        self._setup_consts: dict[str, SetupResult] = {}

    @property
    def algorithm(self) -> FederatedAlgorithm:
        """The algorithm this kernel runs (public: what ``FlowerSpec.from_kernel`` reads)."""
        return self._algorithm

    def _display_name(self) -> str:
        return self.algorithm.name

    # -- "search" setup rounds (QLSD*'s theta* and g*) ----------------------------------
    def _prepare_setup(self, rng_key) -> None:
        """Find or convert the search point, then the clients' gradients there (once)."""
        alg, pot, data = self.algorithm, self.potential, self.partition
        b, d = data.num_clients, pot.dim
        plan = alg.search
        if plan.value is not None:
            theta = user_point(pot, plan.value)
            search = ThetaStarSearch("user", 0, 0, 0, float("nan"), True)
        else:
            vectorized, key = split_chain_keys(rng_key)
            key = key[0] if vectorized else key
            x0 = pot.init_params(key, self._init_strategy, fold_in=SEARCH_SALT)
            theta, search = find_theta_star(pot, data, x0, **plan.options())
        grads, g_star, gnorm, scale = centring_at(pot, theta, data=data)
        search = search._replace(grad_norm=gnorm)
        msg = centring_warning(alg.name, gnorm, scale)
        if msg is not None:
            warnings.warn(msg, stacklevel=4)
        self.theta_star, self.g_star, self._grads_star = theta, g_star, grads
        self.theta_star_search = search
        self._setup_consts = {r.name: SetupResult(theta, grads, g_star)
                              for r in alg.setup if r.point == "search"}
        # search rounds + broadcast of the point + one uncompressed round of gradients
        self._star_bits = (search.bits_up + b * 32 * d, search.bits_down + b * 32 * d)

    # kept for its callers: QLSD*'s theta* is the search round's point
    _prepare_theta_star = _prepare_setup

    def _centring_fingerprint(self):
        """What the search point and the gradients there are computed from: the program of
        the clients' potentials and gradients (its lowered module, which shows the model as
        it reads now: :func:`numpyro_fed._programs.program_key`), the given point and the
        search's options. ``None``: cannot be keyed (then found again at every ``init``)."""
        pot, data = self.potential, self.partition

        def target(t, data):
            return pot.full_grads(t, data), pot.server_grad(t), pot.potential(t, data)

        key = _programs.program_key(target, (jax.ShapeDtypeStruct((pot.dim,), pot.dtype),
                                             data))
        if key is None:
            return None
        plan = self.algorithm.search
        user = None if plan.value is None else jax.tree.map(
            lambda v: (np.shape(v), np.asarray(v).tobytes()), plan.value)
        try:
            hash(extra := (repr(user), repr(sorted(plan.options().items()))))
        except TypeError:
            return None
        return key, extra

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        if self.algorithm.search is not None:
            # found once, and again when what it is computed from changed (never stale)
            fp = self._centring_fingerprint()
            if not self._setup_consts or fp is None or fp != self._star_fingerprint:
                self._prepare_setup(rng_key)
                self._star_fingerprint = fp
        return super().init(rng_key, num_warmup, init_params, model_args, model_kwargs)

    # -- bits and the broadcast channel ---------------------------------------------------
    def _broadcast_update(self, key, point, view, data):
        """EF21-P broadcast (server half): ``view + Q^P(point - view)`` and the bits received
        by the clients (every client: the broadcast reaches them all)."""
        comp = self.algorithm.downlink
        v, bits = comp(key, broadcast_message(point, view))
        d = point.shape[-1]
        new = broadcast_apply(view, v)
        if comp.static_bits is not None:
            return new, data.num_clients * int(comp.static_bits(d))
        bound = None if comp.max_bits is None else int(comp.max_bits(d))
        return new, scale_bits(bits, data.num_clients, max_bits=bound)

    def _dense(self, data, mask):
        """Bits of one dense float32 vector from (or to) every client, or those of ``mask``."""
        if mask is None:
            return self.broadcast_bits(data)
        return self.count_clients_bits(mask, 32 * self.potential.dim)

    # -- FederatedKernel interface ----------------------------------------------------------
    def _start(self, key, x, data, setup):
        """The clients' initial view and the ``"start"`` setup rounds: ``(view, setup,
        bits_up, bits_down)``."""
        alg, pot = self.algorithm, self.potential
        if alg.compressed_start:
            view, down = self._broadcast_update(key, x, jnp.zeros_like(x), data)
        else:
            view, down = x, self.broadcast_bits(data)
        up = 0
        setup = dict(setup)
        for r in alg.setup:
            if r.point == "start":
                grads = pot.full_grads(view, data)
                setup[r.name] = SetupResult(view, grads, jnp.sum(grads, axis=0))
                up = self.broadcast_bits(data)
        return view, setup, up, down

    def init_extra(self, key, x, data):
        """The setup rounds and the initial client and server states."""
        alg = self.algorithm
        oracle = estimators.StackedClients(self.potential, data)
        view, setup, up, down = self._start(key, x, data, self._setup_consts)
        extra = self.extra_type(
            alg.init_client(oracle, view, setup), alg.init_server(x, setup, self.potential),
            view if alg.keeps_view else (),
            jnp.ones((data.num_clients,), bool) if alg.participation < 1.0 else ())
        s_up, s_down = self._star_bits
        return extra, (up + s_up if s_up else up), down + s_down if s_down else down

    def refresh_extra(self, extra, x, data):
        """The target changed (e.g. SAEM's new hyperparameters): the ``"start"`` setup rounds
        are redone at the view the clients hold (one counted uplink round; the view itself is
        unchanged, so nothing is broadcast)."""
        alg = self.algorithm
        if not any(r.point == "start" for r in alg.setup):
            return extra, 0, 0
        oracle = estimators.StackedClients(self.potential, data)
        setup = dict(self._setup_consts)
        for r in alg.setup:
            if r.point == "start":
                grads = self.potential.full_grads(extra.view, data)
                setup[r.name] = SetupResult(extra.view, grads, jnp.sum(grads, axis=0))
        new = extra._replace(clients=alg.init_client(oracle, extra.view, setup),
                             server=alg.init_server(x, setup, self.potential))
        return new, self.broadcast_bits(data), 0

    def step(self, key, noise_key, i, x, extra, data):
        """One round of the algorithm (order in :mod:`numpyro_fed.algorithms.federated`) on
        all clients at once."""
        alg, pot = self.algorithm, self.potential
        setup = self._setup_consts
        keys = alg.round_keys(key)
        oracle = estimators.StackedClients(pot, data)
        point = alg.server_broadcast(noise_key, x, extra.server, pot, setup)
        mask = None
        if alg.participation < 1.0:
            mask = participation_mask(keys.participation, alg.participation, data.num_clients)
        if alg.downlink is not None:  # EF21-P: every client updates its view
            view, down = self._broadcast_update(keys.downlink, point, extra.view, data)
        else:  # dense: to the clients asked
            view, down = point, self._dense(data, mask)
        clients = extra.clients
        if alg.refresh_every is not None:
            # the counter is shared by vectorized chains: a real branch, taken every l steps
            clients = lax.cond(i % alg.refresh_every == 0,
                               lambda c: alg.refresh(oracle, view, c), lambda c: c, clients)
        msg = alg.client_step(oracle, keys, view, clients, setup)
        if alg.uplink is not None:
            decoded, up = self.compress_all(keys.uplink, msg, alg.uplink, mask=mask)
        else:
            decoded, up = msg, self._dense(data, mask)
        x_new, server = alg.server_step(noise_key, x, point, extra.server, decoded, mask, pot,
                                        setup)
        clients = alg.commit(clients, decoded, mask)
        new = self.extra_type(clients, server, view if alg.keeps_view else (),
                              () if mask is None else mask)
        return x_new, new, up, down
