"""One vocabulary for the variants of the federated algorithms.

The in-process kernels (``QLSD(..., variant=...)``, ``ELF(..., variant=...)``) and the Flower
deployment (:class:`~numpyro_fed.flower.protocol.FlowerSpec`'s ``algorithm`` and ``variant``)
read the same table, :data:`VARIANTS`: each variant has a canonical code (what
``kernel.variant`` holds), the name of its algorithm in a deployment, its display name (in
messages and errors) and the spellings accepted for it (matched case-insensitively, surrounding
whitespace ignored).

* QLSD (Vono et al., 2022, "QLSD: Quantised Langevin stochastic dynamics for Bayesian
  federated learning", AISTATS): ``"#"`` (Alg. 1), ``"*"`` (Alg. 2 with the control variate
  at :math:`\\theta^\\star`), ``"++"`` (Alg. 2 with a refreshed control point);
* ELF (Karagulyan and Richtárik, 2023, "ELF: Federated Langevin algorithms with primal, dual
  and bidirectional compression", arXiv:2303.04622): ``"D"`` (Alg. 1, EF21 on the uplink),
  ``"P"`` (Alg. 2, EF21-P on the downlink), ``"B"`` (Alg. 3, both).

Adding a variant means adding a row here (and its estimator / its server step).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "VARIANTS",
    "Variant",
    "canonical_variant",
    "deployment_algorithms",
    "spellings",
    "variant_info",
    "variant_of_algorithm",
]


class Variant(NamedTuple):
    """One variant of a federated algorithm.

    - **family** -- the kernel family, ``"qlsd"`` or ``"elf"``.
    - **code** -- the canonical code, the value of ``kernel.variant``: ``"#"``, ``"*"``,
      ``"++"``, ``"D"``, ``"P"``, ``"B"``.
    - **algorithm** -- its ``FlowerSpec.algorithm``: ``"qlsd"`` (the QLSD variants share it and
      are told apart by ``FlowerSpec.variant``), ``"delf"``, ``"pelf"``, ``"belf"``.
    - **display** -- the name in messages: ``"QLSD#"``, ..., ``"D-ELF"``, ...
    - **spellings** -- the other accepted spellings (the code and the display name are
      always accepted).
    - **compress_up** / **compress_down** -- whether the client-to-server messages / the
      server-to-client broadcast are compressed.
    - **description** -- what it is, with its place in its paper.
    """

    family: str
    code: str
    algorithm: str
    display: str
    spellings: tuple[str, ...]
    compress_up: bool
    compress_down: bool
    description: str


#: Every variant of the federated algorithms, in display order.
VARIANTS: tuple[Variant, ...] = (
    Variant("qlsd", "#", "qlsd", "QLSD#", ("sharp",), True, False,
            "QLSD#: client oracle H_i = minibatch gradient (QLSD Alg. 1)"),
    Variant("qlsd", "*", "qlsd", "QLSD*", ("star",), True, False,
            "QLSD*: control variate at theta* (QLSD Alg. 2)"),
    Variant("qlsd", "++", "qlsd", "QLSD++", ("plusplus",), True, False,
            "QLSD++: control variate at a refreshed point zeta (QLSD Alg. 2)"),
    Variant("elf", "D", "delf", "D-ELF", ("delf", "dual"), True, False,
            "dual: EF21 on the uplink (Alg. 1)"),
    Variant("elf", "P", "pelf", "P-ELF", ("pelf", "primal"), False, True,
            "primal: EF21-P on the downlink (Alg. 2)"),
    Variant("elf", "B", "belf", "B-ELF", ("belf", "bidirectional"), True, True,
            "bidirectional: EF21-P down + EF21 up (Alg. 3)"),
)

_FAMILY_NAMES = {"qlsd": "QLSD", "elf": "ELF"}


def spellings(family: str) -> dict[str, str]:
    """Every accepted spelling (lower case) of the variants of ``family``, mapped to its
    canonical code."""
    table: dict[str, str] = {}
    for v in VARIANTS:
        if v.family == family:
            for s in (v.code, v.display, *v.spellings):
                table[s.lower()] = v.code
    return table


def canonical_variant(family: str, variant: object, arg: str = "variant") -> str:
    """The canonical code of ``variant`` among the variants of ``family``.

    :param family: ``"qlsd"`` or ``"elf"``.
    :param variant: any accepted spelling (``"#"``, ``"sharp"``, ``"QLSD#"``; ``"d"``,
        ``"D-ELF"``, ``"dual"``, ...).
    :param arg: the argument's name, for the error message.
    :raises ValueError: naming ``arg`` and listing the accepted spellings.
    """
    table = spellings(family)
    key = variant.strip().lower() if isinstance(variant, str) else None
    if key not in table:
        options = "; ".join(
            f"{', '.join(repr(s) for s in (v.code, *v.spellings, v.display))}: {v.description}"
            for v in VARIANTS if v.family == family
        )
        raise ValueError(
            f"Unknown {_FAMILY_NAMES[family]} `{arg}`={variant!r}; use one of: {options}."
        )
    return table[key]


def variant_info(family: str, code: str) -> Variant:
    """The :class:`Variant` of canonical ``code`` in ``family``."""
    return next(v for v in VARIANTS if v.family == family and v.code == code)


def deployment_algorithms() -> tuple[str, ...]:
    """The ``FlowerSpec.algorithm`` names, each once, in table order."""
    return tuple(dict.fromkeys(v.algorithm for v in VARIANTS))


def variant_of_algorithm(algorithm: str, variant: str) -> Variant:
    """The :class:`Variant` a deployment runs: ``algorithm`` (``"qlsd"``, ``"delf"``, ...)
    and, for ``"qlsd"``, its ``variant`` (any accepted spelling)."""
    rows = [v for v in VARIANTS if v.algorithm == algorithm]
    if len(rows) == 1:
        return rows[0]
    return variant_info(rows[0].family, canonical_variant(rows[0].family, variant))
