"""What a solver returns, and the one function that builds it.

Solvers never fill ``cost`` or ``peak`` themselves: `finish` replays the
schedule through the simulator, so a solver's own beliefs about memory or
cost cannot leak into its result.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .problem import Problem
from .schedule import Schedule, simulate

# Status values.
OPTIMAL = "optimal"  # proven optimal within the method's search space
FEASIBLE = "feasible"  # fits the budget, optimality not proven
OVER_BUDGET = "over_budget"  # the method's schedule does not fit the budget

# Relative slack when comparing float costs with bounds (MIP tolerances, cost scaling).
BOUND_TOLERANCE = 1e-6


class Infeasible(Exception):
    """No schedule was found within the budget.

    ``min_budget`` is the smallest budget at which a schedule was found (exact
    for small graphs, from a constructive search otherwise, always verified by
    the simulator); ``memory_lower_bound`` is a trivial bound below which no
    schedule can exist."""

    def __init__(self, budget: int, min_budget: int, memory_lower_bound: int, searched: bool = True) -> None:
        super().__init__(f"budget {budget} is below the minimum {min_budget} at which a schedule was found "
                         f"(trivial lower bound {memory_lower_bound})" if searched else
                         f"budget {budget} is below the trivial lower bound {memory_lower_bound}"
                         if min_budget <= memory_lower_bound else
                         f"budget {budget} is below the lowest peak the solve reached, {min_budget} (no minimum "
                         f"searched; trivial lower bound {memory_lower_bound})")
        self.budget = budget
        self.min_budget = min_budget
        self.memory_lower_bound = memory_lower_bound
        # False: no search ran (`solve`): ``min_budget`` is the lower bound, or the lowest peak a solve reached
        self.searched = searched


class MethodFailed(Exception):
    """A method could not produce a schedule at all (too large, or not applicable)."""


@dataclass
class Solution:
    schedule: Schedule
    cost: float
    peak: int
    lower_bound: Optional[float]  # proven bound on the step time of every schedule (a method's narrower bound: info)
    status: str
    solve_time: float
    method: str
    info: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0  # step time from the simulator: cost plus waits for host copies (== cost without them)

    @property
    def fits(self) -> bool:
        return self.status != OVER_BUDGET

    @property
    def objective(self) -> float:
        """What the methods minimise: step time, which is the compute cost unless host copies make compute wait."""
        return max(self.time, self.cost)

    @property
    def gap(self) -> Optional[float]:
        """Relative gap (objective - lower_bound) / objective, or None without a bound."""
        if self.lower_bound is None:
            return None
        if self.objective == 0:
            return 0.0
        return (self.objective - self.lower_bound) / self.objective


def finish(problem: Problem, schedule: Schedule, method: str, started: float, *,
           lower_bound: Optional[float] = None, status: Optional[str] = None,
           info: Optional[dict[str, Any]] = None) -> Solution:
    """Simulate ``schedule`` and wrap it as a Solution.

    ``started`` is a ``time.perf_counter()`` reading taken when the method
    began. The status becomes ``over_budget`` when the schedule does not fit;
    otherwise ``status`` if given, else ``optimal`` when the cost meets the
    lower bound and ``feasible`` when it does not."""
    result = simulate(problem, schedule)
    cost = result.cost
    if lower_bound is not None:
        slack = BOUND_TOLERANCE * max(1.0, abs(cost))
        if lower_bound > cost + slack:
            raise AssertionError(f"{method}: lower bound {lower_bound} exceeds the cost {cost} of its own schedule")
        lower_bound = min(float(lower_bound), cost)
        if not math.isfinite(lower_bound):
            lower_bound = None
    if not result.fits:
        status = OVER_BUDGET
    elif status is None:
        step_time = max(result.time, cost)  # waits for host copies count against optimality too
        optimal = lower_bound is not None and step_time <= lower_bound + BOUND_TOLERANCE * max(1.0, abs(step_time))
        status = OPTIMAL if optimal else FEASIBLE
    return Solution(schedule=schedule, cost=cost, peak=result.peak, lower_bound=lower_bound, status=status,
                    solve_time=time.perf_counter() - started, method=method, info=dict(info or {}),
                    time=result.time)
