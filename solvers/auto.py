"""Method "auto": pick a method by graph size, always return a schedule that fits.

* up to `EXACT_NODES` values to compute: the exhaustive search (exact, any order);
* up to `CHECKMATE_NODES`: the Checkmate MILP (time limit `AUTO_TIME_LIMIT`
  seconds when none is given);
* otherwise, or when the above does not fit: the best constructive baseline,
  then the schedule found by the minimum-budget search.

When even that does not fit, the solution is returned as ``over_budget`` and
`solvers.solve` raises `Infeasible`.

A problem with a host link goes to method "offload", which runs this
strategy on the same graph without the link at several budgets and pages
values out to host memory on top.
"""
from __future__ import annotations

import time
from typing import Optional

from .bounds import min_budget_cached
from .checkmate import solve_checkmate_default
from .exhaustive import solve_exhaustive
from .portfolio import best_constructive
from .problem import Problem
from .solution import Solution, finish

EXACT_NODES = 8
CHECKMATE_NODES = 60
AUTO_TIME_LIMIT = 60.0


def _relabel(sol: Solution, started: float) -> Solution:
    sol.info = {**sol.info, "chosen": sol.method}
    sol.method = "auto"
    sol.solve_time = time.perf_counter() - started
    return sol


def solve_auto(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    if problem.has_host:
        from .offload import solve_offload

        return _relabel(solve_offload(problem, time_limit), started)
    m = problem.n_compute
    if m <= EXACT_NODES:
        sol = solve_exhaustive(problem, time_limit)
        if sol.fits:
            return _relabel(sol, started)
    elif m <= CHECKMATE_NODES:
        sol = solve_checkmate_default(problem, AUTO_TIME_LIMIT if time_limit is None else time_limit)
        if sol.fits:
            return _relabel(sol, started)
    sol = best_constructive(problem)
    if sol.fits:
        return _relabel(sol, started)
    budget, schedule = min_budget_cached(problem)
    if budget <= problem.budget:
        return finish(problem, schedule, "auto", started, lower_bound=problem.total_cost(),
                      info={"chosen": "min_budget_search"})
    return _relabel(sol, started)
