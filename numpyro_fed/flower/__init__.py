"""Federated deployment on Flower (``pip install numpyro_fed[flower]``, ``flwr>=1.20``).

Each client is a Flower ``ClientApp`` holding only its own data and per-client state; the
``ServerApp`` runs the kernel's server step (QLSD#/QLSD*/QLSD++, D-/P-/B-ELF) and returns
the draws as ArviZ InferenceData with the bits on the wire next to the declared bits. See
``docs/deployment.md``.
"""

from numpyro_fed.flower.apps import (
    GridTransport,
    content_bytes,
    load_npz_data,
    make_client_app,
    make_server_app,
    serve,
)
from numpyro_fed.flower.codecs import (
    WireCodec,
    WireFormatError,
    codec_for,
    compressor_from_name,
    dense_codec,
    wire_codec,
)
from numpyro_fed.flower.protocol import ClientWorker, FlowerSpec, ServerCoordinator
from numpyro_fed.flower.runner import FAULTS, LoopbackGrid, run_loopback, to_inference_data

__all__ = [
    "FAULTS",
    "ClientWorker",
    "FlowerSpec",
    "GridTransport",
    "LoopbackGrid",
    "ServerCoordinator",
    "WireCodec",
    "WireFormatError",
    "codec_for",
    "compressor_from_name",
    "content_bytes",
    "dense_codec",
    "load_npz_data",
    "make_client_app",
    "make_server_app",
    "run_loopback",
    "serve",
    "to_inference_data",
    "wire_codec",
]
