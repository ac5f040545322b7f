"""numpyro_fed: federated, communication-compressed Langevin samplers for NumPyro.

An ordinary NumPyro model + a :class:`ClientPartition` of its data -> a NumPyro
``MCMCKernel`` -> :class:`numpyro.infer.MCMC` -> ArviZ ``InferenceData``.
"""

from numpyro_fed import compressors, distributed
from numpyro_fed.bits import BitCounter, counter_value
from numpyro_fed.cached_mcmc import CachedMCMC
from numpyro_fed.compilation import enable_compilation_cache
from numpyro_fed.distributed import shard_kernel, shard_partition
from numpyro_fed.errors import (
    ConvergenceWarning,
    DivergenceError,
    LikelihoodWarning,
    SingularFitWarning,
)
from numpyro_fed.infdata import communication_summary, to_inference_data
from numpyro_fed.kernels import (
    BELF,
    DELF,
    ELF,
    LSD,
    MALA,
    PELF,
    QLSD,
    ULA,
    FederatedKernel,
    FederatedLangevin,
    FedState,
    QLSDPlusPlus,
    QLSDSharp,
    QLSDStar,
)
from numpyro_fed.partition import ClientPartition
from numpyro_fed.potential import FederatedPotential
from numpyro_fed.saem import (
    SAEM,
    SAEMResult,
    Schedule,
    SufficientStatistics,
)

__version__ = "0.1.0"

__all__ = [
    "BELF",
    "BitCounter",
    "CachedMCMC",
    "DELF",
    "ELF",
    "LSD",
    "PELF",
    "QLSD",
    "QLSDPlusPlus",
    "QLSDSharp",
    "QLSDStar",
    "SAEM",
    "SAEMResult",
    "Schedule",
    "SufficientStatistics",
    "ClientPartition",
    "ConvergenceWarning",
    "SingularFitWarning",
    "LikelihoodWarning",
    "DivergenceError",
    "FedState",
    "FederatedKernel",
    "FederatedLangevin",
    "FederatedPotential",
    "MALA",
    "ULA",
    "communication_summary",
    "compressors",
    "counter_value",
    "distributed",
    "enable_compilation_cache",
    "shard_kernel",
    "shard_partition",
    "to_inference_data",
]
