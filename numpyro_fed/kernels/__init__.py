"""NumPyro MCMC kernels: ULA, MALA and the federated Langevin family."""

from numpyro_fed.kernels.base import DivergenceError
from numpyro_fed.kernels.langevin import (
    MALA,
    ULA,
    FederatedKernel,
    FederatedLangevin,
    FedState,
    LangevinState,
    MALAState,
)

__all__ = [
    "DivergenceError",
    "FedState",
    "FederatedKernel",
    "FederatedLangevin",
    "LangevinState",
    "MALA",
    "MALAState",
    "ULA",
]
