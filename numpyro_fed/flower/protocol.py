"""Transport-independent protocol of the federated kernels: client worker and server.

:class:`ClientWorker` is what a client runs: it holds only its own data and its own state
(QLSD memory term :math:`\\eta_i`, QLSD++ control point :math:`\\zeta` and
:math:`\\nabla U_i(\\zeta)`, QLSD*'s :math:`\\theta^\\star` and :math:`\\nabla U_i(\\theta^\\star)`,
the ELF error-feedback estimator :math:`g_i`, P-/B-ELF's shadow model :math:`w`) and answers
the server's instructions with compressed messages. :class:`ServerCoordinator` runs the
kernel's server step: it draws the Langevin noise, asks the clients, receives only compressed
messages, aggregates them and stores the draws. Neither computes an algorithm step of its
own: the client calls the client half of :mod:`numpyro_fed.algorithms.qlsd` /
:mod:`numpyro_fed.algorithms.elf` (the variant's
:class:`~numpyro_fed.algorithms.estimators.GradientEstimator` on its
:class:`~numpyro_fed.algorithms.oracles.ClientProblem`, ``client_message``, ``client_commit``,
``shadow_update``), the server their server half (``server_aggregate`` on the ``(b, d)``
decoded messages with zero rows for absent clients, ``server_move``, ``downlink_message``)
and :mod:`numpyro_fed.algorithms.theta_star` for QLSD*'s search -- the functions the
in-process kernels call -- with the kernels' random keys (the step key split
``(rng_key, k_noise, k_alg) = split(rng_key, 3)``, client ``i`` drawing its minibatch from its
own words of the batch key (:func:`~numpyro_fed.potential.client_bits`) and compressing with
``split(k, b)[i]``). What this module adds is transport: instructions, acknowledgements,
catch-ups, faults and bit accounting on the wire. So for a fixed seed and no faults the
deployment reproduces ``QLSD``/``ELF`` run in process up to float32 summation order (a
client sums over its :math:`N_i` rows, the kernel over padded rows).

**Consistency under faults.** A client's state update that depends on the server applying
its message (QLSD's :math:`\\eta_i \\mathrel{+}= \\alpha g_i`, D-/B-ELF's
:math:`g_i \\mathrel{+}= c_i`) is kept *pending* and committed only when the server's next
instruction acknowledges that round (``ack``). A message that was lost, late or rejected is
never acknowledged, so client and server state never diverge
(:math:`\\eta = \\sum_i \\eta_i`, :math:`g = \\sum_i g_i`; P-ELF's server keeps the last dense
:math:`g_i` of every client). Reweighting of the received messages:
:mod:`numpyro_fed.algorithms.participation`.

**P-/B-ELF: the compressed model broadcast and its catch-up** (ELF Alg. 2-3, EF21-P). The
server owns the shadow model :math:`w_k = w_{k-1} + \\mathcal{Q}^P(x_{k+1} - w_{k-1})` and
sends the *serialised compressed update* of round ``k``; every client keeps its own copy of
:math:`w` and the round ``w_round`` it corresponds to. A client that missed rounds (not
sampled, message dropped, reply lost) is brought up to date the next time it is asked, with
the cheaper of two exact options, chosen per client and counted in its downlink bits:

* *replay*: the compressed updates of the missed rounds ``a+1..k`` (``a`` = the last round the
  server knows the client holds), which the client adds in order with the same float32
  additions as the server -- bitwise the server's :math:`w_k`; a client that already holds a
  later round than ``a`` (its reply was lost) skips the updates it has;
* *dense*: :math:`w_k` itself (``32 d`` bits), when the replay would cost at least as much.

So a rejoining client never pays more than one dense model, the server keeps only the updates
whose replay is still cheaper than a dense model (a bounded history), and no approximation is
made: client and server :math:`w` are equal bit for bit (checked by the tests).

**QLSD*** (Alg. 2 with :math:`\\theta^\\star`). :math:`\\theta^\\star` is either given
(constrained site values, as in process) or found by the federated Barzilai--Borwein (or Adam)
descent of :func:`~numpyro_fed.kernels.qlsd.find_theta_star`, one round per gradient
evaluation (dense :math:`\\theta` down, dense :math:`\\nabla U_i(\\theta)` up, every client
required); then one counted round broadcasts :math:`\\theta^\\star` and collects
:math:`\\nabla U_i(\\theta^\\star)`, the server keeps :math:`g^\\star = \\sum_i
\\nabla U_i(\\theta^\\star)` and the clients send
:math:`\\mathcal{C}(H_i(\\theta) - H_i(\\theta^\\star))`.

Supported kernels: QLSD#, QLSD* and QLSD++ (any unbiased compressor with a wire format,
memory, minibatches, participation), D-ELF, P-ELF and B-ELF (any contractive compressor with a
wire format, minibatches, participation).
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

from numpyro_fed._validation import check_float, check_int, check_positive_float
from numpyro_fed.algorithms import theta_star as search_alg
from numpyro_fed.algorithms.families import algorithm_from_fields, fields_of, is_reference
from numpyro_fed.algorithms.federated import (
    SEARCH_SALT,
    X0_SALT,
    FederatedAlgorithm,
    SetupResult,
    broadcast_apply,
    broadcast_message,
    setup_key,
    state_from_arrays,
    state_to_arrays,
    step_keys,
)
from numpyro_fed.algorithms.oracles import ClientProblem, client_key
from numpyro_fed.algorithms.participation import (
    check_participation,
    participation_mask,
    warn_if_many_empty_rounds,
)
from numpyro_fed.algorithms.theta_star import ThetaStarSearch
from numpyro_fed.algorithms.variants import (
    deployment_algorithms,
)
from numpyro_fed.compressors import Compressor, CompressorSpec
from numpyro_fed.flower.checks import (
    PROBE_SETS,
    ClientMismatchError,
    DeploymentError,
    ParticipationMonitor,
    nonfinite_rows_message,
    probe_difference,
    probe_rows,
    probe_values,
    spec_differences,
    spec_settings,
)
from numpyro_fed.flower.codecs import (
    WireCodec,
    WireFormatError,
    codec_for,
    dense_codec,
    deployable_spec,
)
from numpyro_fed.kernels.base import DivergenceError, check_step_size
from numpyro_fed.kernels.driver import centring_at, centring_warning, user_point
from numpyro_fed.kernels.langevin import _DIVERGED
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential, prior_weights

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

# the algorithm names and their variants: the package's one table (algorithms.variants)
_ALGORITHMS = deployment_algorithms()
_SEARCH_METHODS = ("bb", "adam")


def kernel_display_name(spec: FlowerSpec) -> str:
    """The name of the deployed kernel in messages, as the in-process kernel writes it."""
    return spec.federated_algorithm().name


def divergence_message(spec: FlowerSpec, iteration: int, detail: str = "") -> str:
    """The message of the :class:`~numpyro_fed.kernels.base.DivergenceError` of a deployment:
    the in-process kernel's message (same kernel name, iteration and ``step_size``), with
    ``detail`` (e.g. which client found it) appended."""
    msg = _DIVERGED.format(kernel=kernel_display_name(spec), step_size=spec.step_size)
    msg = msg.format(iteration=iteration, chain="")
    return f"{msg} {detail}".rstrip()


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

    :param algorithm: ``"qlsd"``, ``"delf"``, ``"pelf"`` or ``"belf"``.
    :param model: import reference of the NumPyro model, ``"package.module:function"``.
    :param num_clients: ``b``.
    :param step_size: :math:`\\gamma`.
    :param num_samples: number of steps (every draw is kept).
    :param variant: QLSD variant, ``"#"``, ``"*"`` or ``"++"`` (or any spelling the kernels
        accept, :data:`numpyro_fed.algorithms.variants.VARIANTS`; stored canonical).
    :param batch_size: per-client minibatch ``n`` (0: exact local gradients).
    :param compressor: the uplink compressor: QLSD's :math:`\\mathcal{C}`, D-/B-ELF's
        :math:`\\mathcal{Q}^D`; ``"identity"`` for P-ELF (dense gradients). Given as a
        :class:`~numpyro_fed.compressors.Compressor`, its
        :class:`~numpyro_fed.compressors.CompressorSpec` or a string
        :func:`~numpyro_fed.compressors.get_compressor` reads; stored as the canonical text
        of its spec (``"quantize(s=16)"``, ``"top_k(k=2)"``, ``"scaled(rand_k(k=3))"``). A
        compressor without a spec (a custom one) has no wire format: ``ValueError``.
    :param downlink: P-/B-ELF's contractive model compressor :math:`\\mathcal{Q}^P`
        (``"identity"`` for the other algorithms), in the same forms.
    :param w0: P-/B-ELF's initial shadow model: ``"x0"`` (dense :math:`x_0`, Alg. 2-3) or
        ``"compressed"`` (:math:`\\mathcal{Q}^P(x_0)`, ELF eq. (3)).
    :param memory_rate: QLSD's :math:`\\alpha`.
    :param refresh_every: QLSD++'s ``l``.
    :param theta_star: QLSD*: JSON of the constrained site values of :math:`\\theta^\\star`
        (``{"w": [...]}``); empty: federated search.
    :param theta_star_method: QLSD*'s search, ``"bb"`` (Barzilai--Borwein) or ``"adam"``.
    :param theta_star_maxiter: its maximal number of iterations (one round each).
    :param theta_star_gtol: its relative gradient tolerance.
    :param theta_star_lr: Adam's step size.
    :param participation: probability that a client is asked in a round.
    :param prior: ``"split"``, ``"size"`` or ``"server"``.
    :param likelihood_weight: :math:`\\tau` (the same for every client).
    :param seed: the chain's key is ``random.key(seed)``.
    :param round_timeout: seconds the server waits for the replies of a round.
    :param init: ``"uniform"`` (NumPyro's ``init_to_uniform`` with the kernel's key) or
        ``"zeros"`` (unconstrained zeros).
    :param max_empty_rounds: the run stops with a
        :class:`~numpyro_fed.flower.checks.ParticipationError` naming the rounds after this
        many consecutive rounds in which clients were asked and none answered (a random walk
        without data); ``0`` never stops. See
        :class:`~numpyro_fed.flower.checks.ParticipationMonitor`.
    :param min_participation: the run stops with a
        :class:`~numpyro_fed.flower.checks.ParticipationError` when the share of the
        requests that were answered (the observed participation over the declared
        ``participation``) is significantly below this (a binomial-tail test, whole run and
        last 100 rounds, false-alarm probability below 1e-6 per run); ``0`` never stops.
    """

    algorithm: str
    model: str
    num_clients: int
    step_size: float
    num_samples: int
    variant: str = "#"
    batch_size: int = 0
    compressor: str = "identity"
    downlink: str = "identity"
    w0: str = "x0"
    memory_rate: float = 0.0
    refresh_every: int = 100
    theta_star: str = ""
    theta_star_method: str = "bb"
    theta_star_maxiter: int = 2000
    theta_star_gtol: float = 1e-5
    theta_star_lr: float = 1e-2
    participation: float = 1.0
    prior: str = "split"
    likelihood_weight: float = 1.0
    seed: int = 0
    round_timeout: float = 60.0
    init: str = "uniform"
    max_empty_rounds: int = 3
    min_participation: float = 0.5
    options: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.algorithm, str) or not (
                self.algorithm in _ALGORITHMS or is_reference(self.algorithm)):
            raise ValueError(
                f"`algorithm` must be one of {_ALGORITHMS} (QLSD#/QLSD*/QLSD++, D-ELF, P-ELF or "
                f"B-ELF in the Flower deployment) or an import reference "
                f"'package.module:factory' of a FederatedAlgorithm, got {self.algorithm!r}."
            )
        self.num_clients = check_int("num_clients", self.num_clients, minimum=1)
        self.num_samples = check_int("num_samples", self.num_samples, minimum=1)
        self.step_size = check_step_size(self.step_size)
        self.batch_size = check_int("batch_size", self.batch_size, minimum=0)  # 0: exact
        self.refresh_every = check_int("refresh_every", self.refresh_every, minimum=1)
        self.theta_star_maxiter = check_int("theta_star_maxiter", self.theta_star_maxiter,
                                            minimum=0)
        self.seed = check_int("seed", self.seed, minimum=0)
        self.memory_rate = check_float("memory_rate", self.memory_rate, low=0.0, high=1.0,
                                       what=" (0 switches QLSD's memory off)")
        self.likelihood_weight = check_positive_float("likelihood_weight",
                                                      self.likelihood_weight)
        self.round_timeout = check_positive_float("round_timeout", self.round_timeout,
                                                  what=" (seconds)")
        self.max_empty_rounds = check_int("max_empty_rounds", self.max_empty_rounds, minimum=0)
        self.min_participation = check_float(
            "min_participation", self.min_participation, low=0.0, high=1.0,
            what=" (the share of requests that must be answered; 0 switches the check off)")
        self.theta_star_gtol = check_positive_float("theta_star_gtol", self.theta_star_gtol)
        self.theta_star_lr = check_positive_float("theta_star_lr", self.theta_star_lr)
        for name in ("compressor", "downlink"):
            value = getattr(self, name)
            if not isinstance(value, Compressor | CompressorSpec) and (
                    not isinstance(value, str) or not value.strip()):
                raise TypeError(f"`{name}` must be a compressor name such as 'identity', "
                                f"'quantize(s=16)' or 'top_k(k=2)', got {value!r}.")
            # the compressor's structured spec, as its canonical text; refused (naming the
            # argument) when it has none: a custom compressor cannot be deployed
            setattr(self, name, deployable_spec(value, name))
        if self.prior not in ("split", "size", "server"):
            raise ValueError(f"`prior` must be 'split', 'size' or 'server', got {self.prior!r}.")
        if self.init not in ("uniform", "zeros"):
            raise ValueError(f"`init` must be 'uniform' or 'zeros', got {self.init!r}.")
        self.participation = check_participation(self.participation)
        warn_if_many_empty_rounds(self.participation, self.num_clients, stacklevel=4)
        if self.w0 not in ("x0", "compressed"):
            raise ValueError(f"`w0` must be 'x0' or 'compressed', got {self.w0!r}.")
        if self.theta_star_method not in _SEARCH_METHODS:
            raise ValueError(
                f"`theta_star_method` must be one of {_SEARCH_METHODS} in the deployment (BFGS's "
                f"line search is not distributed), got {self.theta_star_method!r}."
            )
        try:
            options = json.loads(self.options) if self.options else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"`options` must be JSON of the algorithm's options: {err}") from err
        # the algorithm value, built and validated once (its compressor rules live there)
        alg = algorithm_from_fields(asdict(self), options)
        fields_ = fields_of(alg.description)
        if "variant" in fields_:  # any spelling the kernels accept, stored canonical
            self.variant = fields_["variant"]
        self._algorithm = alg

    def federated_algorithm(self) -> FederatedAlgorithm:
        """The :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` this spec
        deploys (built once, when the spec is)."""
        return self._algorithm

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
        """The spec that reproduces an in-process ``QLSD`` (any variant) or ``ELF`` (D, P, B)
        kernel.

        :param kernel: the in-process kernel.
        :param model: import reference of the kernel's model.
        :raises ValueError: for another kernel (naming it), a custom QLSD oracle, or
            per-client likelihood weights.
        """
        alg = getattr(kernel, "algorithm", None)
        if not isinstance(alg, FederatedAlgorithm):
            raise ValueError(
                f"No Flower deployment for {type(kernel).__name__}: supported are the kernels "
                "of a FederatedAlgorithm (QLSD with variants '#', '*' and '++', ELF with D, P "
                "and B, AlgorithmKernel).")
        for arg, comp in (("compressor", alg.uplink), ("downlink", alg.downlink)):
            if comp is not None:  # a custom compressor has no wire format: refused by name
                deployable_spec(comp, arg)
        if "error" in alg.description:
            raise ValueError(alg.description["error"])
        pot = kernel.potential
        if not np.allclose(pot.likelihood_weight, pot.likelihood_weight[0]):
            raise ValueError("The Flower deployment needs one likelihood weight for all clients.")
        common = dict(
            model=model, num_clients=kernel.partition.num_clients,
            step_size=kernel.step_size, num_samples=num_samples,
            batch_size=kernel.batch_size or 0, prior=pot.prior_mode,
            likelihood_weight=float(pot.likelihood_weight[0]), seed=seed,
            participation=alg.participation,
        )
        common.update(fields_of(alg.description))
        common.update(kwargs)
        return cls(**common)


