"""The constructive baselines, as registry entries, and the best of them.

`best_baseline` is used by Checkmate and Moccasin when their solver returns no
schedule and as their warm start. "Best" = cheapest among those that fit the budget; when none
fits, the one with the smallest peak.
"""
from __future__ import annotations

from ..core.method import (
    FALLBACK,
    HINTS,
    OBLIVIOUS,
    RACE,
    MethodInfo,
    SolveFn,
    portfolio,
)
from ..core.memory import memory_of
from ..core.problem import Problem
from ..core.solution import MethodFailed, Solution
from .greedy import solve_greedy
from .recompute_all import solve_recompute_all
from .select import solve_select
from .sqrt_n import solve_sqrt_n
from .store_all import solve_store_all

BASELINE_METHODS: tuple[MethodInfo, ...] = (
    MethodInfo("store_all", solve_store_all, "baseline", portfolios=frozenset({FALLBACK, HINTS, RACE}),
               doc="compute everything once, free after the last read"),
    MethodInfo("greedy", solve_greedy, "baseline", portfolios=frozenset({FALLBACK, HINTS, RACE}),
               doc="DTR-style eviction: drop the resident value with the best bytes x staleness / cost"),
    MethodInfo("select", solve_select, "baseline", portfolios=frozenset({FALLBACK, HINTS, RACE}),
               doc="drop whole storages between clusters of uses, recompute on demand"),
    MethodInfo("sqrt_n", solve_sqrt_n, "baseline", portfolios=frozenset({FALLBACK, OBLIVIOUS}),
               doc="Chen et al.'s sqrt(n) segment checkpointing (budget-oblivious)"),
    # Quadratic: 30 s on gpt12's 2108 values (where rotor's peak is lower anyway).
    MethodInfo("recompute_all", solve_recompute_all, "baseline", max_compute=500,
               portfolios=frozenset({FALLBACK, OBLIVIOUS}),
               doc="keep only segment boundaries, recompute the rest (budget-oblivious)"),
)
BASELINES: dict[str, SolveFn] = {m.name: m.solve for m in BASELINE_METHODS}


def best_baseline(problem: Problem) -> Solution:
    """The best schedule of the methods tagged `FALLBACK`."""
    solutions: list[Solution] = []
    for method in portfolio(BASELINE_METHODS, FALLBACK):
        name, solve = method.name, method.solve
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


def with_budget_fraction(problem: Problem, fraction: float) -> Problem:
    """``problem`` with its budget at its sources' memory plus ``fraction`` of store-all's activation
    memory (0: the sources alone, 1: store-all's peak)."""
    peak = solve_store_all(problem, None).peak
    base = memory_of(problem, [])
    return problem.with_budget(int(base + fraction * (peak - base)))
