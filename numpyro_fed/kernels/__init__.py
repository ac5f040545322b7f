"""NumPyro MCMC kernels: ULA, MALA and the federated Langevin family."""

from numpyro_fed.errors import DivergenceError
from numpyro_fed.kernels.base import DivergenceGuard
from numpyro_fed.kernels.elf import BELF, DELF, ELF, PELF, ELFState
from numpyro_fed.kernels.federated import FederatedKernel, FedState
from numpyro_fed.kernels.langevin import MALA, ULA, FederatedLangevin, LangevinState, MALAState
from numpyro_fed.kernels.qlsd import LSD, QLSD, QLSDPlusPlus, QLSDSharp, QLSDStar

__all__ = [
    "BELF",
    "DELF",
    "ELF",
    "ELFState",
    "PELF",
    "QLSD",
    "QLSDPlusPlus",
    "QLSDSharp",
    "QLSDStar",
    "DivergenceError",
    "DivergenceGuard",
    "FedState",
    "FederatedKernel",
    "FederatedLangevin",
    "LSD",
    "LangevinState",
    "MALA",
    "MALAState",
    "ULA",
]
