"""What a client runs: :class:`ClientWorker`, generic over the
:class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` of the spec.

It holds only its own data and its state: the algorithm's client state (by field name), the
results of the setup rounds, the model view of an EF21-P broadcast and its round, and the last
message, kept *pending* until the server's next instruction acknowledges it (then
``commit``). It answers the server's instructions with compressed messages in the wire format
of :mod:`numpyro_fed.flower.codecs`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

from numpyro_fed.algorithms.federated import (
    FederatedAlgorithm,
    SetupResult,
    state_from_arrays,
    state_to_arrays,
)
from numpyro_fed.algorithms.oracles import ClientProblem, client_key
from numpyro_fed.flower.catchup import apply_updates
from numpyro_fed.flower.checks import (
    PROBE_SETS,
    nonfinite_rows_message,
    probe_rows,
    probe_values,
    spec_settings,
)
from numpyro_fed.flower.codecs import (
    WireCodec,
    codec_for,
    dense_codec,
)
from numpyro_fed.flower.spec import FlowerSpec, load_model, wire_name
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential

__all__ = ["ClientWorker", "probes", "nonfinite_reply"]


class ClientWorker:
    """A client: its data, its :class:`~numpyro_fed.algorithms.oracles.ClientProblem`, and the
    handling of the server's instructions.

    The client's mutable state is a flat dict of numpy arrays and ints passed in and returned
    by :meth:`handle` (a Flower ``ClientApp`` keeps it in ``context.state``): ``eta`` (QLSD
    memory), ``zeta``/``grad_zeta`` (QLSD++), ``theta_star``/``grad_star`` (QLSD*), ``g`` (D-/B-ELF
    error feedback), ``w``/``w_round`` (P-/B-ELF shadow model and its round), ``pending`` /
    ``pending_round`` (the last message, committed when acknowledged).

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
        self._potential: FederatedPotential | None = None
        self._codec: WireCodec | None = None
        self._down: WireCodec | None = None
        self._alg: FederatedAlgorithm | None = None
        self._template: Any = None

    def schema_error(self) -> str | None:
        """Why this client's rows cannot be used (no keys, a scalar, keys with different
        numbers of rows, a NaN or infinite value in a floating-point row: named by this
        client's partition id and its own row), or ``None``."""
        if not self.rows:
            return f"client {self.index} holds no data arrays"
        counts = {}
        for k, v in self.rows.items():
            if v.ndim == 0:
                return (f"client {self.index}'s data key {k!r} is a scalar; row data must "
                        "have a leading row axis (put non-row values in `shared`)")
            counts[k] = v.shape[0]
        if len(set(counts.values())) > 1:
            return (f"client {self.index}'s data keys have different numbers of rows "
                    f"{counts}; every key must have one row per observation")
        # checked here, where the partition id is known: the ClientPartition of one client
        # that ClientProblem builds would call any client "client 0"
        return nonfinite_rows_message(self.index, self.rows)

    def schema(self) -> dict[str, Any]:
        """Shapes and dtypes of one row (no values) and the number of rows."""
        n = len(next(iter(self.rows.values())))
        return {
            "rows": {k: [list(v.shape[1:]), str(v.dtype)] for k, v in self.rows.items()},
            "size": n,
        }

    def load_model(self, spec: FlowerSpec) -> Callable:
        """The model this client runs: ``spec.model`` imported on this machine (another
        version of its module gives another model: the ``hello`` fingerprint tells)."""
        return load_model(spec.model)

    def make_problem(self, spec: FlowerSpec, prior_weight: float,
                     max_size: int | None) -> ClientProblem:
        """The :class:`~numpyro_fed.algorithms.oracles.ClientProblem` of this client under
        ``spec``: the one construction of its potential, used for the steps and for the
        ``hello`` probe (:meth:`fingerprint`), so the probe checks what the steps compute.
        The model's :class:`~numpyro_fed.potential.FederatedPotential` on this client's rows
        is built once (its construction traces the model) and reused."""
        model = self.load_model(spec)
        if self._potential is None or self._potential.model is not model:
            part = ClientPartition.from_clients([dict(self.rows)], shared=self.shared)
            self._potential = FederatedPotential(model, part, prior="split", check=False)
        return ClientProblem(
            model, self.rows, prior_weight=prior_weight,
            likelihood_weight=spec.likelihood_weight, shared=self.shared, max_size=max_size,
            index=self.index, potential=self._potential,
        )

    def fingerprint(self, spec_json: str) -> dict[str, Any]:
        """The ``hello`` fingerprint (:mod:`numpyro_fed.flower.checks`): the settings this
        client parsed from the server's spec (``settings``, JSON) and its potential on the
        synthetic probe of its row schema (``probe``, JSON list of :math:`2d + 2` numbers),
        or why they could not be computed (``settings_error`` / ``probe_error``). Nothing
        of the client's data is in it."""
        try:
            spec = FlowerSpec.from_config(json.loads(spec_json))
        except (TypeError, ValueError, KeyError) as err:
            return {"settings_error": f"{type(err).__name__}: {err}"}
        out: dict[str, Any] = {"settings": json.dumps(spec_settings(spec.to_config()))}
        try:  # the potential this client would run (its model, weight, shared arguments)
            prob = self.make_problem(spec, 1.0, None)
        except Exception as err:  # noqa: BLE001 - reported to the server, which decides
            return {**out, "probe": json.dumps({"error": f"{type(err).__name__}: {err}"})}
        schema = {k: (v.shape[1:], v.dtype) for k, v in self.rows.items()}
        out["probe"] = json.dumps(probes(prob.potential, prob.tau, schema))
        return out

    def _setup(self, spec: FlowerSpec, prior_weight: float, max_size: int) -> ClientProblem:
        key = (json.dumps(spec.to_config(), sort_keys=True), prior_weight, max_size)
        if self._problem is None or self._problem_key != key:
            self._problem = self.make_problem(spec, prior_weight, max_size)
            d = self._problem.dim
            alg = spec.federated_algorithm()
            self._alg = alg
            self._codec = (dense_codec(d) if alg.uplink is None
                           else codec_for(wire_name(alg.uplink), d))
            self._down = None if alg.downlink is None else codec_for(wire_name(alg.downlink), d)
            self._template = None
            self._problem_key = key
        return self._problem

    @staticmethod
    def _dense(arrays: Mapping[str, np.ndarray], name: str, dense: WireCodec) -> jax.Array:
        if name not in arrays:
            raise ValueError(f"instruction without its {name!r} array")
        return jnp.asarray(dense.decode(arrays[name])[0])

    def _shadow_update(self, cmd: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                       state: dict[str, Any], k: int, dense: WireCodec) -> jax.Array:
        """The view of the EF21-P broadcast at round ``k``
        (:func:`~numpyro_fed.flower.catchup.apply_updates`)."""
        return apply_updates(cmd, arrays, state, k, dense, self._down)

    def handle(self, cmd: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
               state: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray, dict[str, Any]]:
        """Answer one instruction.

        Phases: ``hello`` (index and data schema; with the server's ``spec``, the
        fingerprint of this client's model and settings, :meth:`fingerprint`), ``init``
        (ELF: model :math:`w_0` in, dense :math:`\\nabla U_i(w_0)` out), ``grad``
        (QLSD* search: dense :math:`\\nabla U_i(\\theta)`), ``star``
        (QLSD*: keep :math:`\\theta^\\star`, return :math:`\\nabla U_i(\\theta^\\star)`),
        ``step`` (one iteration of the kernel).

        :param cmd: scalars of the instruction (``phase``, ``round``, ``ack``, ...).
        :param arrays: arrays of the instruction (``theta`` dense payload, ``key``, ...).
        :param state: this client's persistent state (modified copy returned).
        :return: ``(meta, payload, state)``: reply scalars, the uint8 payload, new state.
        """
        phase = cmd["phase"]
        if phase == "hello":
            problem = self.schema_error()
            if problem is not None:
                return {"phase": "hello", "index": self.index,
                        "data_error": problem}, np.zeros(0, np.uint8), state
            meta = {"phase": "hello", "index": self.index, "schema": json.dumps(self.schema())}
            if "spec" in cmd:  # the server's settings: answer with this client's fingerprint
                meta.update(self.fingerprint(str(cmd["spec"])))
            return meta, np.zeros(0, np.uint8), state
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
        k = int(cmd["round"])
        alg = self._alg
        setup_names = {r.name: r for r in alg.setup}
        if phase == "grad" or phase in setup_names:  # setup rounds: dense gradients
            rnd = setup_names.get(phase)
            if rnd is not None and rnd.point == "start" and alg.keeps_view and (
                    alg.downlink is not None):  # w_0 = x_0 (dense) or 0 + Q^P(x_0 - 0)
                state.update(w=np.zeros(d, np.float32), w_round=-2)
                point = self._shadow_update(cmd, arrays, state, -1, dense)
            else:
                point = self._dense(arrays, "theta", dense)
            grad = np.asarray(prob.full_grad(point), np.float32)
            if not np.all(np.isfinite(grad)):
                return nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
            payload, bits, dec = dense.compress(None, grad)
            if rnd is not None:  # kept: the setup's results, constants of the run
                state.update({f"setup.{phase}.point": np.asarray(point, np.float32),
                              f"setup.{phase}.grads": dec})
            return {"phase": phase, "round": k, "bits": bits}, payload, state
        if phase != "step":
            raise ValueError(f"unknown phase {phase!r}")
        b = spec.num_clients
        setup = {}
        for r in alg.setup:
            if f"setup.{r.name}.point" not in state:
                raise ValueError(f"{alg.name} step before its {r.label}: the client lost its "
                                 "state")
            setup[r.name] = SetupResult(jnp.asarray(state[f"setup.{r.name}.point"]),
                                        jnp.asarray(state[f"setup.{r.name}.grads"]))
        # the model this client evaluates at: the dense broadcast or its EF21-P view
        if alg.downlink is not None:
            view = self._shadow_update(cmd, arrays, state, k, dense)
        else:
            view = self._dense(arrays, "theta", dense)
        # the algorithm's client state, by field name (initialised at the first step)
        if self._template is None:
            self._template = jax.eval_shape(lambda v: alg.init_client(prob, v, setup), view)
        if int(state.get("initialised", 0)):
            cs = state_from_arrays(self._template, state, prefix="")
        else:
            cs = alg.init_client(prob, view, setup)
        # commit the previous message if the server applied it
        pending = state.get("pending")
        if pending is not None and pending.size and int(state.get("pending_round", -10)) == int(
            cmd["ack"]
        ):
            cs = alg.commit(cs, jnp.asarray(pending), None)
        state["pending"] = np.zeros(0, np.float32)
        state["pending_round"] = -10
        if alg.refresh_every is not None:  # refreshed when the server says so, or caught up
            if bool(cmd.get("refresh", False)) or "refresh_point" in arrays:
                point = view if bool(cmd.get("refresh", False)) else self._dense(
                    arrays, "refresh_point", dense)
                cs = alg.refresh(prob, point, cs)
        k_alg = random.wrap_key_data(jnp.asarray(arrays["key"], jnp.uint32))
        keys = alg.round_keys(k_alg)
        h = alg.client_step(prob, keys, view, cs, setup)
        kc = client_key(keys.uplink, self.index, b)
        state.update(state_to_arrays(cs, prefix=""))
        state["initialised"] = 1
        # a non-finite message (the chain diverged; in process the next x is not finite):
        # say so and send nothing, the server stops with a DivergenceError
        if not bool(jnp.all(jnp.isfinite(h))):
            return nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
        try:
            payload, bits, dec = self._codec.compress(kc, h)
        except (ValueError, OverflowError):
            comp = alg.uplink
            v_hat = h if comp is None else comp(kc, h)[0]
            if bool(jnp.all(jnp.isfinite(v_hat))):
                raise
            return nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
        if not np.all(np.isfinite(dec)):
            return nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
        state["pending"] = dec
        state["pending_round"] = k
        return {"phase": "step", "round": k, "bits": int(bits)}, payload, state


def probes(potential: FederatedPotential, likelihood_weight: Any,
           schema: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`~numpyro_fed.flower.checks.probe_values` of a potential on each synthetic
    data set of :data:`~numpyro_fed.flower.checks.PROBE_SETS` for the row ``schema``:
    ``{kind: list of 2d + 2 numbers}``, or ``{kind: "why it failed"}`` (the server compares
    on the sets where its own model is finite; values outside a likelihood's support give
    ``-inf``, and NumPyro's warnings about them are meaningless here and silenced)."""
    import warnings

    out: dict[str, Any] = {}
    for kind in PROBE_SETS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[kind] = probe_values(potential, likelihood_weight,
                                         probe_rows(schema, kind)).tolist()
        except Exception as err:  # noqa: BLE001 - reported to the server, which decides
            out[kind] = f"{type(err).__name__}: {err}"
    return out


def nonfinite_reply(phase: str, k: int) -> dict[str, Any]:
    """A client's reply when its message is not finite (the chain diverged): no payload,
    the flag ``nonfinite``; the server stops with a DivergenceError."""
    return {"phase": phase, "round": k, "bits": 0, "nonfinite": 1}
