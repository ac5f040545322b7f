"""Bayesian logistic regression models (ordinary NumPyro models, no federated code)."""

from __future__ import annotations

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist


def logistic_regression(X, y=None, prior_scale: float = 1.0):
    """Binary logistic regression with an isotropic Gaussian prior on the weights.

    :param X: design matrix ``(N, d)`` (include a column of ones for an intercept).
    :param y: binary labels ``(N,)`` or ``None`` for prediction.
    :param prior_scale: prior standard deviation of each weight.
    """
    d = X.shape[-1]
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([d]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def multinomial_logistic_regression(X, y=None, num_classes: int = 10, prior_scale: float = 1.0):
    """Multinomial (softmax) logistic regression with weights ``(d, K)`` and biases ``(K,)``.

    The parameter dimension is ``(d + 1) K`` (650 for 8x8 digits with 10 classes, close to
    the FEMNIST setting of Vono et al. 2022).
    """
    d = X.shape[-1]
    W = numpyro.sample("W", dist.Normal(0.0, prior_scale).expand([d, num_classes]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale).expand([num_classes]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=jnp.dot(X, W) + b), obs=y)
