"""Budgets as users write them: bytes (``16GB``, ``16GiB``, an int) or a share of the eager peak (``50%``)."""
from __future__ import annotations

import re
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


def parse_budget(budget: int | str) -> int:
    """Bytes from ``16GB``, ``16GiB``, ``800MB``, ``1.5 TB`` or an int."""
    if isinstance(budget, bool):
        raise ValueError(_budget_help(budget))
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(_budget_help(budget))
        return budget
    if isinstance(budget, str):
        m = _BUDGET_RE.match(budget)
        if m:
            value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
            if value >= 1:
                return int(value)
    raise ValueError(_budget_help(budget))


def budget_fraction(budget: Any) -> float | None:
    """The share of the eager peak a budget such as ``"50%"`` asks for (0.5), None for an absolute budget."""
    if not isinstance(budget, str) or not budget.strip().endswith("%"):
        return None
    try:
        percent = float(budget.strip()[:-1])
    except ValueError:
        raise ValueError(_budget_help(budget)) from None
    if not percent > 0:
        raise ValueError(f"cannot read budget {budget!r}: a percentage of the eager peak must be above 0%")
    return percent / 100


def _budget_help(budget: Any) -> str:
    return (
        f"cannot read budget {budget!r}: give a positive int of bytes or a string like "
        "'16GB', '16GiB', '800MB', '512 kB', '1.5 TB' (units B, kB, MB, GB, TB decimal; KiB, MiB, GiB, TiB binary), "
        "or a share of the eager step's peak such as '50%'"
    )


def share_of_peak(fraction: float, eager_peak: int) -> int:
    """The bytes a share such as 0.5 (from ``"50%"``) of the eager step's peak stands for (at least 1)."""
    return max(1, int(fraction * eager_peak))
