"""Transforms of the individual parameters (natural scale <-> the scale of the random
effects), shared by :mod:`numpyro_fed.nlme.model` and :mod:`numpyro_fed.nlme.diagnostics`.

Below both of them, so that neither imports the other to reach it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["TRANSFORMS"]

#: ``{name: (forward, inverse)}``: forward maps the transformed scale to the natural scale.
TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    "log": (jnp.exp, jnp.log),
    "none": (lambda x: x, lambda x: x),
    "logit": (jax.nn.sigmoid, lambda p: jnp.log(p) - jnp.log1p(-p)),
}
