"""The numbers an agent reports (its hardware at join, its load in heartbeats, its link
measurements), checked before any is stored: finite, within range, or ``InvalidReport``."""

from __future__ import annotations

import math
from typing import Literal, overload

from marketplace.nodes.errors import InvalidReport


@overload
def number(
    report: dict, key: str, *, minimum: float = ..., maximum: float = ..., required: Literal[True] = ...
) -> float: ...
@overload
def number(report: dict, key: str, *, minimum: float = ..., maximum: float = ..., required: bool) -> float | None: ...
def number(
    report: dict, key: str, *, minimum: float = 0.0, maximum: float = 1e15, required: bool = True
) -> float | None:
    """``report[key]`` as a float from ``minimum`` to ``maximum``; None when it is absent and not
    ``required``; ``InvalidReport`` naming the key otherwise."""
    value = report.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < minimum:
        raise InvalidReport(f"{key} must be a number >= {minimum}, got {value!r}")
    if value > maximum:
        raise InvalidReport(f"{key} must be at most {maximum:g}, got {value!r}")
    return float(value)
