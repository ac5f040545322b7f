"""Error-feedback Langevin algorithms (ELF): D-ELF, P-ELF and B-ELF.

Karagulyan & Richtárik, "ELF: Federated Langevin Algorithms with Primal, Dual and
Bidirectional Compression" (2023, arXiv:2303.04622). Three federated Langevin
Monte Carlo (LMC) samplers that compress the messages with a *contractive* compressor
(Def. 2.1: :math:`\\mathbb{E}\\|\\mathcal{Q}(v) - v\\|^2 \\le (1-\\alpha)\\|v\\|^2`) and
correct the compression error with error feedback:

* :class:`DELF` -- *dual* compression (Alg. 1, EF21 on the uplink): clients send
  :math:`\\mathcal{Q}^D(\\nabla U_i(x_{k+1}) - g^i_k)`; the server broadcasts the dense
  :math:`x_{k+1}`.
* :class:`PELF` -- *primal* compression (Alg. 2, EF21-P on the downlink): the server
  broadcasts :math:`\\mathcal{Q}^P(x_{k+1} - w_k)`; clients keep the shadow model
  :math:`w_k` and send dense :math:`\\nabla U_i(w_{k+1})`.
* :class:`BELF` -- *bidirectional* compression (Alg. 3): both.
* :class:`ELF` -- the three behind one class, ``ELF(..., variant="D"|"P"|"B")``.

With identity compressors all three reduce to federated LMC, i.e.
:class:`~numpyro_fed.kernels.langevin.FederatedLangevin` with full local gradients (the
papers' uncompressed baseline); with the same key they produce the same chain.

**Conventions.** The target is :math:`\\pi \\propto e^{-U}` with :math:`U = U_0 + \\sum_{i=1}^b
U_i` (*sum* over the :math:`b` clients; :math:`U_0` is the server's prior share, zero with the
default ``prior="split"``). Karagulyan & Richtárik *average*: :math:`F = \\frac1b\\sum_i f_i`
and their server update is :math:`g_{k+1} = g_k + \\frac1b\\sum_i(\\cdot)`. The two coincide with
:math:`U_i = f_i / b`; the paper's tempered logistic target
:math:`f_i = \\frac1{N_i}\\sum_j \\ell_{ij} + \\frac\\lambda2\\|x\\|^2` is obtained with
``likelihood_weight = 1/(b N_i)``, ``prior="split"`` and a Gaussian prior of variance
:math:`1/\\lambda` (see :class:`~numpyro_fed.potential.FederatedPotential`).

**Bits.** ``bits_up`` is the sum over clients of the coded lengths of their messages;
``bits_down`` is the number of bits *received by the clients*, i.e. ``b`` times the length of
the broadcast message (a dense float32 vector costs ``32 d``). The one-off rounds at
initialisation (broadcast of :math:`x_0` or :math:`\\mathcal{Q}^P(x_0)`, dense initial
gradients :math:`\\nabla U_i(w_0)`) are added to the cumulative counters
``state.total_up`` / ``state.total_down`` but not to the per-step sample field ``bits``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.algorithms import elf as core
from numpyro_fed.algorithms.elf import check_contractive
from numpyro_fed.algorithms.federated import AlgorithmState, FederatedAlgorithm
from numpyro_fed.algorithms.variants import VARIANTS, variant_info
from numpyro_fed.compressors import Compressor, get_compressor, identity
from numpyro_fed.kernels.base import check_compressor_dim
from numpyro_fed.kernels.driver import AlgorithmKernel
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential

__all__ = [
    "ELFState",
    "ELF",
    "DELF",
    "PELF",
    "BELF",
    "ELF_VARIANTS",
    "check_contractive",
    "lmc_bits_per_step",
]

#: Variants of :class:`ELF` and what they compress (from the package's one variant table,
#: :data:`numpyro_fed.algorithms.variants.VARIANTS`).
ELF_VARIANTS = {v.code: v.description for v in VARIANTS if v.family == "elf"}


class ELFState(AlgorithmState):
    """Algorithm state of the ELF kernels (the ``extra`` field of
    :class:`~numpyro_fed.kernels.langevin.FedState`; one chain, vectorized chains add a
    leading axis): an :class:`~numpyro_fed.algorithms.federated.AlgorithmState` whose
    ``clients`` are :class:`~numpyro_fed.algorithms.elf.ELFClientState` (stacked), ``server``
    an :class:`~numpyro_fed.algorithms.elf.ELFAlgServerState` and ``view`` the clients' model,
    with the names of the paper:

    - **g_local** -- ``(b, d)``: the clients' gradient estimators :math:`g^i_k`. D-ELF and
      B-ELF: EF21 estimators of :math:`\\nabla U_i(x_k)` resp. :math:`\\nabla U_i(w_k)`; P-ELF:
      the exact :math:`\\nabla U_i(w_k)` the clients last sent.
    - **g** -- ``(d,)``: the server's estimator :math:`g_k`, updated only from the received
      messages; error feedback keeps :math:`g_k = \\sum_i g^i_k` (up to rounding).
    - **w** -- ``(d,)``: the model the clients hold: :math:`x_k` for D-ELF, the EF21-P shadow
      iterate :math:`w_k` for P-ELF and B-ELF.
    - **participants** -- with ``participation < 1``: boolean ``(b,)`` mask of the clients
      whose uplink message was applied in the last round; ``()`` otherwise.

    Collect them with ``mcmc.run(key, extra_fields=("extra.g", "extra.g_local"))``.
    """

    __slots__ = ()

    @property
    def g_local(self):
        return self.clients.g

    @property
    def g(self):
        return self.server.g

    @property
    def w(self):
        return self.view


class ELF(AlgorithmKernel):
    """Error-feedback Langevin algorithm, ``variant="D"`` (D-ELF, Alg. 1), ``"P"`` (P-ELF,
    Alg. 2) or ``"B"`` (B-ELF, Alg. 3) of Karagulyan & Richtárik 2023, as a NumPyro
    ``MCMCKernel``.

    One iteration (sum convention :math:`U = U_0 + \\sum_i U_i`, see the module docstring;
    :math:`\\mathcal{Q}^D` = ``uplink``, :math:`\\mathcal{Q}^P` = ``downlink``):

    .. math::

        x_{k+1} &= x_k - \\gamma\\,[\\nabla U_0(x_k) + g_k] + \\sqrt{2\\gamma}\\,Z_k
        \\\\
        w_{k+1} &= w_k + \\mathcal{Q}^P(x_{k+1} - w_k)
            \\quad (\\text{P, B; D: } w_{k+1} = x_{k+1})
        \\\\
        g^i_{k+1} &= g^i_k + \\mathcal{Q}^D(H_i(w_{k+1}) - g^i_k)
            \\quad (\\text{D, B; P: } g^i_{k+1} = H_i(w_{k+1}))
        \\\\
        g_{k+1} &= g_k + \\textstyle\\sum_i \\mathcal{Q}^D(H_i(w_{k+1}) - g^i_k)
            \\quad (\\text{P: } g_{k+1} = \\sum_i H_i(w_{k+1}))

    in the order of Algorithm 3: the server moves :math:`x`, compresses and broadcasts the
    model update, the clients update :math:`w`, then their gradient estimators, and the
    server aggregates. :math:`H_i` is the exact local gradient :math:`\\nabla U_i` (the
    paper) or, with ``batch_size=n``, the minibatch oracle :math:`(N_i/n)\\sum_{j\\in
    S_i}\\nabla U_{ij}` plus the exact prior share (not in the paper; off by default).
    The server's prior share :math:`\\nabla U_0` (``prior="server"``) is evaluated at the
    server's exact :math:`x_k`.

    **Initialisation** (one-off rounds, counted in ``total_up`` / ``total_down``): the server
    sends :math:`w_0` to every client -- :math:`w_0 = x_0` dense (Alg. 1-3, ``w0="x0"``,
    :math:`32 d b` bits) or :math:`w_0 = \\mathcal{Q}^P(x_0)` (eq. (3), ``w0="compressed"``,
    P/B only, ``b`` times the coded length) -- and the clients reply with dense
    :math:`g^i_0 = \\nabla U_i(w_0)` (exact gradients even with ``batch_size``), so that
    :math:`g_0 = \\sum_i g^i_0` (:math:`32 d b` bits).

    **Bits per step** (sample field ``bits``, i.e. ``bits_up``, ``bits_down``): D-ELF sends
    :math:`\\sum_i |\\mathcal{Q}^D(\\cdot)|` up and :math:`32 d b` down; P-ELF :math:`32 d b`
    up and :math:`b\\,|\\mathcal{Q}^P(x_{k+1} - w_k)|` down; B-ELF the compressed sizes both
    ways (``|.|`` = the compressor's coded length, ``k(32 + \\lceil\\log_2 d\\rceil)`` for
    Top-k).

    :param model: an ordinary NumPyro model.
    :param partition: the :class:`~numpyro_fed.partition.ClientPartition` of its data.
    :param variant: ``"D"``, ``"P"`` or ``"B"``.
    :param step_size: :math:`\\gamma`.
    :param uplink: contractive compressor :math:`\\mathcal{Q}^D` of the client messages
        (variants D and B; ``None`` = identity). E.g. ``compressors.top_k(1)`` or
        ``compressors.scaled(compressors.quantize(4))``.
    :param downlink: contractive compressor :math:`\\mathcal{Q}^P` of the model broadcast
        (variants P and B; ``None`` = identity).
    :param w0: ``"x0"`` (:math:`w_0 = x_0`, Alg. 2/3) or ``"compressed"``
        (:math:`w_0 = \\mathcal{Q}^P(x_0)`, eq. (3)); variants P and B.
    :param batch_size: per-client minibatch size for :math:`H_i` (``None``: exact local
        gradients, as in the paper).
    :param prior: who holds the prior (see :class:`~numpyro_fed.potential.FederatedPotential`).
    :param likelihood_weight: likelihood weight per client (``1/(b N_i)`` for the tempered target
        of Karagulyan & Richtárik 2023).
    :param init_strategy: NumPyro initialisation strategy.
    :param check_finite: stop with a clear error when a chain becomes non-finite.
    :param postprocess_deterministic: return deterministic sites in the samples.
    :param potential: a prebuilt :class:`~numpyro_fed.potential.FederatedPotential`.
    :param participation: probability ``p`` that a client takes part in a round (default 1).
        Only the clients in :math:`S_k` compute and send; the others keep their stale
        :math:`g^i`, and the server adds only the received corrections, so
        :math:`g = \\sum_i g^i` keeps holding (no reweighting: error feedback absorbs the
        missing updates). The model update of P-/B-ELF is a broadcast and reaches every
        client; D-ELF sends :math:`x_{k+1}` to the participants only. The mask of each round is
        ``state.extra.participants`` (see :mod:`numpyro_fed.algorithms.participation`).

    **Example**

    .. code-block:: python

        kernel = ELF(model, clients, variant="B", step_size=1e-3,
                     uplink=compressors.top_k(1), downlink=compressors.top_k(1))
        mcmc = MCMC(kernel, num_warmup=1000, num_samples=5000, num_chains=4,
                    chain_method="vectorized")
        mcmc.run(random.key(0))
        idata = numpyro_fed.to_inference_data(mcmc)  # bits_up / bits_down in
        # idata.sample_stats (az.from_numpyro: one `bits` variable, axis (up, down))
    """

    variant: str = "D"
    extra_type = ELFState

    _compressor_arg = "uplink"

    def __init__(
        self,
        model: Callable,
        partition: ClientPartition,
        *,
        variant: str | None = None,
        step_size: float,
        uplink: Compressor | str | None = None,
        downlink: Compressor | str | None = None,
        w0: str = "x0",
        batch_size: int | None = None,
        prior: str | Any = "split",
        likelihood_weight: float | Any = 1.0,
        init_strategy: Callable = init_to_uniform,
        check_finite: bool = True,
        postprocess_deterministic: bool = True,
        potential: FederatedPotential | None = None,
        participation: float = 1.0,
        track_potential: bool = False,
    ) -> None:
        variant = type(self).variant if variant is None else variant
        alg = core.algorithm(variant, step_size=step_size, uplink=uplink, downlink=downlink,
                             w0=w0, batch_size=batch_size, participation=participation)
        self.variant = alg.description["options"]["variant"]
        up = get_compressor(uplink)
        down = get_compressor(downlink)
        AlgorithmKernel.__init__(
            self, model, partition, algorithm=alg, prior=prior,
            likelihood_weight=likelihood_weight, init_strategy=init_strategy,
            check_finite=check_finite, postprocess_deterministic=postprocess_deterministic,
            potential=potential, track_potential=track_potential,
        )
        # the kernel's options (public attributes: a changed one is seen by `algorithm`)
        self.compressor = self.uplink = up
        self.downlink = down
        check_compressor_dim(up, self.potential.dim, self.potential.dtype, "uplink")
        check_compressor_dim(down, self.potential.dim, self.potential.dtype, "downlink")
        self.w0 = w0
        self.name = alg.name
        self._alg_key = self._algorithm_key()

    def _algorithm_key(self) -> tuple:
        return (self.variant, self._step_size, id(self.uplink), id(self.downlink), self.w0,
                self.batch_size, self.participation)

    @property
    def algorithm(self) -> FederatedAlgorithm:
        """The :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` this kernel runs,
        :func:`numpyro_fed.algorithms.elf.algorithm` of its options (built again if an
        option was changed since)."""
        if self._alg_key != self._algorithm_key():
            info = variant_info("elf", self.variant)
            self._algorithm = core.algorithm(
                self.variant, step_size=self._step_size,
                uplink=self.uplink if info.compress_up else None,
                downlink=self.downlink if info.compress_down else None, w0=self.w0,
                batch_size=self.batch_size, participation=self.participation)
            self._alg_key = self._algorithm_key()
        return self._algorithm

    @property
    def _compress_up(self) -> bool:
        """Whether the client messages are compressed (D-, B-ELF)."""
        return self.algorithm.uplink is not None

    @property
    def _compress_down(self) -> bool:
        """Whether the model broadcast is compressed (P-, B-ELF)."""
        return self.algorithm.downlink is not None

    def __repr__(self) -> str:
        return (
            f"{self.name}(step_size={self._step_size:.3g}, uplink={self.uplink.name}, "
            f"downlink={self.downlink.name}, batch_size={self.batch_size})"
        )


class DELF(ELF):
    """D-ELF (Karagulyan & Richtárik 2023, Alg. 1): EF21 compression of the client-to-server
    messages.

    ``DELF(model, partition, step_size=..., uplink=compressors.top_k(k))``; see :class:`ELF`
    for the recursion, initialisation, bits and all parameters."""

    variant = "D"

    def __init__(self, model: Callable, partition: ClientPartition, **kwargs: Any) -> None:
        _no_variant(kwargs, "DELF")
        super().__init__(model, partition, **kwargs)


class PELF(ELF):
    """P-ELF (Karagulyan & Richtárik 2023, Alg. 2): EF21-P compression of the server-to-client
    broadcast.

    ``PELF(model, partition, step_size=..., downlink=compressors.top_k(k), w0="x0")``; see
    :class:`ELF` for the recursion, initialisation, bits and all parameters."""

    variant = "P"

    def __init__(self, model: Callable, partition: ClientPartition, **kwargs: Any) -> None:
        _no_variant(kwargs, "PELF")
        super().__init__(model, partition, **kwargs)


class BELF(ELF):
    """B-ELF (Karagulyan & Richtárik 2023, Alg. 3): EF21-P on the downlink and EF21 on the uplink.

    ``BELF(model, partition, step_size=..., uplink=top_k(k), downlink=top_k(k))``; see
    :class:`ELF` for the recursion, initialisation, bits and all parameters."""

    variant = "B"

    def __init__(self, model: Callable, partition: ClientPartition, **kwargs: Any) -> None:
        _no_variant(kwargs, "BELF")
        super().__init__(model, partition, **kwargs)


def _no_variant(kwargs: dict, cls: str) -> None:
    if "variant" in kwargs:
        raise ValueError(f"{cls} fixes the variant; use ELF(..., variant=...) to choose it.")


# A convenience for the uncompressed baseline's bit count in docs and examples.
def lmc_bits_per_step(num_clients: int, dim: int) -> tuple[int, int]:
    """Bits per step of federated LMC (dense gradients up, dense model down):
    ``(32 d b, 32 d b)``."""
    dense = identity().nominal_bits(dim) * num_clients
    return dense, dense
