"""Memory bounds of a problem: what every schedule must hold, and what store-all holds.

`memory_lower_bound` is what any schedule must hold at some instant:
computing v needs v and its inputs resident (plus the sources), and at the
end the sinks are resident. `store_all_peak` is the other end: the budget
above which nothing needs to be recomputed or offloaded.
"""
from __future__ import annotations

from ..core.memory import least_memory_holding
from ..core.problem import Problem
from .store_all import solve_store_all


def memory_lower_bound(problem: Problem) -> int:
    """The least memory every schedule holds at some instant (see the module docstring); it does
    not depend on the budget, so it is computed once per graph (`Problem.budget_free_cache`):
    `solvers.solve` asks for it on every call, a tenth of a second on thousands of values."""
    cache = problem.budget_free_cache
    if "memory_lower_bound" not in cache:
        bound = least_memory_holding(problem, problem.sinks)
        for v in problem.non_sources:
            bound = max(bound, least_memory_holding(problem, problem.preds[v] + (v,)))
        cache["memory_lower_bound"] = bound
    return cache["memory_lower_bound"]


def store_all_peak(problem: Problem) -> int:
    """Peak of computing every value once and keeping it to its last use: the budget above
    which nothing needs to be recomputed or offloaded."""
    return solve_store_all(problem.with_budget(2**62), None).peak
