"""How the server reaches the clients: the :class:`Transport` protocol (a Flower grid, the
loopback grid of the tests, ...), the :class:`Reply` it returns, and the transports over a Flower
``Grid`` (:class:`GridTransport`, :class:`PollingGrid`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid

__all__ = ["Reply", "Transport", "GridTransport", "PollingGrid", "content_bytes"]


def content_bytes(content) -> int:
    """Size in bytes of a message's content as Flower serialises it (protobuf)."""
    return recorddict_to_proto(content).ByteSize()


@dataclass
class Reply:
    """A client's reply as received by the server (``error`` set when it carried none)."""

    meta: dict[str, Any] = field(default_factory=dict)
    payload: np.ndarray | None = None
    wire_bytes: int = 0
    error: str | None = None


class Transport(Protocol):
    """How the server reaches the clients (Flower grid, loopback, ...)."""

    def nodes(self) -> list[int]:
        """Ids of the connected clients."""

    def exchange(self, requests: Mapping[int, tuple[dict, dict]], phase: str, round_: int,
                 timeout: float) -> tuple[dict[int, Reply], dict[int, int]]:
        """Send ``{node: (cmd, arrays)}``; return the replies received within ``timeout``
        and the serialised size in bytes of each request sent."""


class GridTransport:
    """:class:`~numpyro_fed.flower.protocol.Transport` over a Flower ``Grid``."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def nodes(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def exchange(self, requests, phase, round_, timeout):
        messages, sent = [], {}
        for node, (cmd, arrays) in requests.items():
            content = RecordDict({"cmd": ConfigRecord(dict(cmd))})
            if arrays:
                content["arrays"] = ArrayRecord(
                    {k: Array(np.asarray(v)) for k, v in arrays.items()}
                )
            sent[node] = content_bytes(content)
            messages.append(
                Message(content, dst_node_id=int(node), message_type="query",
                        group_id=f"{phase}-{round_}")
            )
        replies: dict[int, Reply] = {}
        for rep in self.grid.send_and_receive(messages, timeout=timeout):
            node = rep.metadata.src_node_id
            if node not in requests:
                continue
            if rep.has_error():
                replies[node] = Reply(error=f"client error {rep.error.code}: {rep.error.reason}")
                continue
            try:
                meta = dict(rep.content["meta"])
                payload = rep.content["reply"]["payload"].numpy()
                replies[node] = Reply(meta, payload, content_bytes(rep.content))
            except Exception as err:  # noqa: BLE001 - any malformed content is rejected
                replies[node] = Reply(error=f"malformed reply ({type(err).__name__}: {err})")
        return replies, sent


class PollingGrid(Grid):
    """A ``Grid`` that delegates to ``grid`` but polls for replies every ``interval`` seconds.

    Flower's deployment ``Grid`` waits 3 s between two pulls in ``send_and_receive`` (flwr
    1.41), which is a 3 s floor per round; a sampler's rounds are milliseconds of work.

    :param grid: the ``Grid`` a ``ServerApp`` receives.
    :param interval: seconds between two pulls.
    """

    def __init__(self, grid: Grid, interval: float = 0.05) -> None:
        if not interval > 0:
            raise ValueError(f"`interval` must be > 0 seconds, got {interval!r}.")
        self.grid = grid
        self.interval = float(interval)

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        pending = set(self.grid.push_messages(list(messages)))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending or (end is not None and time.monotonic() >= end):
                break
            time.sleep(self.interval)
        return replies


