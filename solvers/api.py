"""`solve`: the one entry point memplan calls."""
from __future__ import annotations

import math
import time
from typing import Optional

from .core.method import stopping_at
from .core.problem import Problem
from .core.solution import Infeasible, Solution
from .methods.memory_bounds import memory_lower_bound
from .registry import METHODS
from .strategies.min_budget import min_budget_cached
from .strategies.remat import from_min_budget_search


def solve(problem: Problem, method: str = "auto", time_limit: Optional[float] = None,
          gap: Optional[float] = None, search_minimum: bool = True,
          search_deadline: float = math.inf) -> Solution:
    """Solve ``problem`` with ``method`` (a key of `METHODS`) within ``time_limit`` seconds.
    ``gap``: a search may stop before ``time_limit`` once its plan is proven within this share of
    optimal (`Solution.gap`; None: the strategy's own, `hierarchical.EARLY_GAP`).

    Raises `Infeasible` (with ``min_budget``) when the budget is below the
    smallest budget at which a schedule is found. Otherwise returns the
    method's solution; a method that cannot meet a feasible budget returns
    status ``over_budget`` ("auto" never does). ``search_deadline`` (a ``time.perf_counter()``
    reading) stops the minimum-budget search with the lowest peak it has found (`min_budget`).
    Without ``search_minimum`` no such search runs: a budget below `memory_lower_bound` raises at
    once, and one the solve cannot meet raises after it, each with ``searched=False`` (the bound,
    or the lowest peak the solve reached, in ``min_budget``): a caller that only needs to know by
    how much the budget is short skips a search that takes minutes on a billion-parameter graph."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    lower = memory_lower_bound(problem)
    if problem.budget < lower:
        if not search_minimum:
            raise Infeasible(problem.budget, lower, lower, searched=False)
        raise Infeasible(problem.budget, min_budget_cached(problem, search_deadline)[0], lower)
    started = time.perf_counter()
    with stopping_at(gap):
        sol = METHODS[method](problem, time_limit)
    if not sol.fits:
        if not search_minimum:
            # The lowest peak this solve reached, no search for the minimum: a caller that can
            # lower what the step needs (optimizer state moved to the host) learns by how much.
            found = min(sol.peak, sol.info.get("min_budget_found", sol.peak))
            raise Infeasible(problem.budget, max(lower, found), lower, searched=False)
        needed, schedule = min_budget_cached(problem, search_deadline)
        if problem.budget < needed:
            raise Infeasible(problem.budget, needed, lower)
        if method == "auto":
            # Auto's own fallback may have been cut short by its time limit; the full search's
            # schedule fits (a budget set to the minimum this search reported is met).
            return from_min_budget_search(problem, schedule, sol, started)
    return sol

