"""Argument checks shared by the whole package: one wording, one exception type per fault.

A value of the wrong type raises :class:`TypeError`; a value of the right type outside its
admissible range raises :class:`ValueError`. Every message names the argument (in backticks)
and the admissible values, e.g. ``"`batch_size` must be an int >= 1 or None, got 0."``.
``bool`` is refused where an int or a number is expected (``True`` is an ``int`` to Python,
but ``batch_size=True`` or ``step_size=True`` is a mistake, not a request for 1). The checks
run on Python/NumPy scalars when an object is built, never on traced values.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_bool", "check_float", "check_int", "check_positive_float",
           "check_probability"]


def _type_name(value: Any) -> str:
    return type(value).__name__


def check_int(name: str, value: Any, *, minimum: int = 0, allow_none: bool = False,
              hint: str = "") -> int | None:
    """Validate an integer argument ``value >= minimum`` (``None`` too if ``allow_none``).

    :param name: the argument's name, as the user wrote it (e.g. ``"batch_size"``).
    :param value: the value given; any :class:`numbers.Integral` but ``bool`` (NumPy integers
        included).
    :param minimum: the smallest admissible value.
    :param allow_none: whether ``None`` is admissible (it is then returned unchanged).
    :param hint: text appended to the message (e.g. ``" Use e.g. top_k(k=3)."``).
    :return: ``int(value)``, or ``None``.
    :raises TypeError: if ``value`` is not an integer (``bool`` and floats such as ``2.0``
        included).
    :raises ValueError: if ``value < minimum``.
    """
    if value is None and allow_none:
        return None
    what = f"an int >= {minimum}" + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be {what}, got {value!r} of type "
                        f"{_type_name(value)}.{hint}")
    if value < minimum:
        raise ValueError(f"`{name}` must be {what}, got {value!r}.{hint}")
    return int(value)


def check_float(name: str, value: Any, *, low: float = -math.inf, low_open: bool = False,
                high: float = math.inf, allow_none: bool = False, what: str = "",
                hint: str = "") -> float | None:
    """Validate a finite real argument in ``[low, high]`` (``(low, high]`` if ``low_open``).

    :param name: the argument's name.
    :param value: the value given: a real number (Python, NumPy or a 0-d array), not ``bool``.
    :param low: the lower bound.
    :param low_open: whether ``low`` itself is excluded.
    :param high: the upper bound (included), ``inf`` for none.
    :param allow_none: whether ``None`` is admissible (it is then returned unchanged).
    :param what: what the number is, written after the range (e.g. ``" (a probability)"``).
    :param hint: text appended to the message.
    :return: ``float(value)``, or ``None``.
    :raises TypeError: if ``value`` is not a real number.
    :raises ValueError: if it is NaN, infinite or outside the range.
    """
    if value is None and allow_none:
        return None
    none = " or None" if allow_none else ""
    if isinstance(value, bool | str | bytes):
        v = None
    else:
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = None
    if v is None:
        raise TypeError(f"`{name}` must be a number{what}{none}, got {value!r} of type "
                        f"{_type_name(value)}.{hint}")
    below = v <= low if low_open else v < low
    if not math.isfinite(v) or below or v > high:
        if math.isfinite(high):
            rng = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        else:
            rng = f"{'>' if low_open else '>='} {low:g}"
        raise ValueError(f"`{name}` must be finite and {rng}{what}{none}, got {value!r}."
                         f"{hint}")
    return v


def check_positive_float(name: str, value: Any, *, allow_none: bool = False, what: str = "",
                         hint: str = "") -> float | None:
    """Validate a finite number ``> 0`` (a step size, a scale, a timeout); see
    :func:`check_float`."""
    return check_float(name, value, low=0.0, low_open=True, allow_none=allow_none, what=what,
                       hint=hint)


def check_probability(name: str, value: Any, *, what: str = "", hint: str = "") -> float:
    """Validate a probability in ``(0, 1]`` (zero excluded: something that never happens is
    not a setting); see :func:`check_float`."""
    return check_float(name, value, low=0.0, low_open=True, high=1.0, what=what, hint=hint)


def check_bool(name: str, value: Any) -> bool:
    """Validate a flag: exactly ``True`` or ``False`` (not ``0``/``1``, not ``None``).

    :raises TypeError: otherwise.
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {value!r}.")
    return value
