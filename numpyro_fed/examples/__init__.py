"""Ready NumPyro models and offline dataset loaders used by the examples and tests."""

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
