"""Pure algorithm pieces shared by the kernels and by MCMC-SAEM (no NumPyro kernel state)."""

from numpyro_fed.algorithms.langevin import langevin_move, mala_log_ratio

__all__ = ["langevin_move", "mala_log_ratio"]
