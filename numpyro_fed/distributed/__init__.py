"""Beyond one device: clients sharded across devices, partial participation.

* :mod:`numpyro_fed.distributed.sharding` -- the client axis of a partition and of a
  federated kernel's state sharded over devices (:func:`shard_partition`,
  :func:`shard_kernel`).
* partial participation (who takes part in a round, the server's reweighting), shared by the
  in-process kernels and the Flower deployment, lives below the kernels in
  :mod:`numpyro_fed.algorithms.participation`; its names are re-exported here.
* one client's gradient oracles (what a deployed client computes on its own rows) are
  algorithm pieces: :class:`numpyro_fed.algorithms.oracles.ClientProblem`
  (:mod:`numpyro_fed.distributed.client` re-exports it). Nothing here computes an
  algorithm step: this package only places arrays on devices.
"""

from numpyro_fed.algorithms.participation import (
    PARTICIPATION_SALT,
    check_participation,
    participation_mask,
    ratio_weights,
)
from numpyro_fed.distributed.sharding import (
    client_mesh,
    client_sharding,
    shard_kernel,
    shard_partition,
)

__all__ = [
    "PARTICIPATION_SALT",
    "check_participation",
    "client_mesh",
    "client_sharding",
    "participation_mask",
    "ratio_weights",
    "shard_kernel",
    "shard_partition",
]
