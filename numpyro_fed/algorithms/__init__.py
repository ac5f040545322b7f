"""Pure algorithm pieces shared by the kernels and by MCMC-SAEM (no NumPyro kernel state)."""

from numpyro_fed.algorithms.langevin import (
    Preconditioner,
    block_preconditioner,
    langevin_move,
    langevin_noise,
    langevin_proposal,
    mala_log_ratio,
    mala_sq_residuals,
)

__all__ = [
    "Preconditioner",
    "block_preconditioner",
    "langevin_move",
    "langevin_noise",
    "langevin_proposal",
    "mala_log_ratio",
    "mala_sq_residuals",
]
