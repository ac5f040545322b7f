"""Flower apps: a ``ClientApp`` per client, a ``ServerApp`` running the server step.

Messages (``message_type="query"``; Flower's Message API, ``flwr>=1.20``):

* server -> client: ``RecordDict({"cmd": ConfigRecord, "arrays": ArrayRecord})`` with the
  round's scalars (phase, round, ack, refresh, w_from, spec) and arrays: ``theta`` (dense
  float32 payload, 32 d bits), ``key`` (the step's 64-bit algorithm key) and, when needed,
  ``zeta`` (QLSD++); for P-/B-ELF, instead of ``theta``, the compressed model updates of the
  rounds ``w_from..round`` (``down``: their payloads back to back, ``down_len``: their byte
  lengths) or the dense shadow model ``w`` (a catch-up that is cheaper dense);
* client -> server: ``RecordDict({"meta": ConfigRecord, "reply": ArrayRecord})`` with the
  round, the declared bits and one ``uint8`` ``payload``: the compressed message in the
  bit-exact format of :mod:`numpyro_fed.flower.codecs`. Nothing else leaves a client (the
  ``hello`` reply carries its index, its number of rows, the shapes/dtypes of a row and the
  fingerprint of its model and settings, computed on synthetic data only:
  :mod:`numpyro_fed.flower.checks`).

The client keeps its state in ``context.state`` (records ``numpyro_fed.arrays`` and
``numpyro_fed.ints``), which the SuperNode persists between the messages of a run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from numpyro_fed.flower.checks import DeploymentError
from numpyro_fed.flower.client import ClientWorker
from numpyro_fed.flower.results import to_inference_data
from numpyro_fed.flower.server import ServerCoordinator
from numpyro_fed.flower.spec import FlowerSpec
from numpyro_fed.flower.transport import GridTransport, PollingGrid, content_bytes
from numpyro_fed.kernels.base import DivergenceError

__all__ = [
    "make_client_app",
    "make_server_app",
    "GridTransport",
    "load_npz_data",
    "serve",
    "serve_and_write",
    "error_path",
    "content_bytes",
]

log = logging.getLogger("numpyro_fed.flower")

_ARRAYS, _INTS = "numpyro_fed.arrays", "numpyro_fed.scalars"


def load_npz_data(context: Context) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
    """Default data loader of a ClientApp: ``node_config`` ``partition-id`` (the client's
    index) and ``data-path`` (an ``.npz`` of the client's rows, one array per model keyword).

    :return: ``(index, rows, shared)``.
    """
    cfg = context.node_config
    for key in ("partition-id", "data-path"):
        if key not in cfg:
            raise ValueError(
                f"SuperNode node_config lacks {key!r}; start it with --node-config "
                "\"partition-id=0 data-path='/path/client0.npz'\""
            )
    with np.load(str(cfg["data-path"])) as f:
        rows = {k: f[k] for k in f.files}
    return int(cfg["partition-id"]), rows, {}


def _load_state(context: Context) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if _ARRAYS in context.state:
        for k, a in context.state[_ARRAYS].items():
            state[k] = a.numpy()
    if _INTS in context.state:
        state.update(dict(context.state[_INTS].items()))
    return state


def _save_state(context: Context, state: Mapping[str, Any]) -> None:
    arrays = {k: Array(np.asarray(v)) for k, v in state.items() if isinstance(v, np.ndarray)}
    ints = {k: v.item() if isinstance(v, np.generic) else v
            for k, v in state.items() if not isinstance(v, np.ndarray)}
    context.state[_ARRAYS] = ArrayRecord(arrays)
    context.state[_INTS] = ConfigRecord(ints)


def make_client_app(
    load_data: Callable[[Context], tuple[int, Mapping, Mapping]] = load_npz_data,
    *, worker: type[ClientWorker] = ClientWorker,
) -> ClientApp:
    """A Flower ``ClientApp`` holding one client's data and state.

    :param load_data: ``context -> (index, rows, shared)``; default :func:`load_npz_data`.
    :param worker: the :class:`~numpyro_fed.flower.protocol.ClientWorker` class (a subclass
        customises the client, e.g. how it imports the model).
    """
    app = ClientApp()
    make_worker = worker
    workers: dict[tuple, ClientWorker] = {}  # one per (run, node) in a long-lived process

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        key = (context.run_id, context.node_id, id(context.state))
        worker = workers.get(key)
        if worker is None:
            index, rows, shared = load_data(context)
            worker = workers[key] = make_worker(index, rows, shared)
        cmd = dict(msg.content["cmd"])
        arrays = {}
        if "arrays" in msg.content:
            arrays = {k: a.numpy() for k, a in msg.content["arrays"].items()}
        meta, payload, state = worker.handle(cmd, arrays, _load_state(context))
        _save_state(context, state)
        content = RecordDict(
            {"meta": ConfigRecord(meta), "reply": ArrayRecord({"payload": Array(payload)})}
        )
        return Message(content, reply_to=msg)

    return app


def serve(grid: Grid, spec: FlowerSpec, **kwargs: Any) -> ServerCoordinator:
    """Run a deployment's server over ``grid``; return the finished coordinator
    (draws in ``.draws``, per-round bits and participants in ``.log``)."""
    coord = ServerCoordinator(spec, GridTransport(grid), **kwargs)
    coord.run()
    return coord


def error_path(output: str | os.PathLike) -> str:
    """Where a server that stopped with a :class:`~numpyro_fed.DivergenceError` writes it
    (JSON, next to ``output``), so that the process that launched the run raises it."""
    return f"{output}.error.json"


def make_server_app(spec: FlowerSpec | None = None, *, output: str | None = None,
                    poll_interval: float | None = None, **kwargs: Any) -> ServerApp:
    """A Flower ``ServerApp`` running the kernel's server step.

    :param spec: the run's :class:`~numpyro_fed.flower.protocol.FlowerSpec`; default: read
        from the run config (``flwr run --run-config``; keys as in ``FlowerSpec``).
    :param output: path of the NetCDF file of the resulting InferenceData; default: the run
        config's ``output`` key (nothing written if absent).
    :param poll_interval: seconds between two pulls of the clients' replies
        (:class:`PollingGrid`); default: Flower's own ``Grid`` (3 s between pulls).
    :param kwargs: options of :class:`~numpyro_fed.flower.protocol.ServerCoordinator`.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        s = spec or FlowerSpec.from_config(context.run_config)
        if poll_interval is not None:
            grid = PollingGrid(grid, poll_interval)
        path = output or context.run_config.get("output")
        app.numpyro_fed_result = serve_and_write(grid, s, path, **kwargs)

    return app


def serve_and_write(grid: Grid, spec: FlowerSpec, path: str | os.PathLike | None,
                    **kwargs: Any) -> ServerCoordinator:
    """The body of the ``ServerApp``: run the server, write the draws to ``path`` (NetCDF)
    when given. A :class:`~numpyro_fed.DivergenceError` or a
    :class:`~numpyro_fed.flower.checks.DeploymentError` (clients refused or gone) is also
    written, to :func:`error_path` of ``path``, before it propagates, so that the process that
    launched the run raises it in turn (:func:`~numpyro_fed.flower.runner.run_processes`)."""
    try:
        coord = serve(grid, spec, **kwargs)
    except DivergenceError as err:
        if path:
            Path(error_path(path)).write_text(json.dumps({
                "type": "DivergenceError", "message": str(err).split("\n")[0],
                "iteration": err.iteration, "chain": err.chain}))
        raise
    except DeploymentError as err:
        if path:
            Path(error_path(path)).write_text(json.dumps({
                "type": type(err).__name__, "message": str(err),
                "rounds": getattr(err, "rounds", None), "clients": getattr(err, "clients", None)}))
        raise
    if path:
        to_inference_data(coord).to_netcdf(str(path))
        log.info("numpyro_fed: draws written to %s", path)
    return coord
