"""Transport-independent protocol of the federated kernels: client worker and server.

:class:`ClientWorker` is what a client runs: it holds only its own data and its own state
(QLSD memory term :math:`\\eta_i`, QLSD++ control point :math:`\\zeta` and
:math:`\\nabla U_i(\\zeta)`, D-ELF's error-feedback estimator :math:`g_i`) and answers the
server's instructions with compressed messages. :class:`ServerCoordinator` runs the kernel's
server step: it draws the Langevin noise, asks the clients, receives only compressed
messages, aggregates them and stores the draws. Both use the kernels' math and random keys
(:class:`~numpyro_fed.distributed.client.ClientProblem`,
:func:`~numpyro_fed.kernels.base.langevin_move`, the step key split
``(rng_key, k_noise, k_alg) = split(rng_key, 3)``, client ``i`` using
``split(k, b)[i]``), so for a fixed seed and no faults the deployment reproduces
``QLSD``/``DELF`` run in process up to float32 summation order.

**Consistency under faults.** A client's state update that depends on the server applying
its message (QLSD's :math:`\\eta_i \\mathrel{+}= \\alpha g_i`, D-ELF's
:math:`g_i \\mathrel{+}= c_i`) is kept *pending* and committed only when the server's next
instruction acknowledges that round (``ack``). A message that was lost, late or rejected is
never acknowledged, so client and server state never diverge
(:math:`\\eta = \\sum_i \\eta_i`, :math:`g = \\sum_i g_i`). Reweighting of the received
messages: :mod:`numpyro_fed.distributed.participation`.

Supported kernels: QLSD# and QLSD++ (any unbiased compressor with a wire format, memory,
minibatches, participation) and D-ELF (any contractive compressor with a wire format).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed.distributed.client import ClientProblem, client_key
from numpyro_fed.distributed.participation import check_participation, participation_mask
from numpyro_fed.flower.codecs import WireFormatError, compressor_from_name, dense_codec, wire_codec
from numpyro_fed.kernels.base import langevin_move
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential

__all__ = [
    "FlowerSpec",
    "ClientWorker",
    "ServerCoordinator",
    "Transport",
    "Reply",
    "RoundLog",
    "load_model",
]

log = logging.getLogger("numpyro_fed.flower")

_ALGORITHMS = ("qlsd", "delf")


def load_model(ref: str) -> Callable:
    """Import a model from ``"package.module:function"``."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"`model` must be an import reference 'package.module:function', got {ref!r}."
        )
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class FlowerSpec:
    """Everything the server and the clients must agree on (sent to clients at ``hello``).

    :param algorithm: ``"qlsd"`` or ``"delf"``.
    :param model: import reference of the NumPyro model, ``"package.module:function"``.
    :param num_clients: ``b``.
    :param step_size: :math:`\\gamma`.
    :param num_samples: number of steps (every draw is kept).
    :param variant: QLSD variant, ``"#"`` or ``"++"``.
    :param batch_size: per-client minibatch ``n`` (0: exact local gradients).
    :param compressor: compressor name (``"quantize(s=16)"``, ``"top_k(k=2)"``, ...).
    :param memory_rate: QLSD's :math:`\\alpha`.
    :param refresh_every: QLSD++'s ``l``.
    :param participation: probability that a client is asked in a round.
    :param prior: ``"split"``, ``"size"`` or ``"server"``.
    :param likelihood_weight: :math:`\\tau` (the same for every client).
    :param seed: the chain's key is ``random.key(seed)``.
    :param round_timeout: seconds the server waits for the replies of a round.
    :param init: ``"uniform"`` (NumPyro's ``init_to_uniform`` with the kernel's key) or
        ``"zeros"`` (unconstrained zeros).
    """

    algorithm: str
    model: str
    num_clients: int
    step_size: float
    num_samples: int
    variant: str = "#"
    batch_size: int = 0
    compressor: str = "identity"
    memory_rate: float = 0.0
    refresh_every: int = 100
    participation: float = 1.0
    prior: str = "split"
    likelihood_weight: float = 1.0
    seed: int = 0
    round_timeout: float = 60.0
    init: str = "uniform"

    def __post_init__(self) -> None:
        if self.algorithm not in _ALGORITHMS:
            raise ValueError(
                f"`algorithm` must be one of {_ALGORITHMS} (QLSD#/QLSD++ or D-ELF in the Flower "
                f"deployment), got {self.algorithm!r}."
            )
        if self.algorithm == "qlsd" and self.variant not in ("#", "++"):
            raise ValueError(
                f"QLSD `variant` must be '#' or '++' in the Flower deployment, got "
                f"{self.variant!r} (QLSD*'s theta* search is not distributed)."
            )
        if self.num_clients < 1 or self.num_samples < 1:
            raise ValueError("`num_clients` and `num_samples` must be >= 1.")
        if self.prior not in ("split", "size", "server"):
            raise ValueError(f"`prior` must be 'split', 'size' or 'server', got {self.prior!r}.")
        if self.init not in ("uniform", "zeros"):
            raise ValueError(f"`init` must be 'uniform' or 'zeros', got {self.init!r}.")
        self.participation = check_participation(self.participation)
        comp = compressor_from_name(self.compressor)
        if self.algorithm == "qlsd" and not comp.unbiased:
            raise ValueError(f"QLSD needs an unbiased compressor, got {self.compressor}.")
        if self.algorithm == "delf" and comp.alpha is None:
            raise ValueError(f"D-ELF needs a contractive compressor, got {self.compressor}.")

    # -- (de)serialisation as flat scalars (Flower ConfigRecord / run_config) -------------
    def to_config(self) -> dict[str, Any]:
        """Flat dict of scalars (for a Flower ``ConfigRecord`` or ``run_config``)."""
        return asdict(self)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FlowerSpec:
        """Build from a flat mapping (unknown keys are ignored, types are coerced)."""
        kwargs = {}
        for f in fields(cls):
            key = f.name if f.name in config else f.name.replace("_", "-")
            if key in config:
                typ = {"int": int, "float": float, "str": str}[str(f.type)]
                kwargs[f.name] = typ(config[key])
        return cls(**kwargs)

    @classmethod
    def from_kernel(cls, kernel: Any, model: str, *, num_samples: int, seed: int,
                    **kwargs: Any) -> FlowerSpec:
        """The spec that reproduces an in-process ``QLSD`` (``#``/``++``) or ``DELF`` kernel.

        :param kernel: the in-process kernel.
        :param model: import reference of the kernel's model.
        """
        from numpyro_fed.kernels.elf import ELF
        from numpyro_fed.kernels.qlsd import QLSD

        pot = kernel.potential
        if not np.allclose(pot.likelihood_weight, pot.likelihood_weight[0]):
            raise ValueError("The Flower deployment needs one likelihood weight for all clients.")
        common = dict(
            model=model, num_clients=kernel.partition.num_clients,
            step_size=kernel.step_size, num_samples=num_samples,
            batch_size=kernel.batch_size or 0, prior=pot.prior_mode,
            likelihood_weight=float(pot.likelihood_weight[0]), seed=seed,
            participation=getattr(kernel, "participation", 1.0),
        )
        common.update(kwargs)
        if isinstance(kernel, QLSD):
            return cls(algorithm="qlsd", variant=kernel.variant, compressor=kernel.compressor.name,
                       memory_rate=kernel.memory_rate, refresh_every=kernel.refresh_every,
                       **common)
        if isinstance(kernel, ELF) and kernel.variant == "D":
            return cls(algorithm="delf", compressor=kernel.uplink.name, **common)
        raise ValueError(
            f"No Flower deployment for {type(kernel).__name__}: supported are QLSD (variants "
            "'#' and '++') and D-ELF."
        )


