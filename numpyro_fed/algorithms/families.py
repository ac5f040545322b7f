"""The package's algorithm families by name: how a deployment's flat settings
(:class:`~numpyro_fed.flower.spec.FlowerSpec`) become a
:class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm` and back.

A deployment names its algorithm either by the variant table's ``algorithm`` column
(``"qlsd"``, ``"delf"``, ``"pelf"``, ``"belf"``: :data:`~numpyro_fed.algorithms.variants.VARIANTS`),
whose family here reads the spec's fields, or by an import reference ``"module:factory"``
with the factory's options (an algorithm defined outside the package), see
:func:`~numpyro_fed.algorithms.federated.from_description`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from numpyro_fed.algorithms import elf, qlsd
from numpyro_fed.algorithms.federated import FederatedAlgorithm, from_description
from numpyro_fed.algorithms.variants import VARIANTS, deployment_algorithms

__all__ = ["FAMILIES", "is_reference", "algorithm_from_fields", "fields_of"]

#: family -> (its constructor's module, ``from_fields``, ``to_fields``)
FAMILIES = {
    "qlsd": (qlsd.from_fields, qlsd.to_fields, "numpyro_fed.algorithms.qlsd:algorithm"),
    "elf": (elf.from_fields, elf.to_fields, "numpyro_fed.algorithms.elf:algorithm"),
}


def is_reference(name: str) -> bool:
    """Whether an ``algorithm`` setting is an import reference ``"module:factory"``."""
    return ":" in str(name)


def algorithm_from_fields(fields: Mapping[str, Any],
                          options: Mapping[str, Any] | None = None) -> FederatedAlgorithm:
    """The algorithm a deployment's settings describe: ``fields["algorithm"]`` a name of the
    variant table (the family reads the other fields) or an import reference, called with
    ``options`` (and the spec's ``step_size``, ``batch_size``, ``participation``).

    :raises ValueError: naming `algorithm` for an unknown name.
    """
    name = fields["algorithm"]
    if is_reference(name):
        opts = dict(options or {})
        return from_description({"factory": name, "options": opts})
    rows = [v for v in VARIANTS if v.algorithm == name]
    if not rows:
        raise ValueError(
            f"`algorithm` must be one of {deployment_algorithms()} (QLSD#/QLSD*/QLSD++, D-ELF, "
            f"P-ELF or B-ELF in the Flower deployment) or an import reference "
            f"'package.module:factory' of a FederatedAlgorithm, got {name!r}.")
    return FAMILIES[rows[0].family][0](fields)


def fields_of(description: Mapping[str, Any]) -> dict[str, Any]:
    """A deployment's settings for an algorithm's description: the family's flat fields, or
    ``{"algorithm": factory, "options": JSON}`` for an algorithm built elsewhere."""
    import json

    for _, to_fields, factory in FAMILIES.values():
        if description["factory"] == factory:
            return to_fields(description["options"])
    return {"algorithm": description["factory"],
            "options": json.dumps(description["options"], sort_keys=True)}
