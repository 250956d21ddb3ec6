"""What the registry knows about a solve method: plain data, no solver code.

Strategies choose methods by these facts rather than by hand-kept lists of
names: a portfolio is every registered method carrying its tag, in registry
order (ties between equally good plans go to the earlier one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .problem import Problem
from .solution import Solution

SolveFn = Callable[[Problem, Optional[float]], Solution]

# Portfolio tags.
FALLBACK = "fallback"  # constructive baselines: the best of them is the schedule of last resort
HINTS = "hints"  # fast remat-only baselines whose fitting schedules warm-start a MILP
RACE = "race"  # fast methods the hierarchical strategy races first, for a schedule whatever happens next
OBLIVIOUS = "oblivious"  # budget-oblivious baselines: one schedule whatever the budget, a candidate lowest peak


@dataclass(frozen=True)
class MethodInfo:
    """One solve method: ``solve(problem, time_limit) -> Solution`` and what a strategy needs to know."""

    name: str
    solve: SolveFn
    kind: str  # "baseline", "chain" (dynamic program over a chain), "exact" (MILP / CP / search), "strategy"
    host_link: bool = False  # plans transfers when the problem has a host link
    # Values to compute beyond which strategies leave it out: it raises MethodFailed there, or its
    # run time grows too fast to pay (recompute_all is quadratic).
    max_compute: Optional[int] = None
    portfolios: frozenset[str] = frozenset()
    doc: str = ""


def portfolio(methods: tuple[MethodInfo, ...], tag: str) -> tuple[MethodInfo, ...]:
    """The methods of ``methods`` tagged ``tag``, in order."""
    return tuple(m for m in methods if tag in m.portfolios)