# ============================================================================ client
_STATE_FIELDS = ("eta", "zeta", "grad_zeta", "g", "pending")


class ClientWorker:
    """A client: its data, its :class:`~numpyro_fed.distributed.client.ClientProblem`, and the
    handling of the server's instructions.

    The client's mutable state is a flat dict of numpy arrays and ints passed in and returned
    by :meth:`handle` (a Flower ``ClientApp`` keeps it in ``context.state``).

    :param index: the client's index ``i`` in ``0..b-1`` (its position in the in-process
        partition: it selects the client's random keys).
    :param rows: the client's data (arrays with a leading row axis).
    :param shared: non-row model keyword arguments.
    """

    def __init__(self, index: int, rows: Mapping[str, Any],
                 shared: Mapping[str, Any] | None = None) -> None:
        self.index = int(index)
        self.rows = {k: np.asarray(v) for k, v in rows.items()}
        self.shared = dict(shared or {})
        self._problem: ClientProblem | None = None
        self._problem_key: tuple | None = None
        self._codec = None

    def schema(self) -> dict[str, Any]:
        """Shapes and dtypes of one row (no values) and the number of rows."""
        n = len(next(iter(self.rows.values())))
        return {
            "rows": {k: [list(v.shape[1:]), str(v.dtype)] for k, v in self.rows.items()},
            "size": n,
        }

    def _setup(self, spec: FlowerSpec, prior_weight: float, max_size: int) -> ClientProblem:
        key = (json.dumps(spec.to_config(), sort_keys=True), prior_weight, max_size)
        if self._problem is None or self._problem_key != key:
            self._problem = ClientProblem(
                load_model(spec.model), self.rows, prior_weight=prior_weight,
                likelihood_weight=spec.likelihood_weight, shared=self.shared, max_size=max_size,
            )
            self._codec = wire_codec(compressor_from_name(spec.compressor), self._problem.dim)
            self._problem_key = key
        return self._problem

    def handle(self, cmd: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
               state: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray, dict[str, Any]]:
        """Answer one instruction.

        :param cmd: scalars of the instruction (``phase``, ``round``, ``ack``, ...).
        :param arrays: arrays of the instruction (``theta`` dense payload, ``key``, ...).
        :param state: this client's persistent state (modified copy returned).
        :return: ``(meta, payload, state)``: reply scalars, the uint8 payload, new state.
        """
        phase = cmd["phase"]
        if phase == "hello":
            return {"phase": "hello", "index": self.index,
                    "schema": json.dumps(self.schema())}, np.zeros(0, np.uint8), state
        if "spec" in cmd:  # first contact: the run's settings, kept in the client's state
            state = {**state, "spec": cmd["spec"], "prior_weight": float(cmd["prior_weight"]),
                     "max_size": int(cmd["max_size"])}
        if "spec" not in state:
            raise ValueError("instruction without the run's settings: the client lost its state")
        spec = FlowerSpec.from_config(json.loads(state["spec"]))
        prob = self._setup(spec, float(state["prior_weight"]), int(state["max_size"]))
        d = prob.dim
        dense = dense_codec(d)
        state = dict(state)
        theta = jnp.asarray(dense.decode(arrays["theta"])[0])
        k = int(cmd["round"])
        if phase == "init":  # D-ELF: dense g_i = grad U_i(w_0), applied at once (retried if lost)
            g = np.asarray(prob.full_grad(theta), np.float32)
            payload, bits, g_dec = dense.compress(None, g)
            state.update(g=g_dec, pending=np.zeros(0, np.float32), pending_round=-10)
            return {"phase": "init", "round": k, "bits": bits}, payload, state
        if phase != "step":
            raise ValueError(f"unknown phase {phase!r}")
        b = spec.num_clients
        # commit the previous message if the server applied it
        pending = state.get("pending")
        if pending is not None and pending.size and int(state.get("pending_round", -10)) == int(
            cmd["ack"]
        ):
            if spec.algorithm == "qlsd" and spec.memory_rate > 0:
                state["eta"] = (state["eta"] + np.float32(spec.memory_rate) * pending).astype(
                    np.float32
                )
            elif spec.algorithm == "delf":
                state["g"] = (state["g"] + pending).astype(np.float32)
        state["pending"] = np.zeros(0, np.float32)
        state["pending_round"] = -10
        k_alg = random.wrap_key_data(jnp.asarray(arrays["key"], jnp.uint32))
        n = spec.batch_size or None
        if spec.algorithm == "qlsd":
            k_batch, k_comp = random.split(k_alg)
            kb = client_key(k_batch, self.index, b)
            if spec.variant == "++" and n is not None:
                if bool(cmd["refresh"]):
                    state["zeta"] = np.asarray(theta, np.float32)
                    state["grad_zeta"] = np.asarray(prob.full_grad(theta), np.float32)
                    state["zeta_round"] = k
                elif "zeta" in arrays:
                    zeta = jnp.asarray(dense.decode(arrays["zeta"])[0])
                    state["zeta"] = np.asarray(zeta, np.float32)
                    state["grad_zeta"] = np.asarray(prob.full_grad(zeta), np.float32)
                    state["zeta_round"] = int(cmd["zeta_round"])
                h = prob.batch_grad_diff(kb, theta, jnp.asarray(state["zeta"]), n) + jnp.asarray(
                    state["grad_zeta"]
                )
            else:
                h = prob.oracle(kb, theta, n)
            if spec.memory_rate > 0:
                eta = state.get("eta")
                if eta is None or eta.size == 0:
                    eta = state["eta"] = np.zeros(d, np.float32)
                h = h - jnp.asarray(eta)
            kc = client_key(k_comp, self.index, b)
        else:
            k_batch, _, k_up = random.split(k_alg, 3)
            h = prob.oracle(client_key(k_batch, self.index, b), theta, n) - jnp.asarray(state["g"])
            kc = client_key(k_up, self.index, b)
        payload, bits, dec = self._codec.compress(kc, h)
        state["pending"] = dec
        state["pending_round"] = k
        return {"phase": "step", "round": k, "bits": int(bits)}, payload, state