# ============================================================================ client
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
        """Bring the shadow model :math:`w` to round ``k``: a dense :math:`w_k` (``w``) or the
        compressed updates of rounds ``w_from..k`` (``down``, byte lengths ``down_len``), of
        which the rounds this client already holds are skipped."""
        if "w" in arrays:
            w = self._dense(arrays, "w", dense)
        else:
            if "down" not in arrays or "down_len" not in arrays or "w_from" not in cmd:
                raise ValueError("P-/B-ELF instruction without the model update")
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
            w = jnp.asarray(state["w"]) if "w" in state else jnp.zeros(self._down.dim,
                                                                        jnp.float32)
            offsets = np.concatenate([[0], np.cumsum(lens)])
            for j in range(lens.size):
                if start + j <= have:
                    continue  # already applied (the server did not see our last reply)
                v, _ = self._down.decode(chunks[offsets[j]:offsets[j + 1]])
                w = broadcast_apply(w, jnp.asarray(v))  # the server's addition
        state["w"] = np.asarray(w, np.float32)
        state["w_round"] = int(k)
        return jnp.asarray(state["w"])

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
                return _nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
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
            return _nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
        try:
            payload, bits, dec = self._codec.compress(kc, h)
        except (ValueError, OverflowError):
            comp = alg.uplink
            v_hat = h if comp is None else comp(kc, h)[0]
            if bool(jnp.all(jnp.isfinite(v_hat))):
                raise
            return _nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
        if not np.all(np.isfinite(dec)):
            return _nonfinite_reply(phase, k), np.zeros(0, np.uint8), state
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


