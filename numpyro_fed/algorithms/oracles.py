"""One client's gradient oracles (:class:`ClientProblem`): the
:class:`~numpyro_fed.algorithms.estimators.ClientOracle` of a deployed client.

In process, a kernel computes every client's oracle at once, ``vmap``-ed over the padded
client axis, with client ``i`` drawing its minibatch from the words ``(i, j)`` of the step's
batch key (:func:`~numpyro_fed.minibatch.client_bits`) and compressing with
``random.split(k, b)[i]``. :class:`ClientProblem` computes the same quantities for a single
client that holds only its own (unpadded) rows -- what a Flower ``ClientApp`` runs -- with
the same random keys, so a deployment reproduces the in-process chain up to floating-point
summation order (masked sums over ``N_max`` padded rows in process, plain sums over ``N_i``
rows here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed import _programs
from numpyro_fed._validation import check_int
from numpyro_fed.minibatch import batch_indices
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential

__all__ = ["ClientProblem", "client_key", "batch_indices"]  # batch_indices re-exported

class _ClientPrograms:
    """``full_grad(theta, rows, mask, tau, w)``, ``batch_grad(key, index, theta, rows, size,
    tau, w, n)`` and ``batch_grad_diff(key, index, theta, zeta, rows, size, tau, w, n)`` of
    one client's potential, each compiled on its first call (per batch size ``n``) through
    :mod:`numpyro_fed._programs`: traced afresh when a :class:`ClientProblem` is built, and
    compiled once per program *content*, so the ``b`` clients of one process (a loopback run,
    a simulation) share one executable, and a model or setting changed between two runs is
    never served by the previous run's program."""

    __slots__ = ("fns", "compiled")

    def __init__(self, pot: FederatedPotential, max_rows: int) -> None:
        def full_grad(theta, rows, mask, tau, w):
            g = jax.grad(pot._client_lik_potential)(theta, rows, mask, tau)
            return g + w * pot.prior_grad(theta)

        def batch(key, index, rows, size, n):
            return jax.tree.map(lambda a: a[batch_indices(key, index, size, n, max_rows)],
                                rows)

        def batch_grad(key, index, theta, rows, size, tau, w, n):
            r = batch(key, index, rows, size, n)
            g = jax.grad(pot._client_batch_potential)(theta, r, size, tau, n)
            return g + w * pot.prior_grad(theta)

        def batch_grad_diff(key, index, theta, zeta, rows, size, tau, w, n):
            r = batch(key, index, rows, size, n)
            grad_fn = jax.grad(pot._client_batch_potential)
            g = grad_fn(theta, r, size, tau, n) - grad_fn(zeta, r, size, tau, n)
            return g + w * (pot.prior_grad(theta) - pot.prior_grad(zeta))

        self.fns = {"full_grad": full_grad, "batch_grad": batch_grad,
                    "batch_grad_diff": batch_grad_diff}
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, name: str, n: int | None, *args: Any) -> jax.Array:
        fn = self.fns[name]
        if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(args)):
            # inside the caller's transformation: traced into its program, nothing compiled
            return fn(*args) if n is None else fn(*args, n)
        run = self.compiled.get((name, n))
        if run is None:
            program = fn if n is None else (lambda *a: fn(*a, n))
            run = _programs.compile_program(program, args, tag=f"client.{name}")
            self.compiled[(name, n)] = run
        return run(*args)


def client_key(key: jax.Array, index: int, num_clients: int) -> jax.Array:
    """Client ``index``'s key of a per-client split: ``random.split(key, b)[index]``, as the
    kernels' vmapped oracles and compressions use it."""
    return random.split(key, num_clients)[index]


class ClientProblem:
    """One client's potential :math:`U_i` and gradient oracles (QLSD Alg. 1-2, ELF Alg. 1).

    :math:`U_i(\\theta) = -\\tau \\sum_{j\\le N_i} \\log p(y_{ij}\\mid\\theta) - w\\,[\\log
    p(\\theta) + \\log|J(\\theta)|]` with the client's likelihood weight :math:`\\tau` and prior
    share :math:`w` (see :class:`~numpyro_fed.potential.FederatedPotential`).

    :param model: the NumPyro model (keyword arguments only).
    :param rows: the client's data, arrays with a leading row axis ``N_i``.
    :param prior_weight: the client's share :math:`w_i` of the prior.
    :param likelihood_weight: :math:`\\tau_i`.
    :param shared: non-row model keyword arguments.
    :param max_size: ``N_max``, the largest client size of the federation (it selects the
        index-sampling scheme of :meth:`~numpyro_fed.potential.FederatedPotential.sample_batch`;
        default: this client's size).
    :param index: this client's position ``i`` in the federation (its minibatch words are
        those of client ``i`` under the step's batch key).
    :param potential: optional :class:`~numpyro_fed.potential.FederatedPotential` of
        ``model`` on exactly these ``rows`` and ``shared`` (one client, ``check=False``), to
        reuse instead of building it again (its construction traces the model: the costly
        part of this constructor).
    """

    def __init__(
        self,
        model: Callable,
        rows: Mapping[str, Any],
        *,
        prior_weight: float,
        likelihood_weight: float = 1.0,
        shared: Mapping[str, Any] | None = None,
        max_size: int | None = None,
        index: int = 0,
        potential: FederatedPotential | None = None,
    ) -> None:
        index = check_int("index", index, minimum=0)
        if potential is None:
            part = ClientPartition.from_clients([dict(rows)], shared=shared)
            potential = FederatedPotential(model, part, prior="split", check=False)
        part = potential.partition
        self.potential = pot = potential
        self.rows = {k: v[0] for k, v in part.data.items()}
        self.size = jnp.asarray(part.sizes)[0]
        self.mask = jnp.ones((int(part.sizes_np[0]),), bool)
        self.tau = jnp.asarray(np.float64(likelihood_weight))
        self.w = jnp.asarray(np.float64(prior_weight))
        self.dim = pot.dim
        max_rows = int(part.sizes_np[0]) if max_size is None else int(max_size)
        progs = _ClientPrograms(pot, max_rows)
        self.index = int(index)
        rows_, size, mask, tau, w = self.rows, self.size, self.mask, self.tau, self.w
        i = jnp.asarray(self.index, jnp.int32)
        self.full_grad = lambda theta: progs("full_grad", None, theta, rows_, mask, tau, w)
        self.batch_grad = lambda key, theta, n: progs("batch_grad", int(n), key, i, theta,
                                                      rows_, size, tau, w)
        self.batch_grad_diff = lambda key, theta, zeta, n: progs(
            "batch_grad_diff", int(n), key, i, theta, zeta, rows_, size, tau, w)

    def oracle(self, key: jax.Array, theta: jax.Array, batch_size: int | None) -> jax.Array:
        """:math:`H_i(\\theta)`: exact gradient, or the minibatch oracle drawn from the
        step's batch key ``k_batch`` (shared by all clients; this client uses its own words of
        it, see :func:`~numpyro_fed.minibatch.client_bits`)."""
        if batch_size is None:
            return self.full_grad(theta)
        return self.batch_grad(key, theta, batch_size)
