"""Nonlinear mixed-effects workflow for pharmacometrics, around
:class:`numpyro_fed.saem.SAEM`:

- :mod:`~numpyro_fed.nlme.data` -- NONMEM-style datasets (``ID, TIME, DV, AMT, EVID, MDV,
  CMT, RATE, SS, II, CENS, LLOQ`` and covariates) into subject-padded arrays
  (:class:`PKDataset`);
- :mod:`~numpyro_fed.nlme.pk` -- analytic one-, two- and three-compartment models (first-order
  absorption, IV bolus, zero-order infusion, multiple doses, steady state, lag time,
  bioavailability); :mod:`~numpyro_fed.nlme.ode` -- any model as an ODE (``diffrax``);
- :mod:`~numpyro_fed.nlme.error` -- residual error models and censoring below the LLOQ (M3);
- :mod:`~numpyro_fed.nlme.model` -- an ordinary NumPyro model from a short specification
  (:class:`PKModel`, :class:`Param`);
- :mod:`~numpyro_fed.nlme.diagnostics` -- the fitted model's parameter table, individual
  estimates, shrinkage, PRED/IPRED/IWRES, NPDE, simulation, goodness-of-fit plots and VPC
  (:class:`NLMEFit`).

Every piece works on its own: a hand-written NumPyro model may call the structural functions
and the error models directly and be fitted by ``SAEM``.
"""

from numpyro_fed.nlme.data import (
    Doses,
    Observations,
    PKDataset,
    load_phenobarb,
    load_theophylline,
)
from numpyro_fed.nlme.diagnostics import NLMEFit
from numpyro_fed.nlme.error import CensoredLogNormal, CensoredNormal, ErrorModel
from numpyro_fed.nlme.model import Binding, Param, PKModel
from numpyro_fed.nlme.pk import (
    compartment_model,
    one_compartment,
    three_compartment,
    two_compartment,
)

__all__ = [
    "Binding",
    "CensoredLogNormal",
    "CensoredNormal",
    "Doses",
    "ErrorModel",
    "NLMEFit",
    "Observations",
    "PKDataset",
    "PKModel",
    "Param",
    "compartment_model",
    "load_phenobarb",
    "load_theophylline",
    "ode_model",
    "one_compartment",
    "three_compartment",
    "two_compartment",
]


def __getattr__(name):  # the ODE layer imports diffrax (about 1 s): only when asked for
    if name == "ode_model":
        from numpyro_fed.nlme.ode import ode_model

        return ode_model
    raise AttributeError(f"module 'numpyro_fed.nlme' has no attribute {name!r}")
