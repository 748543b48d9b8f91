"""The value checks every config of the package shares (torch-free).

Each raises ``ValueError`` naming the value and the rule it broke ("k=0 must be an integer
>= 1"), so that a config's ``__post_init__`` reads as its list of rules. ``bool`` is not an
integer here: ``True`` for a size is a mistake, not 1.
"""
from __future__ import annotations

import math
from typing import Any, Iterable


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(name: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def positive_ints(**values: Any) -> None:
    """``positive_int`` for each keyword, None allowed (an unset option)."""
    for name, value in values.items():
        if value is not None:
            positive_int(name, value)


def int_at_least(name: str, value: Any, lo: int) -> None:
    if not is_int(value) or value < lo:
        raise ValueError(f"{name}={value!r} must be an integer >= {lo}")


def finite(name: str, value: Any, *, above: float | None = None, at_least: float | None = None) -> None:
    """A finite number, ``> above`` or ``>= at_least`` when given."""
    ok = is_number(value) and (above is None or value > above) and (at_least is None or value >= at_least)
    if not ok:
        bound = f" > {above:g}" if above is not None else f" >= {at_least:g}" if at_least is not None else ""
        raise ValueError(f"{name}={value!r} must be a finite number{bound}")


def one_of(name: str, value: Any, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {allowed}")


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
