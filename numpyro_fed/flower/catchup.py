"""The EF21-P broadcast of a deployment and its catch-up (Karagulyan & Richtárik 2023,
Alg. 2-3), for any :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` with a
``downlink`` compressor.

The server owns the view :math:`w_k = w_{k-1} + \\mathcal{Q}^P(x_{k+1} - w_{k-1})` and sends
the *serialised compressed update* of round ``k``; every client keeps its own copy of
:math:`w` and the round ``w_round`` it corresponds to. A client that missed rounds (not
sampled, message dropped, reply lost) is brought up to date the next time it is asked, with
the cheaper of two exact options, chosen per client and counted in its downlink bits:

* *replay*: the compressed updates of the missed rounds ``a+1..k`` (``a`` = the last round the
  server knows the client holds), which the client adds in order with the same float32
  additions as the server (:func:`~numpyro_fed.algorithms.federated.broadcast_apply`) --
  bitwise the server's :math:`w_k`; a client that already holds a later round than ``a`` (its
  reply was lost) skips the updates it has;
* *dense*: :math:`w_k` itself (``32 d`` bits), when the replay would cost at least as much.

So a rejoining client never pays more than one dense model, the server keeps only the updates
whose replay is still cheaper than a dense model (a bounded history, :func:`prune`), and no
approximation is made: client and server :math:`w` are equal bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.algorithms.federated import broadcast_apply
from numpyro_fed.flower.codecs import WireCodec, WireFormatError

__all__ = ["shadow_request", "prune", "apply_updates"]


def shadow_request(i: int, k: int, known: np.ndarray, hist: dict[int, tuple], d: int,
                   w_dense: Callable[[], np.ndarray],
                   catchups: list | None = None) -> tuple[dict, dict, int, int]:
    """The model update for client ``i`` in round ``k``: the compressed updates of the rounds
    it misses (``known[i]+1..k``, from ``hist``: ``{round: (payload, bits)}``) or, when that is
    incomplete or costs at least a dense model, :math:`w_k` dense (``w_dense()``). A catch-up
    is recorded in ``catchups`` as ``(round, client, "replay" | "dense", rounds missed)``.

    :return: ``(cmd extras, arrays, declared bits, payload bits)``.
    """
    rounds = range(int(known[i]) + 1, k + 1)
    complete = all(r in hist for r in rounds)
    chain_bits = sum(hist[r][1] for r in rounds) if complete else math.inf
    if len(rounds) > 1:
        kind = "dense" if chain_bits >= 32 * d else "replay"
        if catchups is not None:
            catchups.append((k, i, kind, len(rounds) - 1))
        if kind == "dense":
            payload = w_dense()
            return {}, {"w": payload}, 32 * d, 8 * int(payload.size)
    chunks = [hist[r][0] for r in rounds]
    arrays = {"down": np.concatenate(chunks).astype(np.uint8),
              "down_len": np.asarray([c.size for c in chunks], np.int32)}
    return {"w_from": rounds.start}, arrays, int(chain_bits), 8 * int(arrays["down"].size)


def prune(hist: dict[int, tuple], known: np.ndarray, dense_bits: int) -> None:
    """Keep only the updates some client may still get replayed: rounds after the oldest
    round a client is known to hold, and not those whose replay would cost at least a dense
    model anyway."""
    for r in [r for r in hist if r <= int(known.min())]:
        del hist[r]
    total = sum(bits for _, bits in hist.values())
    for r in sorted(hist):
        if total - hist[r][1] < dense_bits:
            break
        total -= hist.pop(r)[1]


def apply_updates(cmd: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                  state: dict[str, Any], k: int, dense: WireCodec,
                  down: WireCodec) -> jax.Array:
    """Client side: bring the view :math:`w` in ``state`` (``w``, ``w_round``) to round
    ``k``: a dense :math:`w_k` (``w``) or the compressed updates of rounds ``w_from..k``
    (``down``, byte lengths ``down_len``), of which the rounds this client already holds are
    skipped.

    :raises WireFormatError: for updates that do not match their lengths or round.
    :raises ValueError: for updates that start after the round this client holds.
    """
    if "w" in arrays:
        w = jnp.asarray(dense.decode(arrays["w"])[0])
    else:
        if "down" not in arrays or "down_len" not in arrays or "w_from" not in cmd:
            raise ValueError("instruction without the model update of its EF21-P broadcast")
        lens = np.asarray(arrays["down_len"]).astype(np.int64).ravel()
        chunks = np.asarray(arrays["down"], np.uint8)
        start = int(cmd["w_from"])
        have = int(state.get("w_round", -10)) if "w" in state else -10
        if lens.size < 1 or np.any(lens < 0) or int(lens.sum()) != chunks.size:
            raise WireFormatError("model updates: lengths do not match the payload")
        if start + lens.size - 1 != k:
            raise WireFormatError(f"model updates of rounds {start}.. do not end at {k}")
        if start > have + 1:
            raise ValueError(
                f"model updates start at round {start} but this client holds round {have}: "
                "it cannot catch up (the server must send the dense model)"
            )
        w = jnp.asarray(state["w"]) if "w" in state else jnp.zeros(down.dim, jnp.float32)
        offsets = np.concatenate([[0], np.cumsum(lens)])
        for j in range(lens.size):
            if start + j <= have:
                continue  # already applied (the server did not see our last reply)
            v, _ = down.decode(chunks[offsets[j]:offsets[j + 1]])
            w = broadcast_apply(w, jnp.asarray(v))  # the server's addition
    state["w"] = np.asarray(w, np.float32)
    state["w_round"] = int(k)
    return jnp.asarray(state["w"])
