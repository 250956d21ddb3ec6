"""Run the fast constructive baselines and keep the best schedule.

Used by "auto" for large graphs and by Checkmate when its solver returns no
schedule. "Best" = cheapest among those that fit the budget; when none
fits, the one with the smallest peak.
"""
from __future__ import annotations

from typing import Callable, Optional

from .greedy import solve_greedy
from .problem import Problem
from .recompute_all import solve_recompute_all
from .select import solve_select
from .solution import MethodFailed, Solution
from .sqrt_n import solve_sqrt_n
from .store_all import solve_store_all

CONSTRUCTIVE: dict[str, Callable[[Problem, Optional[float]], Solution]] = {
    "store_all": solve_store_all,
    "greedy": solve_greedy,
    "select": solve_select,
    "sqrt_n": solve_sqrt_n,
    "recompute_all": solve_recompute_all,
}


def best_constructive(problem: Problem) -> Solution:
    solutions: list[Solution] = []
    for name, solve in CONSTRUCTIVE.items():
        try:
            sol = solve(problem, None)
        except MethodFailed:
            continue
        solutions.append(sol)
        if name == "store_all" and sol.fits:
            return sol  # nothing is cheaper than computing everything once
    fitting = [s for s in solutions if s.fits]
    if fitting:
        return min(fitting, key=lambda s: (s.cost, s.peak))
    return min(solutions, key=lambda s: (s.peak, s.cost))