# ============================================================================ server
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


@dataclass
class RoundLog:
    """Per-round record of a deployment (one entry per step)."""

    asked: list[np.ndarray] = field(default_factory=list)
    participants: list[np.ndarray] = field(default_factory=list)
    bits_up_declared: list[int] = field(default_factory=list)
    bits_up_payload: list[int] = field(default_factory=list)
    bits_up_wire: list[int] = field(default_factory=list)
    bits_down_declared: list[int] = field(default_factory=list)
    bits_down_payload: list[int] = field(default_factory=list)
    bits_down_wire: list[int] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


class ServerCoordinator:
    """The server of a deployment: QLSD#/QLSD++ or D-ELF's server step over a transport.

    :param spec: the :class:`FlowerSpec`.
    :param transport: a :class:`Transport`.
    :param init_params: optional initial point (flat unconstrained array, or dict of
        unconstrained site values); default from ``spec.init``.
    :param prototype: optional one-row example of the data (values never used for
        inference, only to know the parameter structure); default: zeros of the clients'
        declared row schema.
    :param wait_nodes: seconds to wait for ``num_clients`` clients to connect.
    """

    def __init__(self, spec: FlowerSpec, transport: Transport, *, init_params: Any = None,
                 prototype: Mapping[str, Any] | None = None, wait_nodes: float = 120.0,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.spec = spec
        self.transport = transport
        self.init_params = init_params
        self.prototype = prototype
        self.wait_nodes = wait_nodes
        self._sleep = sleep
        self.log = RoundLog()

    # -- helpers ------------------------------------------------------------------------
    def _discover(self) -> None:
        import time

        spec, t0 = self.spec, time.monotonic()
        sleep = self._sleep or time.sleep
        while True:
            nodes = list(self.transport.nodes())
            if len(nodes) >= spec.num_clients:
                break
            if time.monotonic() - t0 > self.wait_nodes:
                raise RuntimeError(
                    f"only {len(nodes)} of num_clients={spec.num_clients} clients connected "
                    f"within {self.wait_nodes:.0f} s; start more SuperNodes or lower num_clients"
                )
            sleep(0.5)
        replies, _ = self.transport.exchange(
            {n: ({"phase": "hello"}, {}) for n in nodes}, "hello", -1, spec.round_timeout
        )
        index_of: dict[int, int] = {}
        schema = None
        sizes = np.zeros(spec.num_clients, np.int64)
        for node, rep in replies.items():
            if rep.error is not None:
                log.warning("node %s did not answer hello: %s", node, rep.error)
                continue
            i = int(rep.meta.get("index", -1))
            if not 0 <= i < spec.num_clients or i in index_of.values():
                log.warning("node %s announced an invalid or duplicate client index %s", node, i)
                continue
            index_of[node] = i
            info = json.loads(rep.meta["schema"])
            schema = schema or info["rows"]
            sizes[i] = int(info["size"])
        missing = sorted(set(range(spec.num_clients)) - set(index_of.values()))
        if missing:
            raise RuntimeError(f"clients {missing} did not answer the hello round")
        self.node_of = {i: n for n, i in index_of.items()}
        self._configured = np.zeros(spec.num_clients, bool)
        self.sizes = sizes
        if spec.prior == "split":
            self.prior_weights = np.full(spec.num_clients, 1.0 / spec.num_clients)
        elif spec.prior == "size":
            self.prior_weights = sizes / sizes.sum()
        else:
            self.prior_weights = np.zeros(spec.num_clients)
        proto = self.prototype
        if proto is None:
            proto = {k: np.zeros([1, *shape], dtype) for k, (shape, dtype) in schema.items()}
        part = ClientPartition.from_clients([dict(proto)])
        self.potential = FederatedPotential(
            load_model(spec.model), part,
            prior="server" if spec.prior == "server" else "split", check=False,
        )

    def _cmd(self, phase: str, k: int, i: int, **extra: Any) -> dict[str, Any]:
        cmd = {"phase": phase, "round": k, **extra}
        if not self._configured[i]:  # the run's settings go with a client's first message
            cmd.update(spec=self._spec_json, prior_weight=float(self.prior_weights[i]),
                       max_size=int(self.sizes.max()))
        return cmd

    def _receive(self, replies: Mapping[int, Reply], asked: list[int], phase: str, k: int,
                 codec) -> dict[int, tuple[np.ndarray, int, int]]:
        """Validate replies; return ``{client: (decoded, declared bits, wire bytes)}``."""
        out = {}
        for i in asked:
            rep = replies.get(self.node_of[i])
            if rep is None:
                log.warning("round %d: client %d did not answer in time", k, i)
                continue
            reason = rep.error
            if reason is None:
                try:
                    if rep.meta.get("phase") != phase or int(rep.meta.get("round", -1)) != k:
                        raise WireFormatError(
                            f"reply for phase {rep.meta.get('phase')!r} round "
                            f"{rep.meta.get('round')!r}, expected {phase!r} round {k}"
                        )
                    dec, nbits = codec.decode(rep.payload)
                    if nbits != int(rep.meta.get("bits", -1)):
                        raise WireFormatError(
                            f"declared {rep.meta.get('bits')} bits but the payload codes {nbits}"
                        )
                except (WireFormatError, TypeError, ValueError, KeyError) as err:
                    reason = f"rejected: {err}"
            if reason is not None:
                log.warning("round %d: message of client %d %s", k, i, reason)
                self.log.rejected.append(f"round {k} client {i}: {reason}")
                continue
            out[i] = (dec, nbits, rep.wire_bytes)
            self._configured[i] = True
        return out

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> np.ndarray:
        """Run ``spec.num_samples`` steps; return the flat draws ``(num_samples, d)``."""
        spec = self.spec
        self._discover()
        self._spec_json = json.dumps(spec.to_config())
        pot, b = self.potential, spec.num_clients
        d = pot.dim
        dense = dense_codec(d)
        codec = wire_codec(compressor_from_name(spec.compressor), d)
        key = random.key(spec.seed)
        if self.init_params is not None:
            ip = self.init_params
            x = pot.ravel(ip) if isinstance(ip, Mapping) else jnp.asarray(ip)
        elif spec.init == "zeros":
            x = jnp.zeros(d, pot.dtype)
        else:
            x = pot.init_params(random.fold_in(key, 1))
        x = jnp.asarray(x, jnp.float32)
        gamma = spec.step_size
        move = jax.jit(lambda k, x, g: langevin_move(k, x, g, gamma))
        server_grad = jax.jit(pot.server_grad)
        rng_key = key
        applied = np.full(b, -1, np.int64)  # last round whose message was applied, per client
        alpha = spec.memory_rate
        uses_zeta = spec.algorithm == "qlsd" and spec.variant == "++" and spec.batch_size > 0
        zeta, zeta_round = x, -1
        client_zeta = np.full(b, -2, np.int64)
        eta = jnp.zeros(d, jnp.float32)
        g = None
        if spec.algorithm == "delf":
            g = self._init_delf(x, dense)
        draws = np.zeros((spec.num_samples, d), np.float32)
        for k in range(spec.num_samples):
            rng_key, k_noise, k_alg = random.split(rng_key, 3)
            if spec.participation < 1.0:
                asked = np.asarray(participation_mask(k_alg, spec.participation, b))
            else:
                asked = np.ones(b, bool)
            key_data = np.asarray(random.key_data(k_alg), np.uint32)
            if spec.algorithm == "delf":
                x_send = move(k_noise, x, server_grad(x) + g)
            else:
                x_send = x
                if uses_zeta and k % spec.refresh_every == 0:
                    zeta, zeta_round = x, k
            theta_payload = dense.compress(None, x_send)[0]
            requests, down_declared, down_payload = {}, 0, 0
            for i in np.flatnonzero(asked).tolist():
                arrays = {"theta": theta_payload, "key": key_data}
                refresh = uses_zeta and zeta_round == k
                down_declared += 32 * d
                down_payload += 8 * theta_payload.size
                if uses_zeta and not refresh and client_zeta[i] != zeta_round:
                    arrays["zeta"] = dense.compress(None, zeta)[0]
                    down_declared += 32 * d
                    down_payload += 8 * arrays["zeta"].size
                requests[self.node_of[i]] = (
                    self._cmd("step", k, i, ack=int(applied[i]), refresh=bool(refresh),
                              zeta_round=int(zeta_round)),
                    arrays,
                )
            replies, sent = self.transport.exchange(requests, "step", k, spec.round_timeout)
            got = self._receive(replies, np.flatnonzero(asked).tolist(), "step", k, codec)
            present = np.zeros(b, bool)
            present[list(got)] = True
            order = sorted(got)
            msgs = jnp.asarray(np.stack([got[i][0] for i in order])) if order else None
            if spec.algorithm == "qlsd":
                if msgs is None:
                    total = jnp.zeros(d, jnp.float32)
                elif len(order) == b:
                    total = jnp.sum(msgs, 0)
                else:
                    total = jnp.sum(jnp.float32(b / len(order)) * msgs, 0)
                if alpha > 0:
                    gk = total + eta if len(order) != b else eta + total
                    if msgs is not None:
                        eta = eta + alpha * jnp.sum(msgs, 0)
                else:
                    gk = total
                x = move(k_noise, x, gk + 0.0 + server_grad(x))
            else:
                if msgs is not None:
                    g = g + jnp.sum(msgs, 0)
                x = x_send
            if uses_zeta:
                client_zeta[present] = zeta_round
            applied[present] = k
            if not bool(jnp.all(jnp.isfinite(x))):
                raise FloatingPointError(
                    f"the chain became non-finite at round {k}; reduce step_size"
                )
            draws[k] = np.asarray(x)
            lg = self.log
            lg.asked.append(asked)
            lg.participants.append(present)
            lg.bits_up_declared.append(int(sum(got[i][1] for i in order)))
            lg.bits_up_payload.append(int(sum(8 * replies[self.node_of[i]].payload.size
                                              for i in order)))
            lg.bits_up_wire.append(int(sum(8 * got[i][2] for i in order)))
            lg.bits_down_declared.append(down_declared)
            lg.bits_down_payload.append(down_payload)
            lg.bits_down_wire.append(int(8 * sum(sent.values())))
        self.draws = draws
        self.applied = applied
        self.server_state = {"eta": np.asarray(eta), "g": None if g is None else np.asarray(g)}
        return draws

    def _init_delf(self, x: jax.Array, dense) -> jax.Array:
        """D-ELF's initial round: :math:`w_0 = x_0` to every client, dense
        :math:`g_i = \\nabla U_i(x_0)` back; retried (3 times) for clients that do not answer."""
        b, spec = self.spec.num_clients, self.spec
        payload = dense.compress(None, x)[0]
        grads: dict[int, np.ndarray] = {}
        for attempt in range(3):
            todo = [i for i in range(b) if i not in grads]
            if not todo:
                break
            requests = {self.node_of[i]: (self._cmd("init", -1, i), {"theta": payload})
                        for i in todo}
            replies, _ = self.transport.exchange(requests, "init", -1, spec.round_timeout)
            for i, (dec, _, _) in self._receive(replies, todo, "init", -1, dense).items():
                grads[i] = dec
            if attempt < 2 and len(grads) < b:
                log.warning("D-ELF init: clients %s missing, retrying",
                            sorted(set(range(b)) - set(grads)))
        if len(grads) < b:
            raise RuntimeError(
                f"D-ELF needs every client's initial gradient; clients "
                f"{sorted(set(range(b)) - set(grads))} did not answer 3 initial rounds"
            )
        self.init_bits = (32 * self.potential.dim * b, 32 * self.potential.dim * b)
        return jnp.sum(jnp.asarray(np.stack([grads[i] for i in range(b)])), 0)

    def wire_summary(self) -> dict[str, float]:
        """Totals over the run: declared vs payload vs full-message bits, both ways."""
        lg = self.log
        return {k: float(np.sum(getattr(lg, k))) for k in (
            "bits_up_declared", "bits_up_payload", "bits_up_wire",
            "bits_down_declared", "bits_down_payload", "bits_down_wire")} | {
            "rounds": len(lg.asked), "rejected": len(lg.rejected),
            "mean_participants": float(np.mean([p.sum() for p in lg.participants]))
            if lg.participants else math.nan}
