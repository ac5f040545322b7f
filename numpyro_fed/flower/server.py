"""The server of a deployment: :class:`ServerCoordinator`, generic over the
:class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` of the spec.

It discovers and checks the clients (``hello``), runs the algorithm's setup rounds, then each
round draws the keys (:func:`~numpyro_fed.algorithms.federated.step_keys`, the algorithm's
``round_keys``), calls the algorithm's ``server_broadcast``, sends the model (dense, or the
EF21-P updates with their catch-up: :mod:`numpyro_fed.flower.catchup`) and the refresh point
to the clients that missed a refresh, receives only compressed messages, and applies
``server_step`` to the ``(b, d)`` decoded messages (zero rows for absent clients). It keeps
the draws, the bits on the wire next to the declared bits, and the state.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed.algorithms import theta_star as search_alg
from numpyro_fed.algorithms.federated import (
    SEARCH_SALT,
    X0_SALT,
    FederatedAlgorithm,
    SetupResult,
    broadcast_apply,
    broadcast_message,
    setup_key,
    state_to_arrays,
    step_keys,
)
from numpyro_fed.algorithms.participation import (
    participation_mask,
)
from numpyro_fed.algorithms.theta_star import ThetaStarSearch
from numpyro_fed.flower.catchup import prune, shadow_request
from numpyro_fed.flower.checks import (
    PROBE_SETS,
    ClientMismatchError,
    DeploymentError,
    ParticipationMonitor,
    probe_difference,
    spec_differences,
    spec_settings,
)
from numpyro_fed.flower.client import probes
from numpyro_fed.flower.codecs import (
    WireCodec,
    WireFormatError,
    codec_for,
    dense_codec,
)
from numpyro_fed.flower.spec import (
    FlowerSpec,
    divergence_message,
    kernel_display_name,
    load_model,
    wire_name,
)
from numpyro_fed.flower.transport import Reply, Transport
from numpyro_fed.kernels.base import DivergenceError
from numpyro_fed.kernels.driver import centring_at, centring_warning, user_point
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential, prior_weights

__all__ = ["ServerCoordinator", "RoundLog"]

log = logging.getLogger("numpyro_fed.flower")


def _check_schemas(schemas: Mapping[int, Mapping], sizes: np.ndarray,
                   spec: FlowerSpec) -> dict:
    """Check that every client holds the same keys with the same row shape and dtype (the
    schemas announced at ``hello``), and enough rows for ``spec.batch_size``; return the
    common schema.

    :raises ValueError: naming the client and the key.
    """
    ref_i = min(schemas)
    ref = schemas[ref_i]
    for i in sorted(schemas):
        rows = schemas[i]
        if set(rows) != set(ref):
            extra, lost = sorted(set(rows) - set(ref)), sorted(set(ref) - set(rows))
            raise ValueError(
                f"client {i}'s data has keys {sorted(rows)} but client {ref_i}'s has "
                f"{sorted(ref)} (" + "; ".join(
                    t for t in (f"extra: {extra}" if extra else "",
                                f"missing: {lost}" if lost else "") if t)
                + "): every client must hold the same model keywords."
            )
        for key in sorted(rows):
            shape, dtype = rows[key]
            rshape, rdtype = ref[key]
            if list(shape) != list(rshape):
                raise ValueError(
                    f"client {i}'s data key {key!r} has rows of shape {tuple(shape)} but "
                    f"client {ref_i}'s has {tuple(rshape)}: every client's {key!r} must be an "
                    f"array of shape (num_rows, {', '.join(map(str, rshape))})"
                    .replace(", )", ")") + " (one row per observation)."
                )
            if np.dtype(dtype).kind != np.dtype(rdtype).kind:
                raise ValueError(
                    f"client {i}'s data key {key!r} has dtype {dtype} but client {ref_i}'s "
                    f"has {rdtype}: convert every client's {key!r} to the same dtype."
                )
        if int(sizes[i]) < 1:
            raise ValueError(f"client {i} holds no rows; every client needs at least one.")
        if spec.batch_size > int(sizes[i]):
            raise ValueError(
                f"`batch_size`={spec.batch_size} exceeds the size of client {i}, which holds "
                f"{int(sizes[i])} rows; use batch_size <= {int(sizes.min())} or 0 (exact "
                "local gradients)."
            )
    return dict(ref)


def _phase_label(alg: FederatedAlgorithm, phase: str) -> str:
    """A setup phase in messages: its round's label, or the search."""
    labels = {r.name: r.label for r in alg.setup}
    return labels.get(phase, f"{alg.name} theta* search" if phase == "grad" else phase)


