"""Minibatch row indices: each client's rows from the step's shared key, by Threefry hashing.

**Minibatch scheme.** Each client draws its :math:`n` indices uniformly *with replacement*
from its :math:`N_i` rows (:func:`batch_indices`), independently across clients and steps. The
oracle of :class:`~numpyro_fed.potential.FederatedPotential` is then unbiased and its
covariance is exactly :math:`(N_i^2/n)\\,\\mathrm{Cov}_j[\\nabla U_{ij}]` (population covariance
over the client's rows), which is what the closed-form stationary distributions in the tests
use. Sampling without replacement (``random.choice(replace=False)``) is an order of magnitude
slower on CPU and is not offered.

Word ``j`` of client ``i`` is the Threefry-2x32 hash of the counter pair ``(i, j)`` under the
step's minibatch key (:func:`client_bits`), so a client draws its own rows without the others'
(a deployed client, :mod:`numpyro_fed.flower`, calls :func:`batch_indices` with its own index
and gets the rows the in-process kernels use), and the kernels draw all clients' rows with one
hash call (:func:`clients_batch_indices`). Words become indices by the exact multiply-shift map
:math:`\\lfloor u N_i / 2^{32}\\rfloor` below :math:`2^{16}` rows (Lemire 2019), else by
``random.randint``.

Ground floor: imports nothing from the package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import random
from jax.extend.random import threefry2x32_p

Array = jax.Array

__all__ = ["batch_indices", "client_bits", "clients_batch_indices"]


def _threefry_key_words(key: Array):
    """The two 32-bit words of a Threefry-2x32 key (raw ``uint32[2]`` or typed), else
    ``None`` (another PRNG implementation)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(random.key_impl(key)) != "threefry2x32":
            return None
        key = random.key_data(key)
    elif str(jax.config.jax_default_prng_impl) != "threefry2x32":
        return None
    if key.shape != (2,) or key.dtype != jnp.uint32:
        return None
    return key[0], key[1]


def client_bits(key: Array, clients: Array | int, n: int) -> Array:
    """Uniform 32-bit words for the minibatches of ``clients``: shape ``shape(clients) + (n,)``.

    Word ``j`` of client ``i`` is the Threefry-2x32 hash of the counter pair ``(i, j)`` under
    ``key`` (its two output words XOR-ed, as :func:`jax.random.bits` does with its counters),
    so a client draws its own words without the others' and the kernels draw all ``b``
    clients' words with one hash call, without first deriving a key per client (on CPU every
    Threefry call is a loop of its own: this saves one per minibatch step). Under another
    PRNG implementation client ``i`` uses ``random.bits(fold_in(key, i), (n,))``; RBG keys
    are not ``vmap``-invariant, so with them a deployed client does not reproduce the
    in-process words (Threefry, JAX's default, does)."""
    clients = jnp.asarray(clients)
    words = _threefry_key_words(key)
    if words is None:
        one = lambda i: random.bits(random.fold_in(key, i), (n,), jnp.uint32)  # noqa: E731
        return jnp.vectorize(one, signature="()->(n)")(clients)
    shape = (*clients.shape, n)
    i = jnp.broadcast_to(clients.astype(jnp.uint32)[..., None], shape)
    j = jnp.broadcast_to(jnp.arange(n, dtype=jnp.uint32), shape)
    y1, y2 = threefry2x32_p.bind(words[0], words[1], i, j)
    return y1 ^ y2


def batch_indices(key: Array, client: Array | int, size: Array, batch_size: int,
                  max_size: int) -> Array:
    """Client ``client``'s minibatch: ``batch_size`` row indices uniform on ``0..size-1``
    with replacement (see :meth:`~numpyro_fed.potential.FederatedPotential.sample_batch`),
    from the step's shared minibatch ``key``. ``max_size`` (static: the padded length)
    selects the exact multiply-shift map of :func:`client_bits` words below :math:`2^{16}`
    rows, else ``random.randint`` with the key ``fold_in(key, client)``. Deployments
    (:mod:`numpyro_fed.flower`) call this with their own index to draw the same rows as the
    in-process kernels."""
    if max_size < (1 << 16):
        return _multiply_shift(client_bits(key, client, batch_size), size)
    return random.randint(random.fold_in(key, client), (batch_size,), 0, size)


def _multiply_shift(u: Array, size: Array) -> Array:
    """:math:`\\lfloor u N / 2^{32}\\rfloor` in exact 32-bit arithmetic for :math:`N < 2^{16}`."""
    n = jnp.asarray(size).astype(jnp.uint32)
    return (((u >> 16) * n + (((u & 0xFFFF) * n) >> 16)) >> 16).astype(jnp.int32)


def clients_batch_indices(key: Array, sizes: Array, batch_size: int, max_size: int) -> Array:
    """Every client's minibatch row indices, shape ``(b, batch_size)``: row ``i`` is
    :func:`batch_indices` ``(key, i, sizes[i], batch_size, max_size)``, computed with one hash
    call for all clients below :math:`2^{16}` rows (see
    :meth:`~numpyro_fed.potential.FederatedPotential.sample_batch`)."""
    clients = jnp.arange(sizes.shape[0])
    # all clients' words in one hash call. (Not `vmap(batch_indices)`: inside the kernels'
    # chain vmap that fails to lower on CPU, a carry-type mismatch in the rolled Threefry
    # loop, seen with vectorized minibatch ELF chains.)
    if max_size < (1 << 16):
        u = client_bits(key, clients, batch_size)
        return jax.vmap(_multiply_shift)(u, sizes)
    return jax.vmap(lambda i, size: batch_indices(key, i, size, batch_size,
                                                  max_size))(clients, sizes)