def _nonfinite_reply(phase: str, k: int) -> dict[str, Any]:
    """A client's reply when its message is not finite (the chain diverged): no payload,
    the flag ``nonfinite``; the server stops with a DivergenceError."""
    return {"phase": phase, "round": k, "bits": 0, "nonfinite": 1}


_PHASE_LABEL = {"grad": "QLSD* theta* search", "star": "QLSD* g* round",
                "init": "ELF initial round"}


# ============================================================================ server
_SETUP_KEYS = ("up_declared", "up_payload", "up_wire", "down_declared", "down_payload",
               "down_wire", "rounds")


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
        spec = self.spec
        if phase == "step":
            it = k + 2 if spec.federated_algorithm().moves_first else k + 1
            err = DivergenceError(divergence_message(
                spec, it, f"(client {i}'s message of round {k} is not finite.)"))
            err.iteration = it
            return err
        return DivergenceError(
            f"numpyro_fed: {kernel_display_name(spec)}: client {i}'s gradient in the "
            f"{_PHASE_LABEL.get(phase, phase)} is not finite at the point the server sent; "
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

    # -- P-/B-ELF downlink --------------------------------------------------------------------
    def _shadow_request(self, i: int, k: int, known: np.ndarray, hist: dict[int, tuple],
                        w_dense: Callable[[], np.ndarray]) -> tuple[dict, dict, int, int]:
        """The model update for client ``i`` in round ``k``: the compressed updates of the
        rounds it misses (``known[i]+1..k``) or, when that is incomplete or costs at least a
        dense model, :math:`w_k` dense. Return ``(cmd extras, arrays, declared bits, payload
        bits)``."""
        d = self.potential.dim
        rounds = range(int(known[i]) + 1, k + 1)
        complete = all(r in hist for r in rounds)
        chain_bits = sum(hist[r][1] for r in rounds) if complete else math.inf
        if len(rounds) > 1:
            kind = "dense" if chain_bits >= 32 * d else "replay"
            self.log.catchups.append((k, i, kind, len(rounds) - 1))
            if kind == "dense":
                payload = w_dense()
                return {}, {"w": payload}, 32 * d, 8 * int(payload.size)
        chunks = [hist[r][0] for r in rounds]
        arrays = {"down": np.concatenate(chunks).astype(np.uint8),
                  "down_len": np.asarray([c.size for c in chunks], np.int32)}
        return {"w_from": rounds.start}, arrays, int(chain_bits), 8 * int(arrays["down"].size)

    @staticmethod
    def _prune(hist: dict[int, tuple], known: np.ndarray, dense_bits: int) -> None:
        """Keep only the updates some client may still get replayed: rounds after the oldest
        round a client is known to hold, and not those whose replay would cost at least a
        dense model anyway."""
        for r in [r for r in hist if r <= int(known.min())]:
            del hist[r]
        total = sum(bits for _, bits in hist.values())
        for r in sorted(hist):
            if total - hist[r][1] < dense_bits:
                break
            total -= hist.pop(r)[1]

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
                    extra, arrays, declared, pay = self._shadow_request(i, k, known, hist,
                                                                        w_dense)
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
                self._prune(hist, known, 32 * d)
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


def wire_name(compressor: Compressor) -> str:
    """The canonical spec text of a compressor of the algorithm (its wire format's name)."""
    return deployable_spec(compressor, "compressor")
