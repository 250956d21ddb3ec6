"""Budgets as users write them: bytes (``16GB``, ``16GiB``, an int) or a share of the eager peak (``50%``)."""
from __future__ import annotations

from typing import Any

from memplan.core.units import parse_bytes


def parse_budget(budget: int | str) -> int:
    """Bytes from ``16GB``, ``16GiB``, ``800MB``, ``1.5 TB`` or an int."""
    try:
        return parse_bytes(budget)
    except ValueError:
        raise ValueError(_budget_help(budget)) from None


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
