"""Running a deployment (compatibility location: the roles live in
:mod:`~numpyro_fed.flower.loopback` (in one process over Flower messages),
:mod:`~numpyro_fed.flower.processes` (real processes, app writing, process control, the fork
server) and :mod:`~numpyro_fed.flower.security` (TLS and node keys)).
"""

from __future__ import annotations

from numpyro_fed.flower.loopback import FAULTS, LoopbackGrid, run_loopback
from numpyro_fed.flower.processes import (
    flower_executables,
    raise_server_error,
    run_processes,
    write_app,
)
from numpyro_fed.flower.results import to_inference_data
from numpyro_fed.flower.security import make_node_keys, make_tls_files

__all__ = [
    "LoopbackGrid",
    "run_loopback",
    "to_inference_data",
    "FAULTS",
    "write_app",
    "make_tls_files",
    "make_node_keys",
    "run_processes",
    "flower_executables",
    "raise_server_error",
]
