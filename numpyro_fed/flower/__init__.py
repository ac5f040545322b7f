"""Federated deployment on Flower (``pip install numpyro_fed[flower]``, ``flwr>=1.20``).

By role: :mod:`~numpyro_fed.flower.spec` (the settings), :mod:`~numpyro_fed.flower.client`
and :mod:`~numpyro_fed.flower.server` (generic over a
:class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm`),
:mod:`~numpyro_fed.flower.transport`, :mod:`~numpyro_fed.flower.catchup` (EF21-P broadcast),
:mod:`~numpyro_fed.flower.codecs` (wire formats), :mod:`~numpyro_fed.flower.checks`,
:mod:`~numpyro_fed.flower.apps` (Flower apps), :mod:`~numpyro_fed.flower.loopback`,
:mod:`~numpyro_fed.flower.processes`, :mod:`~numpyro_fed.flower.security`;
``protocol`` and ``runner`` re-export their former contents.

Each client is a Flower ``ClientApp`` holding only its own data and per-client state; the
``ServerApp`` runs the kernel's server step (QLSD#/QLSD*/QLSD++, D-/P-/B-ELF) and returns
the draws as ArviZ InferenceData with the bits on the wire next to the declared bits. See
``docs/deployment.md``.
"""

from numpyro_fed.flower.apps import (
    load_npz_data,
    make_client_app,
    make_server_app,
    serve,
)
from numpyro_fed.flower.checks import (
    ClientMismatchError,
    DeploymentError,
    ParticipationError,
)
from numpyro_fed.flower.client import ClientWorker
from numpyro_fed.flower.codecs import (
    WireCodec,
    WireFormatError,
    codec_for,
    compressor_from_name,
    dense_codec,
    deployable_spec,
    wire_codec,
)
from numpyro_fed.flower.loopback import FAULTS, LoopbackGrid, run_loopback
from numpyro_fed.flower.processes import flower_executables, run_processes, write_app
from numpyro_fed.flower.results import to_inference_data
from numpyro_fed.flower.security import make_node_keys, make_tls_files
from numpyro_fed.flower.server import ServerCoordinator
from numpyro_fed.flower.spec import FlowerSpec
from numpyro_fed.flower.transport import GridTransport, PollingGrid, content_bytes

__all__ = [
    "FAULTS",
    "ClientMismatchError",
    "ClientWorker",
    "DeploymentError",
    "FlowerSpec",
    "GridTransport",
    "LoopbackGrid",
    "ParticipationError",
    "PollingGrid",
    "ServerCoordinator",
    "WireCodec",
    "WireFormatError",
    "codec_for",
    "compressor_from_name",
    "content_bytes",
    "dense_codec",
    "deployable_spec",
    "flower_executables",
    "load_npz_data",
    "make_client_app",
    "make_node_keys",
    "make_server_app",
    "make_tls_files",
    "run_loopback",
    "run_processes",
    "serve",
    "to_inference_data",
    "wire_codec",
    "write_app",
]