_SETUP_KEYS = ("up_declared", "up_payload", "up_wire", "down_declared", "down_payload",
               "down_wire", "rounds")


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
    #: P-/B-ELF catch-ups: ``(round, client, "replay" | "dense", rounds missed)``.
    catchups: list[tuple[int, int, str, int]] = field(default_factory=list)


class ServerCoordinator:
    """The server of a deployment: the server step of QLSD (#, *, ++) or ELF (D, P, B) over a
    transport.

    After :meth:`run`: ``draws`` ``(num_samples, d)``, ``log`` (:class:`RoundLog`, per step),
    ``setup_bits`` (bits of the one-off rounds: ELF's initial gradients, QLSD*'s search and
    :math:`g^\\star` round; declared / payload / wire, up / down), ``init_bits``
    (``(up, down)`` declared bits of those rounds), ``theta_star`` / ``g_star`` /
    ``theta_star_search`` (QLSD*), ``shadow_models`` (P-/B-ELF: the server's :math:`w_k` of
    every round), ``applied`` (per client, the last round whose message was applied) and
    ``server_state`` (``eta``, ``g``, ``w``, ``g_local``: P-ELF's stale dense :math:`g_i`,
    ``known``: the last round each client is known to hold :math:`w` for).

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
        self.setup_bits = dict.fromkeys(_SETUP_KEYS, 0)
        self.init_bits = (0, 0)
        self.theta_star: jax.Array | None = None
        self.g_star: jax.Array | None = None
        self.theta_star_search: Any = None
        self.shadow_models: np.ndarray | None = None
        #: why each client asked in the last round is absent (``{client: reason}``)
        self.absent: dict[int, str] = {}

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
                raise DeploymentError(
                    f"only {len(nodes)} of num_clients={spec.num_clients} clients connected "
                    f"within {self.wait_nodes:.0f} s; start more SuperNodes or lower num_clients"
                )
            sleep(0.5)
        # the spec goes with the hello: each client answers with its fingerprint
        replies, _ = self.transport.exchange(
            {n: ({"phase": "hello", "spec": self._spec_json}, {}) for n in nodes}, "hello", -1,
            spec.round_timeout
        )
        b = spec.num_clients
        claims: dict[int, list[int]] = {}  # partition id -> the nodes announcing it
        problems: list[str] = []  # why nodes that answered cannot be used
        for node in nodes:
            rep = replies.get(node)
            if rep is None:
                problems.append(f"node {node} did not answer in {spec.round_timeout:g} s")
                continue
            if rep.error is not None:
                problems.append(f"node {node} failed: {rep.error}")
                log.warning("node %s did not answer hello: %s", node, rep.error)
                continue
            try:
                i = int(rep.meta.get("index", -1))
            except (TypeError, ValueError):
                i = -1
            if not 0 <= i < b:
                problems.append(f"node {node} announced partition id {rep.meta.get('index')!r}, "
                                f"outside 0..{b - 1}")
                log.warning("node %s announced partition id %r outside 0..%d", node,
                            rep.meta.get("index"), b - 1)
                continue
            claims.setdefault(i, []).append(node)
        dup = {i: ns for i, ns in sorted(claims.items()) if len(ns) > 1}
        if dup:
            what = "; ".join(f"duplicate partition id {i} (nodes "
                             f"{', '.join(map(str, ns[:-1]))} and {ns[-1]})"
                             for i, ns in dup.items())
            raise DeploymentError(
                f"Flower deployment: {what}: two SuperNodes run the same client, so "
                f"partition ids {sorted(set(range(b)) - set(claims))} have no client. Start "
                f"each SuperNode with its own --node-config \"partition-id=i ...\" (i in "
                f"0..{b - 1}).")
        for i in sorted(claims):  # data errors name the client by its partition id
            meta = replies[claims[i][0]].meta
            if "data_error" in meta:
                raise ValueError(f"Flower deployment: {meta['data_error']}.")
        missing = sorted(set(range(b)) - set(claims))
        if missing:
            raise DeploymentError(
                f"Flower deployment: clients {missing} did not answer the hello round"
                + (f" ({'; '.join(problems)})" if problems else "") + ".")
        index_of = {ns[0]: i for i, ns in claims.items()}
        schemas: dict[int, dict] = {}
        sizes = np.zeros(b, np.int64)
        for node, i in index_of.items():
            info = json.loads(replies[node].meta["schema"])
            schemas[i] = info["rows"]
            sizes[i] = int(info["size"])
        schema = _check_schemas(schemas, sizes, spec)
        self.node_of = {i: n for n, i in index_of.items()}
        self._configured = np.zeros(spec.num_clients, bool)
        self.sizes = sizes
        self.prior_weights = prior_weights(spec.prior, sizes)[0]
        proto = self.prototype
        if proto is None:
            proto = {k: np.zeros([1, *shape], dtype) for k, (shape, dtype) in schema.items()}
        part = ClientPartition.from_clients([dict(proto)])
        self.potential = FederatedPotential(
            load_model(spec.model), part,
            prior="server" if spec.prior == "server" else "split", check=False,
        )
        self._check_fingerprints({i: replies[n].meta for n, i in index_of.items()}, schema,
                                 self.node_of)

    def _check_fingerprints(self, metas: Mapping[int, Mapping[str, Any]],
                            schema: Mapping[str, Any], node_of: Mapping[int, int]) -> None:
        """Refuse the clients whose ``hello`` fingerprint differs from the server's
        (:mod:`numpyro_fed.flower.checks`): other settings parsed from the spec, or another
        potential on the synthetic probe of the common row schema (another model or version
        of the model's module, another likelihood weight, another prior).

        :raises ClientMismatchError: naming every refused client and what differs.
        """
        spec = self.spec
        mine = spec_settings(spec.to_config())
        # the server's own model, spec and (no) shared arguments, built as a client does;
        # compared on the probe sets where the server's model is finite
        refs = {kind: np.asarray(v, np.float64)
                for kind, v in probes(self.potential, spec.likelihood_weight, schema).items()
                if not isinstance(v, str) and np.isfinite(v).all()}
        if not refs:
            log.warning("the model cannot be evaluated on any synthetic probe %s: the hello "
                        "round compares the clients' settings only", PROBE_SETS)
        bad: dict[int, str] = {}
        for i in sorted(metas):
            meta = metas[i]
            if "settings_error" in meta:
                bad[i] = f"it cannot read the server's spec ({meta['settings_error']})"
                continue
            if "settings" not in meta:
                bad[i] = ("it sent no fingerprint of its model and settings (a client of an "
                          "older numpyro_fed?)")
                continue
            diff = spec_differences(mine, json.loads(meta["settings"]))
            if diff:
                bad[i] = "it runs with other settings than the spec: " + ", ".join(diff)
                continue
            if not refs:
                continue
            sent = json.loads(meta["probe"]) if "probe" in meta else {}
            for kind, ref in refs.items():
                got = sent.get(kind, sent.get("error"))
                if got is None:
                    bad[i] = "it sent no probe of its model (a client of an older numpyro_fed?)"
                elif isinstance(got, str):
                    bad[i] = (f"its model cannot be evaluated on the {kind!r} probe where the "
                              f"server's can ({got})")
                else:
                    bad[i] = probe_difference(ref, np.asarray(got, np.float64),
                                              spec.likelihood_weight)
                if bad[i]:
                    break
                del bad[i]
        if bad:
            lines = "; ".join(f"client {i} (node {node_of[i]}): {why}"
                              for i, why in bad.items())
            raise ClientMismatchError(
                f"Flower deployment of model {spec.model!r}: refused {lines}. Every client "
                "must run the server's model (the same version of its module and of "
                "numpyro_fed) with the spec's settings; its draws would be those of another "
                "target.", list(bad))

    def _cmd(self, phase: str, k: int, i: int, **extra: Any) -> dict[str, Any]:
        cmd = {"phase": phase, "round": k, **extra}
        if not self._configured[i]:  # the run's settings go with a client's first message
            cmd.update(spec=self._spec_json, prior_weight=float(self.prior_weights[i]),
                       max_size=int(self.sizes.max()))
        return cmd

    def _receive(self, replies: Mapping[int, Reply], asked: list[int], phase: str, k: int,
                 codec) -> dict[int, tuple[np.ndarray, int, int]]:
        """Validate replies; return ``{client: (decoded, declared bits, wire bytes)}``.
        Why each asked client is absent is kept in ``self.absent`` (``{client: reason}``)."""
        out = {}
        self.absent = {}
        for i in asked:
            rep = replies.get(self.node_of[i])
            if rep is None:
                log.warning("round %d: client %d did not answer in time", k, i)
                self.absent[i] = "did not answer in time"
                continue
            reason = rep.error
            if reason is None and int(rep.meta.get("nonfinite", 0)) and (
                rep.meta.get("phase") == phase and int(rep.meta.get("round", -1)) == k
            ):
                raise self._client_divergence(phase, k, i)
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
                self.absent[i] = reason
                self.log.rejected.append(f"round {k} client {i}: {reason}")
                continue
            out[i] = (dec, nbits, rep.wire_bytes)
            self._configured[i] = True
        return out

    def _client_divergence(self, phase: str, k: int, i: int) -> DivergenceError:
        """The error when client ``i`` found its message of round ``k`` not finite. Its
        iteration is the in-process kernel's: QLSD's message of round ``k`` moves
        :math:`x_{k+1}` (iteration ``k + 1``); ELF's gradient estimator of round ``k`` moves
        :math:`x_{k+2}`."""
        spec, alg = self.spec, self.spec.federated_algorithm()
        if phase == "step":
            it = k + 2 if alg.moves_first else k + 1
            err = DivergenceError(divergence_message(
                spec, it, f"(client {i}'s message of round {k} is not finite.)"))
            err.iteration = it
            return err
        return DivergenceError(
            f"numpyro_fed: {kernel_display_name(spec)}: client {i}'s gradient in the "
            f"{_phase_label(alg, phase)} is not finite at the point the server sent; "
            "check the model and the client's data for invalid values, or the initial point "
            "(`init`, `init_params`)."
        )

    def _check_finite(self, x: jax.Array, iteration: int) -> None:
        if not bool(jnp.all(jnp.isfinite(x))):
            err = DivergenceError(divergence_message(self.spec, iteration))
            err.iteration = iteration
            raise err

    # -- one-off rounds ---------------------------------------------------------------------
    def _dense_round(self, phase: str, round_: int, arrays: Mapping[str, np.ndarray],
                     declared: int, *, what: str, **cmd_extra: Any) -> np.ndarray:
        """A setup round in which *every* client returns a dense vector (ELF's initial
        gradients, QLSD*'s search and :math:`g^\\star` rounds); clients that do not answer are
        asked again, 3 attempts in all. Its bits go to :attr:`setup_bits`.

        :param arrays: the arrays sent to each client; ``declared`` their declared bits.
        :return: the ``(b, d)`` replies in client order.
        :raises DeploymentError: (a ``RuntimeError``) when a client has not answered after 3
            attempts.
        """
        b, spec, sb = self.spec.num_clients, self.spec, self.setup_bits
        dense = dense_codec(self.potential.dim)
        payload_bits = 8 * sum(int(a.size) for n, a in arrays.items() if n != "down_len")
        got: dict[int, np.ndarray] = {}
        for attempt in range(3):
            todo = [i for i in range(b) if i not in got]
            if not todo:
                break
            requests = {self.node_of[i]: (self._cmd(phase, round_, i, **cmd_extra), dict(arrays))
                        for i in todo}
            sb["down_declared"] += declared * len(todo)
            sb["down_payload"] += payload_bits * len(todo)
            replies, sent = self.transport.exchange(requests, phase, round_, spec.round_timeout)
            sb["down_wire"] += 8 * int(sum(sent.values()))
            for i, (dec, nbits, wire) in self._receive(replies, todo, phase, round_,
                                                       dense).items():
                got[i] = dec
                sb["up_declared"] += nbits
                sb["up_payload"] += 8 * int(replies[self.node_of[i]].payload.size)
                sb["up_wire"] += 8 * wire
            if attempt < 2 and len(got) < b:
                log.warning("%s: clients %s missing, retrying", what,
                            sorted(set(range(b)) - set(got)))
        if len(got) < b:
            raise DeploymentError(
                f"{what} needs every client's dense reply; clients "
                f"{sorted(set(range(b)) - set(got))} did not answer 3 attempts"
            )
        sb["rounds"] += 1
        return np.stack([got[i] for i in range(b)])

    def _setup_rounds(self, key: jax.Array, x: jax.Array, dense: WireCodec,
                      down: WireCodec | None) -> tuple[dict[str, SetupResult], jax.Array]:
        """The algorithm's setup rounds (:class:`~numpyro_fed.algorithms.federated.SetupRound`):
        a ``"search"`` round's point (given, or the federated search) or the clients' initial
        view (``"start"``: dense :math:`x_0`, or :math:`\\mathcal{Q}^P(x_0)` with the key
        :func:`~numpyro_fed.algorithms.federated.setup_key` as in process) to every client, and
        every client's dense gradient there back. Return the results and the initial view."""
        alg, pot = self.alg, self.potential
        setup: dict[str, SetupResult] = {}
        view = x
        for r in alg.setup:
            if r.point == "search":
                theta = self._search_point(key, dense)
                payload = dense.compress(None, theta)[0]
                grads = jnp.asarray(self._dense_round(r.name, -1, {"theta": payload},
                                                      32 * pot.dim, what=r.label))
                _, total, gnorm, scale = centring_at(pot, theta, grads=grads)
                msg = centring_warning(alg.name, gnorm, scale)
                if msg is not None:
                    log.warning("%s", msg)
                self.theta_star, self.g_star = theta, total
                self.theta_star_search = self.theta_star_search._replace(grad_norm=gnorm)
                setup[r.name] = SetupResult(theta, grads, total)
                continue
            cmd: dict[str, Any] = {}
            if alg.downlink is not None and alg.compressed_start:
                zeros = jnp.zeros_like(x)
                payload, bits, dec = down.compress(setup_key(key), broadcast_message(x, zeros))
                view = broadcast_apply(zeros, jnp.asarray(dec))
                arrays = {"down": payload, "down_len": np.asarray([payload.size], np.int32)}
                cmd["w_from"] = -1
                declared = int(bits)
            else:
                view = x
                arrays = {"w" if alg.downlink is not None else "theta": dense.compress(None, x)[0]}
                declared = 32 * pot.dim
            grads = jnp.asarray(self._dense_round(r.name, -1, arrays, declared, what=r.label,
                                                  **cmd))
            setup[r.name] = SetupResult(view, grads, jnp.sum(grads, 0))
        self.init_bits = (self.setup_bits["up_declared"], self.setup_bits["down_declared"])
        return setup, view

    def _search_point(self, key: jax.Array, dense: WireCodec) -> jax.Array:
        """A ``"search"`` round's point: the given constrained values (unconstrained by the
        server) or the federated search from ``init_params(key, fold_in=SEARCH_SALT)``."""
        plan, pot = self.alg.search, self.potential
        if plan.value is not None:
            theta = jnp.asarray(user_point(pot, plan.value), pot.dtype)
            self.theta_star_search = ThetaStarSearch("user", 0, 0, 0, float("nan"), True)
            return theta
        if self.spec.init == "zeros":
            x0 = jnp.zeros(pot.dim, pot.dtype)
        else:
            x0 = pot.init_params(key, fold_in=SEARCH_SALT)
        theta, self.theta_star_search = self._search_theta_star(jnp.asarray(x0, pot.dtype),
                                                                dense)
        return theta

    def _search_theta_star(self, x0: jax.Array, dense: WireCodec) -> tuple[jax.Array, Any]:
        """:func:`~numpyro_fed.kernels.qlsd.find_theta_star` (``"bb"`` or ``"adam"``), one
        round per gradient: the same iteration, stopping rule and bit count as in process,
        with :math:`\\sum_i \\nabla U_i` summed over the clients' dense replies."""
        spec, pot, plan = self.spec, self.potential, self.alg.search
        b, d = spec.num_clients, pot.dim
        total = jax.jit(lambda stack, x: jnp.sum(stack, 0) + pot.server_grad(x))
        rounds = 0

        def grad_u(x):
            nonlocal rounds
            stack = self._dense_round("grad", rounds, {"theta": dense.compress(None, x)[0]},
                                      32 * d, what=f"{self.alg.name} search")
            rounds += 1
            return total(jnp.asarray(stack), x)

        step = jax.jit(lambda st: search_alg.update(plan.method, st, plan.learning_rate))
        st = search_alg.init(x0, grad_u(x0))
        g_start = float(jnp.linalg.norm(st.g))
        tol = search_alg.tolerance(plan.gtol, jnp.linalg.norm(st.g))
        while bool(search_alg.keep_going(st, tol, plan.maxiter)):
            st = step(st)
            st = st._replace(g=grad_u(st.x))
        g_final = float(jnp.linalg.norm(st.g))
        info = ThetaStarSearch(
            method=plan.method, rounds=rounds, bits_up=rounds * b * 32 * d,
            bits_down=rounds * b * 32 * d, grad_norm=g_final,
            converged=search_alg.converged(g_final, g_start, plan.gtol),
        )
        return st.x, info

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> np.ndarray:
        """Run ``spec.num_samples`` steps; return the flat draws ``(num_samples, d)``."""
        spec = self.spec
        self._spec_json = json.dumps(spec.to_config())
        self._discover()
        alg = self.alg = spec.federated_algorithm()
        pot, b = self.potential, spec.num_clients
        d = pot.dim
        dense = dense_codec(d)
        codec = dense if alg.uplink is None else codec_for(wire_name(alg.uplink), d)
        shadow = alg.downlink is not None
        down = codec_for(wire_name(alg.downlink), d) if shadow else None
        key = random.key(spec.seed)
        if self.init_params is not None:
            ip = self.init_params
            x = pot.ravel(ip) if isinstance(ip, Mapping) else jnp.asarray(ip)
        elif spec.init == "zeros":
            x = jnp.zeros(d, pot.dtype)
        else:
            x = pot.init_params(key, fold_in=X0_SALT)
        x = jnp.asarray(x, jnp.float32)
        setup, w = self._setup_rounds(key, x, dense, down)
        server = alg.init_server(x, setup, pot)
        # the server half of the algorithm, compiled once per run
        broadcast = jax.jit(lambda k, x, st: alg.server_broadcast(k, x, st, pot, setup))
        server_step = jax.jit(lambda k, x, p, st, msgs, mask: alg.server_step(
            k, x, p, st, msgs, mask, pot, setup))
        rng_key = key
        applied = np.full(b, -1, np.int64)  # last round whose message was applied, per client
        refreshes = alg.refresh_every is not None
        refresh_point, refresh_round = x, -1
        client_refresh = np.full(b, -2, np.int64)
        known = np.full(b, -1, np.int64)  # EF21-P: last round each client holds w for
        hist: dict[int, tuple[np.ndarray, int]] = {}
        draws = np.zeros((spec.num_samples, d), np.float32)
        monitor = ParticipationMonitor(b, spec.participation, spec.num_samples,
                                       spec.max_empty_rounds, spec.min_participation)
        if shadow:
            self.shadow_models = np.zeros((spec.num_samples, d), np.float32)
        for k in range(spec.num_samples):
            rng_key, k_noise, k_alg = step_keys(rng_key)
            keys = alg.round_keys(k_alg)
            if alg.participation < 1.0:
                asked = np.asarray(participation_mask(keys.participation, alg.participation, b))
            else:
                asked = np.ones(b, bool)
            asked_ids = np.flatnonzero(asked).tolist()
            key_data = np.asarray(random.key_data(k_alg), np.uint32)
            requests, down_declared, down_payload = {}, 0, 0
            point = broadcast(k_noise, x, server)
            if alg.moves_first:
                self._check_finite(point, k + 1)
            if shadow:
                payload, bits, dec = down.compress(keys.downlink, broadcast_message(point, w))
                w = broadcast_apply(w, jnp.asarray(dec))
                view = w
                hist[k] = (payload, int(bits))
                cache: list[np.ndarray] = []

                def w_dense(w=w, cache=cache):
                    if not cache:
                        cache.append(dense.compress(None, w)[0])
                    return cache[0]
            else:
                view = point
                theta_payload = dense.compress(None, point)[0]
            if refreshes and k % alg.refresh_every == 0:
                refresh_point, refresh_round = view, k
            for i in asked_ids:
                if shadow:
                    extra, arrays, declared, pay = shadow_request(i, k, known, hist, d,
                                                                  w_dense, self.log.catchups)
                    arrays = {**arrays, "key": key_data}
                else:
                    extra = {}
                    arrays = {"theta": theta_payload, "key": key_data}
                    declared, pay = 32 * d, 8 * theta_payload.size
                refresh = refreshes and refresh_round == k
                if refreshes and not refresh and client_refresh[i] != refresh_round:
                    # a client that missed the last refresh gets its point (dense)
                    arrays["refresh_point"] = dense.compress(None, refresh_point)[0]
                    declared += 32 * d
                    pay += 8 * arrays["refresh_point"].size
                down_declared += declared
                down_payload += pay
                requests[self.node_of[i]] = (
                    self._cmd("step", k, i, ack=int(applied[i]), refresh=bool(refresh),
                              **extra),
                    arrays,
                )
            replies, sent = self.transport.exchange(requests, "step", k, spec.round_timeout)
            got = self._receive(replies, asked_ids, "step", k, codec)
            present = np.zeros(b, bool)
            present[list(got)] = True
            # stop instead of sampling without data (ParticipationError naming the rounds)
            monitor.update(k, asked, present, self.absent)
            # the decoded messages as the in-process kernels hold them: (b, d), zero rows
            # for absent clients; no mask when every client was asked and answered
            order = sorted(got)
            msgs = np.zeros((b, d), np.float32)
            for i in order:
                msgs[i] = got[i][0]
            full = alg.participation == 1.0 and bool(present.all())
            mask = None if full else jnp.asarray(present)
            x, server = server_step(k_noise, x, point, server, jnp.asarray(msgs), mask)
            if refreshes:
                client_refresh[present] = refresh_round
            applied[present] = k
            if shadow:
                known[present] = k
                prune(hist, known, 32 * d)
                self.shadow_models[k] = np.asarray(w)
            self._check_finite(x, k + 1)
            draws[k] = np.asarray(x)
            lg = self.log
            lg.asked.append(asked)
            lg.participants.append(present)
            lg.bits_up_declared.append(int(sum(got[i][1] for i in order)))
            lg.bits_up_payload.append(int(sum(8 * replies[self.node_of[i]].payload.size
                                              for i in order)))
            lg.bits_up_wire.append(int(sum(8 * got[i][2] for i in order)))
            lg.bits_down_declared.append(int(down_declared))
            lg.bits_down_payload.append(int(down_payload))
            lg.bits_down_wire.append(int(8 * sum(sent.values())))
        self.draws = draws
        self.applied = applied
        # the server state by field name, the view of an EF21-P broadcast and who holds it
        self.server_state = {
            **{k: np.asarray(v) for k, v in state_to_arrays(server, prefix="").items()},
            "w": np.asarray(w) if shadow else None, "known": known if shadow else None,
        }
        return draws

    def wire_summary(self) -> dict[str, float]:
        """Totals over the run: declared vs payload vs full-message bits, both ways, per step
        and (``setup_*``) of the one-off rounds."""
        lg = self.log
        return {k: float(np.sum(getattr(lg, k))) for k in (
            "bits_up_declared", "bits_up_payload", "bits_up_wire",
            "bits_down_declared", "bits_down_payload", "bits_down_wire")} | {
            "rounds": len(lg.asked), "rejected": len(lg.rejected),
            "mean_participants": float(np.mean([p.sum() for p in lg.participants]))
            if lg.participants else math.nan} | {
            f"setup_{k}": float(v) for k, v in self.setup_bits.items()}
