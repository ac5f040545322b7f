"""Federated deployment on Flower (``pip install numpyro_fed[flower]``, ``flwr>=1.20``).

Each client is a Flower ``ClientApp`` holding only its own data and per-client state; the
``ServerApp`` runs the kernel's server step (QLSD#/QLSD*/QLSD++, D-/P-/B-ELF) and returns
the draws as ArviZ InferenceData with the bits on the wire next to the declared bits. See
``docs/deployment.md``.
"""

from numpyro_fed.flower.apps import (
    GridTransport,
    PollingGrid,
    content_bytes,
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
from numpyro_fed.flower.codecs import (
    WireCodec,
    WireFormatError,
    codec_for,
    compressor_from_name,
    dense_codec,
    deployable_spec,
    wire_codec,
)
from numpyro_fed.flower.protocol import ClientWorker, FlowerSpec, ServerCoordinator
from numpyro_fed.flower.runner import (
    FAULTS,
    LoopbackGrid,
    flower_executables,
    make_node_keys,
    make_tls_files,
    run_loopback,
    run_processes,
    to_inference_data,
    write_app,
)

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
