"""The settings of a deployment: :class:`FlowerSpec` (the algorithm's description plus the
run's and the transport's options), sent to every client at ``hello``.

The algorithm is named by the variant table's ``algorithm`` column (``"qlsd"`` with its
``variant``, ``"delf"``, ``"pelf"``, ``"belf"``; the family reads the other fields) or by an
import reference ``"module:factory"`` with its ``options`` (JSON): an algorithm defined
outside the package. Either way the spec builds the
:class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` once, which validates it (the
compressor rules live in the algorithm's constructor), and the client and the server run it
(:meth:`FlowerSpec.federated_algorithm`).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from numpyro_fed._validation import check_float, check_int, check_positive_float
from numpyro_fed.algorithms.families import algorithm_from_fields, fields_of
from numpyro_fed.algorithms.federated import (
    FederatedAlgorithm,
)
from numpyro_fed.algorithms.participation import (
    check_participation,
    warn_if_many_empty_rounds,
)
from numpyro_fed.compressors import Compressor, CompressorSpec
from numpyro_fed.flower.codecs import (
    deployable_spec,
)
from numpyro_fed.kernels.base import check_step_size
from numpyro_fed.kernels.langevin import _DIVERGED

__all__ = ["FlowerSpec", "load_model", "kernel_display_name", "divergence_message",
           "wire_name"]

log = logging.getLogger("numpyro_fed.flower")

#: the search methods a deployment runs (BFGS needs potential values: in process only)
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
        if not isinstance(self.algorithm, str):  # its value is checked by the algorithm's family
            raise TypeError(f"`algorithm` must be a string, got {self.algorithm!r}.")
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


def wire_name(compressor: Compressor) -> str:
    """The canonical spec text of a compressor of the algorithm (its wire format's name)."""
    return deployable_spec(compressor, "compressor")
