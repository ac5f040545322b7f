"""Running a deployment in one process over Flower messages (tests, notebooks).

:class:`LoopbackGrid` is a Flower ``Grid`` that delivers every message to a real
``ClientApp`` in this process, round-tripping each content through Flower's protobuf
serialisation (so only what Flower can put on the wire reaches the other side, and its size
is measured), with per-node ``Context`` persistence and fault injection (a client that does
not answer, answers too late, crashes, or sends a corrupted or oversized message);
:func:`run_loopback` runs a deployment over it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid

from numpyro_fed.flower.apps import make_client_app, serve
from numpyro_fed.flower.protocol import FlowerSpec, ServerCoordinator

__all__ = ["FAULTS", "LoopbackGrid", "run_loopback"]

#: Faults understood by :class:`LoopbackGrid` (``faults(node_id, group_id) -> name | None``).
FAULTS = ("drop", "timeout", "crash", "corrupt", "oversize")


def _wire(content: RecordDict) -> RecordDict:
    return recorddict_from_proto(recorddict_to_proto(content))


class LoopbackGrid(Grid):
    """A Flower ``Grid`` whose nodes are ``ClientApp`` calls in this process.

    :param client_app: the ``ClientApp`` every node runs.
    :param node_configs: one ``node_config`` per node (e.g. ``{"partition-id": i}``).
    :param faults: optional ``(node_id, group_id) -> fault`` with a fault of :data:`FAULTS`:
        ``"drop"`` (the node never gets the message), ``"timeout"`` (it runs but its reply
        never arrives), ``"crash"`` (the ClientApp raises), ``"corrupt"`` (payload bytes
        garbled), ``"oversize"`` (payload padded far beyond any valid message).
    :param first_node_id: node ids are ``first_node_id + 7 * k`` (not the client indices, as
        with a SuperLink).
    """

    def __init__(self, client_app: Any, node_configs: Sequence[Mapping[str, Any]],
                 faults: Callable[[int, str], str | None] | None = None,
                 first_node_id: int = 1001) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        # what a SuperLink sets in a ServerApp process (run 1, the server's node 0, task 0)
        for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, value)
        self.client_app = client_app
        self.faults = faults
        ids = [first_node_id + 7 * k for k in range(len(node_configs))][::-1]
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config=dict(cfg), state=RecordDict(),
                         run_config={})
            for nid, cfg in zip(ids, node_configs, strict=True)
        }
        self._replies: dict[str, Message] = {}
        self._run = None

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            node = msg.metadata.dst_node_id
            fault = self.faults(node, msg.metadata.group_id) if self.faults else None
            if fault not in (None, *FAULTS):
                raise ValueError(f"unknown fault {fault!r}; use one of {FAULTS}")
            if fault == "drop" or node not in self.contexts:
                continue
            delivered = Message(_wire(msg.content), dst_node_id=node,
                                message_type=msg.metadata.message_type,
                                group_id=msg.metadata.group_id)
            delivered.metadata.__dict__["_message_id"] = mid
            delivered.metadata.__dict__["_src_node_id"] = 0
            if fault == "crash":
                from flwr.app import Error

                reply = Message(Error(code=0, reason="ClientApp raised RuntimeError"),
                                reply_to=delivered)
            else:
                reply = self.client_app(delivered, self.contexts[node])
            if fault == "timeout":
                continue
            if not reply.has_error():
                content = _wire(reply.content)
                if fault in ("corrupt", "oversize"):
                    payload = content["reply"]["payload"].numpy().copy()
                    if fault == "corrupt":
                        payload = np.concatenate([payload[::-1] ^ 0x5A, [0xFF]]).astype(np.uint8)
                    else:
                        payload = np.concatenate([payload, np.ones(1 << 16, np.uint8)])
                    content["reply"] = ArrayRecord({"payload": Array(payload)})
                reply = Message(content, reply_to=delivered)
            self._replies[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(list(messages)))


def run_loopback(spec: FlowerSpec, clients: Sequence[Mapping[str, Any]], *,
                 faults: Callable[[int, str], str | None] | None = None,
                 client_app: Any = None, **kwargs: Any) -> ServerCoordinator:
    """Run a deployment in this process: one ``ClientApp`` per entry of ``clients`` (client
    ``i`` holds only ``clients[i]``), the server over a :class:`LoopbackGrid`.

    :param spec: the :class:`~numpyro_fed.flower.protocol.FlowerSpec`.
    :param clients: per-client rows (mappings of arrays with a leading row axis).
    :param faults: fault injection, see :class:`LoopbackGrid`.
    :param client_app: a custom ``ClientApp`` (default: :func:`make_client_app`).
    :param kwargs: options of :class:`~numpyro_fed.flower.protocol.ServerCoordinator`.
    """
    data = [dict(c) for c in clients]

    def load(context):
        i = int(context.node_config["partition-id"])
        return i, data[i], {}

    app = client_app or make_client_app(load)
    grid = LoopbackGrid(app, [{"partition-id": i} for i in range(len(data))], faults=faults)
    return serve(grid, spec, **kwargs)


