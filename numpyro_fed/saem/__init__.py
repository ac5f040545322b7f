"""MCMC-SAEM: maximum marginal likelihood (empirical Bayes) for NumPyro models.

The user writes one NumPyro model: hyperparameters :math:`\\theta` are ``numpyro.param`` sites
(with constraints), latent variables :math:`z` are ``sample`` sites, data are observed sites.
:class:`SAEM` maximises :math:`\\ell(\\theta) = \\log p(y\\mid\\theta) = \\log\\int p(y, z\\mid
\\theta)\\,dz` by the MCMC-SAEM recursion of Kuhn & Lavielle (2004), in the form studied by Gruffaz,
Kim, Durmus & Gardner (2024, "Stochastic approximation with biased MCMC for expectation
maximization", AISTATS; Sec. 2.2, eq. (2)).

Modules (each importing only those above it):

- :mod:`~numpyro_fed.saem.schedule` -- step sizes and phases (:class:`Schedule`);
- :mod:`~numpyro_fed.saem.model` -- model introspection, data checks, the subject layout;
- :mod:`~numpyro_fed.saem.protocols` -- the declared E-step and M-step
  protocols (what the fit loop calls);
- :mod:`~numpyro_fed.saem.estep` -- E-steps (adaptive per-subject MALA/ULA with prior
  proposals; any NumPyro kernel);
- :mod:`~numpyro_fed.saem.mstep` -- M-steps (closed-form Gaussian with full or diagonal
  covariances, SA-Newton, user sufficient statistics);
- :mod:`~numpyro_fed.saem.likelihood` -- importance sampling, Gauss--Hermite, Laplace, AIS;
- :mod:`~numpyro_fed.saem.result` -- :class:`SAEMResult`;
- :mod:`~numpyro_fed.saem.fit` -- :class:`SAEM`, its frozen program description and the
  pure fit loop.
"""

from numpyro_fed.errors import ConvergenceWarning, SingularFitWarning
from numpyro_fed.saem.fit import SAEM, SAEMState, fit_saem
from numpyro_fed.saem.likelihood import LikelihoodWarning, annealed_importance_sampling
from numpyro_fed.saem.model import log_joint_per_subject
from numpyro_fed.saem.mstep import SufficientStatistics
from numpyro_fed.saem.result import SAEMResult
from numpyro_fed.saem.schedule import Schedule

__all__ = [
    "SAEM",
    "SAEMResult",
    "SAEMState",
    "Schedule",
    "SufficientStatistics",
    "ConvergenceWarning",
    "LikelihoodWarning",
    "SingularFitWarning",
    "annealed_importance_sampling",
    "fit_saem",
    "log_joint_per_subject",
]
