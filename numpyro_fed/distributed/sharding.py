"""The client axis sharded across devices.

On one device the clients are a leading array axis that the kernels ``vmap`` over. With
several devices (GPUs, TPU cores, or CPU devices from
``XLA_FLAGS=--xla_force_host_platform_device_count=4``), :func:`shard_partition` places
the padded client arrays ``(b, N_max, ...)`` with a
:class:`~jax.sharding.NamedSharding` over a one-axis mesh ``("clients",)``, and
:func:`shard_kernel` returns the same kernel whose state keeps its per-client arrays
(memory terms, control-variate snapshots, error-feedback vectors: every ``(b, ...)`` leaf of
``state.extra``) sharded the same way. Nothing in the kernels changes: ``jit``'s sharding
propagation partitions the vmapped client computations, and the server's sums over clients
(:math:`\\sum_i \\mathcal{C}(H_i)`, :math:`\\sum_i c_i`) become cross-device reductions
(an ``all-reduce`` in the compiled HLO). Random numbers are unchanged (JAX's threefry keys
are split identically whatever the sharding), so for a fixed key the sharded chain equals the
single-device chain up to the order of the floating-point reductions over clients.

**Uneven client counts.** The number of clients must be a multiple of the number of devices
of the mesh: padding with empty clients is impossible without changing the target (every
client of a :class:`~numpyro_fed.partition.ClientPartition` holds data and a prior share),
so :func:`shard_partition` raises a :class:`ValueError` that names the fix (use a device
count that divides ``b``: ``devices=jax.devices()[:k]``, or re-partition into a multiple of
the device count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from numpyro_fed.kernels.federated import FederatedKernel
from numpyro_fed.partition import ClientPartition

__all__ = ["client_mesh", "client_sharding", "shard_partition", "shard_kernel", "CLIENT_AXIS"]

#: Name of the mesh axis over which clients are sharded.
CLIENT_AXIS = "clients"


def client_mesh(devices: Sequence[Any] | None = None) -> Mesh:
    """A one-dimensional mesh ``("clients",)`` over ``devices`` (default: all devices)."""
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("`devices` is empty; pass at least one device (e.g. jax.devices()).")
    return Mesh(np.asarray(devs), (CLIENT_AXIS,))


def _mesh_of(mesh: Mesh | Sequence[Any] | None) -> Mesh:
    if isinstance(mesh, Mesh):
        if CLIENT_AXIS not in mesh.axis_names:
            raise ValueError(
                f"`mesh` must have an axis named {CLIENT_AXIS!r} (got {mesh.axis_names}); build "
                "one with numpyro_fed.distributed.client_mesh(devices)."
            )
        return mesh
    return client_mesh(mesh)


def client_sharding(mesh: Mesh, ndim: int, axis: int = 0) -> NamedSharding:
    """Sharding of an ``ndim``-array whose axis ``axis`` indexes clients (others replicated)."""
    spec = [None] * ndim
    spec[axis] = CLIENT_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def _check_divisible(num_clients: int, mesh: Mesh) -> None:
    n_dev = mesh.shape[CLIENT_AXIS]
    if num_clients % n_dev:
        divisors = [k for k in range(1, n_dev + 1) if num_clients % k == 0]
        raise ValueError(
            f"num_clients={num_clients} is not a multiple of the {n_dev} devices of the mesh: "
            f"each device must hold the same number of clients. Use devices=jax.devices()[:k] "
            f"with k in {divisors}, or build the partition with a multiple of {n_dev} clients "
            "(padding with empty clients would change the target, so it is not done)."
        )


def shard_partition(
    partition: ClientPartition, mesh: Mesh | Sequence[Any] | None = None
) -> ClientPartition:
    """The same partition with its client axis sharded over ``mesh``.

    ``data[k]`` ``(b, N_max, ...)`` and ``sizes`` ``(b,)`` are placed with
    ``NamedSharding(mesh, P("clients"))``: each device holds ``b / n_devices`` whole clients.
    Shared (non-row) arrays are replicated.

    :param partition: a :class:`~numpyro_fed.partition.ClientPartition`.
    :param mesh: a mesh with a ``"clients"`` axis, a sequence of devices, or ``None`` (all
        devices).
    :raises ValueError: when ``num_clients`` is not a multiple of the number of devices.
    """
    if not isinstance(partition, ClientPartition):
        raise TypeError(f"`partition` must be a ClientPartition, got {type(partition).__name__}.")
    mesh = _mesh_of(mesh)
    _check_divisible(partition.num_clients, mesh)
    data = {k: jax.device_put(v, client_sharding(mesh, v.ndim)) for k, v in partition.data.items()}
    replicated = NamedSharding(mesh, PartitionSpec())
    shared = {
        k: jax.device_put(v, replicated) if isinstance(v, jax.Array | np.ndarray) else v
        for k, v in partition.shared.items()
    }
    out = ClientPartition(
        data, np.asarray(partition.sizes_np), shared=shared, client_names=partition.client_names,
        row_index=partition.row_index,
    )
    out.sizes = jax.device_put(out.sizes, client_sharding(mesh, 1))
    return out


def _place(leaf: Any, sharding: NamedSharding) -> Any:
    if isinstance(leaf, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(leaf, sharding)
    return jax.device_put(leaf, sharding)


def _shard_extra(extra: Any, mesh: Mesh, num_clients: int, vectorized: bool) -> Any:
    """Shard every leaf of ``extra`` whose client axis (0, or 1 for vectorized chains) has
    length ``b`` and that has at least one more axis (per-client vectors ``(b, d)``)."""
    axis = 1 if vectorized else 0

    def one(leaf):
        shape = getattr(leaf, "shape", ())
        if len(shape) >= axis + 2 and shape[axis] == num_clients:
            return _place(leaf, client_sharding(mesh, len(shape), axis))
        if len(shape) == axis + 1 and shape[axis] == num_clients and leaf.dtype == bool:
            return _place(leaf, client_sharding(mesh, len(shape), axis))  # participants mask
        return leaf

    return jax.tree.map(one, extra)


class _ShardedKernelMixin:
    """Keeps the per-client arrays of the state sharded over the client mesh."""

    _client_mesh: Mesh

    def _shard_state(self, state):
        mesh = self._client_mesh
        extra = _shard_extra(state.extra, mesh, self.partition.num_clients, self._vectorized)
        return state._replace(extra=extra)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        if isinstance(rng_key, jax.core.Tracer):
            raise ValueError(
                "shard_kernel shards the clients over the devices of its mesh, so its chains "
                "cannot also be mapped over devices (MCMC(chain_method='parallel'), jax.pmap): "
                "use chain_method='vectorized' (chains as an array axis, clients sharded) or "
                "'sequential'."
            )
        state = super().init(rng_key, num_warmup, init_params, model_args, model_kwargs)
        return self._shard_state(state)

    def sample(self, state, model_args, model_kwargs):
        return self._shard_state(super().sample(state, model_args, model_kwargs))

    def refresh(self, state, model_args, model_kwargs):
        return self._shard_state(super().refresh(state, model_args, model_kwargs))


def shard_kernel(kernel: Any, mesh: Mesh | Sequence[Any] | None = None) -> Any:
    """A copy of a federated kernel whose clients are sharded over ``mesh``.

    The partition is sharded with :func:`shard_partition`; the per-client arrays of the
    kernel state are placed (at ``init``) and constrained (inside the jitted ``sample``) with
    the same client sharding. The result is an instance of a subclass of the kernel's class
    (``isinstance`` checks, ``az.from_numpyro`` and
    :func:`~numpyro_fed.infdata.to_inference_data` work unchanged).

    .. code-block:: python

        kernel = shard_kernel(QLSD(model, clients, variant="++", step_size=1e-4, bits=4))
        MCMC(kernel, num_warmup=1000, num_samples=5000).run(random.key(0))

    :param kernel: a :class:`~numpyro_fed.kernels.federated.FederatedKernel` (QLSD, ELF, ...).
    :param mesh: a mesh with a ``"clients"`` axis, a sequence of devices, or ``None``.
    :raises ValueError: when the number of clients is not a multiple of the device count;
        at ``init`` under ``MCMC(chain_method="parallel")`` (or ``jax.pmap``): the devices
        hold clients, so chains run ``"vectorized"`` or ``"sequential"``.
    """
    if not isinstance(kernel, FederatedKernel):
        raise TypeError(
            f"shard_kernel needs a numpyro_fed federated kernel, got {type(kernel).__name__}."
        )
    mesh = _mesh_of(mesh)
    cls = type(kernel)
    if isinstance(kernel, _ShardedKernelMixin):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, _ShardedKernelMixin))
    sharded_cls = type(f"Sharded{cls.__name__}", (_ShardedKernelMixin, cls), {})
    new = object.__new__(sharded_cls)
    new.__dict__.update(kernel.__dict__)
    new.partition = shard_partition(kernel.partition, mesh)
    new._client_mesh = mesh
    return new
