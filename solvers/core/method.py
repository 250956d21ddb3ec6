"""What the registry knows about a solve method: plain data, no solver code.

Strategies choose methods by these facts rather than by hand-kept lists of
names: a portfolio is every registered method carrying its tag, in registry
order (ties between equally good plans go to the earlier one).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

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


# How close to a proven lower bound a plan must be for a strategy to stop searching before its
# time limit, as a share of the plan's step time (`Solution.gap`). Set per call by
# `solvers.solve`'s ``gap`` (`stopping_at`); None: each strategy's own default.
_STOP_GAP: ContextVar[Optional[float]] = ContextVar("stop_gap", default=None)


@contextmanager
def stopping_at(gap: Optional[float]) -> Iterator[None]:
    """Strategies run inside stop once their plan is within ``gap`` of a proven bound (None:
    their own default)."""
    token = _STOP_GAP.set(gap)
    try:
        yield
    finally:
        _STOP_GAP.reset(token)


def stop_gap(default: float) -> float:
    """The gap at which a strategy stops: the one `stopping_at` set, else ``default``."""
    gap = _STOP_GAP.get()
    return default if gap is None else gap


def within_gap(step_time: float, bound: Optional[float], gap: float) -> bool:
    """Whether a plan of ``step_time`` is within ``gap`` of ``bound`` (``Solution.gap`` <= ``gap``)."""
    return bound is not None and step_time * (1 - gap) <= bound
