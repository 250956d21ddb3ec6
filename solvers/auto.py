"""Method "auto": the default planner; always returns a schedule that fits when one is known.

* a problem with a host link goes to method "offload", which runs this
  strategy on the same graph without the link at several budgets and pages
  values out to host memory on top (graphs of up to `joint.MAX_COMPUTE`
  values to compute: method "joint", which also solves its MILP over keep /
  recompute / offload and keeps the faster plan);
* otherwise method "hierarchical" (coarsening, the drop-set ILP, rotor's
  chain program and the baselines; the exhaustive search or Checkmate on
  graphs small enough), within ``time_limit`` (`AUTO_TIME_LIMIT` seconds when
  none is given); its ``lower_bound`` is valid for every schedule;
* when that finds nothing under the budget, the schedule of the
  minimum-budget search (`bounds.min_budget`) if it fits.

When even that does not fit, the solution is returned as ``over_budget`` and
`solvers.solve` raises `Infeasible`.
"""
from __future__ import annotations

import time
from typing import Optional

from .bounds import min_budget_cached
from .hierarchical import solve_hierarchical
from .problem import Problem
from .schedule import Schedule
from .solution import Solution, finish

AUTO_TIME_LIMIT = 30.0


def _relabel(sol: Solution, started: float) -> Solution:
    sol.info = {**sol.info, "chosen": sol.info.get("chosen", sol.method)}
    sol.method = "auto"
    sol.solve_time = time.perf_counter() - started
    return sol


def from_min_budget_search(problem: Problem, schedule: Schedule, failed: Solution, started: float) -> Solution:
    """Auto's answer when its planner found nothing under the budget but the minimum-budget
    search's schedule fits; the planner's bound (valid for every schedule) is kept."""
    return finish(problem, schedule, "auto", started, lower_bound=failed.lower_bound,
                  info={**failed.info, "chosen": "min_budget_search"})


def solve_auto(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    if problem.has_host:
        # Both call back into auto (without the host link) for their remat plans.
        from .joint import MAX_COMPUTE, solve_joint
        from .offload import solve_offload

        method = solve_joint if problem.n_compute <= MAX_COMPUTE else solve_offload
        return _relabel(method(problem, time_limit), started)
    limit = AUTO_TIME_LIMIT if time_limit is None else time_limit
    sol = solve_hierarchical(problem, limit)
    if sol.fits:
        return _relabel(sol, started)
    # The search goes on past the limit only by its first steps (rotor, the baselines).
    budget, schedule = min_budget_cached(problem, started + limit)
    if budget <= problem.budget:
        return from_min_budget_search(problem, schedule, sol, started)
    return _relabel(sol, started)
