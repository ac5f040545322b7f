"""NumPyro MCMC kernels: ULA, MALA and the federated Langevin family."""

from numpyro_fed.kernels.base import DivergenceError
from numpyro_fed.kernels.elf import BELF, DELF, ELF, PELF, ELFState
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
    "BELF",
    "DELF",
    "ELF",
    "ELFState",
    "PELF",
    "DivergenceError",
    "FedState",
    "FederatedKernel",
    "FederatedLangevin",
    "LangevinState",
    "MALA",
    "MALAState",
    "ULA",
]
