"""The result of a deployment as ArviZ InferenceData.

Below :mod:`numpyro_fed.flower.apps` (whose ``ServerApp`` writes it) and
:mod:`numpyro_fed.flower.runner` (which returns it), so that neither imports the other.
"""

from __future__ import annotations

import jax
import numpy as np

from numpyro_fed.flower.protocol import ServerCoordinator

__all__ = ["to_inference_data"]


def to_inference_data(coord: ServerCoordinator):
    """ArviZ ``InferenceData`` of a finished deployment.

    ``posterior``: constrained draws (one chain). ``sample_stats``: per draw, the bits the
    compressor declared (``bits_up_declared``, ``bits_down_declared``, as the in-process
    kernel counts them), the payload bits actually serialised (``bits_up_payload``,
    ``bits_down_payload``: whole bytes), the full Flower message contents
    (``bits_up_wire``, ``bits_down_wire``: protobuf bytes, with keys and round metadata),
    ``num_participants``, and ``participants`` / ``asked`` ``(chain, draw, client)`` masks.
    Rejected messages are listed in the ``rejected`` attribute.
    """
    import arviz as az  # an optional dependency's heavy import, paid only when called

    pot = coord.potential
    draws = np.asarray(coord.draws)
    constrained = jax.vmap(lambda t: pot.constrain(t, deterministic=False))(draws)
    posterior = {k: np.asarray(v)[None] for k, v in constrained.items()}
    lg = coord.log
    stats = {
        name: np.asarray(getattr(lg, name), np.int64)[None]
        for name in ("bits_up_declared", "bits_up_payload", "bits_up_wire",
                     "bits_down_declared", "bits_down_payload", "bits_down_wire")
    }
    parts = np.asarray(lg.participants, bool)
    stats["num_participants"] = parts.sum(1)[None]
    stats["participants"] = parts[None]
    stats["asked"] = np.asarray(lg.asked, bool)[None]
    idata = az.from_dict(
        posterior=posterior, sample_stats=stats,
        dims={"participants": ["client"], "asked": ["client"]},
        coords={"client": np.arange(coord.spec.num_clients)},
    )
    idata.sample_stats.attrs.update({
        "algorithm": coord.spec.algorithm, "compressor": coord.spec.compressor,
        "num_clients": coord.spec.num_clients, "rejected": list(lg.rejected),
    })
    return idata
