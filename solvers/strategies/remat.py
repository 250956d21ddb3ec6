"""Rematerialization without a host link: the hierarchical strategy, then the minimum-budget search.

`solve_remat` runs method "hierarchical" (coarsening, the drop-set ILP,
rotor's chain program and the baselines; the exhaustive search or Checkmate
on graphs small enough) within ``time_limit`` (`AUTO_TIME_LIMIT` seconds
when none is given); its ``lower_bound`` is valid for every schedule. When
that finds nothing under the budget, the schedule of the minimum-budget
search (`min_budget.min_budget`) is returned if it fits. Its solutions are
labelled "auto" (the strategy the user asked for), with ``info["chosen"]``
naming the method whose schedule it is.
"""
from __future__ import annotations

import time
from typing import Optional

from ..core.problem import Problem
from ..core.schedule import Schedule
from ..core.solution import Solution, finish
from .hierarchical import solve_hierarchical
from .min_budget import min_budget_cached

AUTO_TIME_LIMIT = 30.0


def relabel(sol: Solution, started: float) -> Solution:
    """``sol`` as auto's answer: method "auto", the method that made it in ``info["chosen"]``."""
    sol.info = {**sol.info, "chosen": sol.info.get("chosen", sol.method)}
    sol.method = "auto"
    sol.solve_time = time.perf_counter() - started
    return sol


def from_min_budget_search(problem: Problem, schedule: Schedule, failed: Solution, started: float) -> Solution:
    """Auto's answer when its planner found nothing under the budget but the minimum-budget
    search's schedule fits; the planner's bound (valid for every schedule) is kept."""
    return finish(problem, schedule, "auto", started, lower_bound=failed.lower_bound,
                  info={**failed.info, "chosen": "min_budget_search"})


def solve_remat(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    """The fastest fitting rematerialization plan found for ``problem`` (its host link, if any, unused)."""
    started = time.perf_counter()
    limit = AUTO_TIME_LIMIT if time_limit is None else time_limit
    sol = solve_hierarchical(problem, limit)
    if sol.fits:
        return relabel(sol, started)
    # The search goes on past the limit only by its first steps (rotor, the baselines).
    budget, schedule = min_budget_cached(problem, started + limit)
    if budget <= problem.budget:
        return from_min_budget_search(problem, schedule, sol, started)
    sol.info["min_budget_found"] = budget  # (its lowest peak, perhaps below the solution's)
    return relabel(sol, started)
