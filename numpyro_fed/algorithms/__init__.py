"""Pure algorithm pieces shared by the kernels, the Flower deployment and MCMC-SAEM (no NumPyro
kernel state, no transport).

* :mod:`~numpyro_fed.algorithms.langevin` -- the one Langevin move and MALA acceptance ratio;
* :mod:`~numpyro_fed.algorithms.estimators` -- the client gradient estimators :math:`H_i`
  (QLSD#'s plain oracle, QLSD*'s fixed control variate, QLSD++'s SVRG control point);
* :mod:`~numpyro_fed.algorithms.qlsd` and :mod:`~numpyro_fed.algorithms.elf` -- the client
  and server halves of one QLSD / ELF round;
* :mod:`~numpyro_fed.algorithms.theta_star` -- QLSD*'s search for :math:`\\theta^\\star`;
* :mod:`~numpyro_fed.algorithms.oracles` -- one client's gradient oracles on its own rows;
* :mod:`~numpyro_fed.algorithms.participation` -- who takes part in a round, and the weights;
* :mod:`~numpyro_fed.algorithms.variants` -- the table of variants and their spellings.
"""

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
