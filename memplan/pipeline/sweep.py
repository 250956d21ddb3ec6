"""One analysed step solved at many budgets: the smallest budget the solvers meet, and a sweep of
budgets (what the CLI's ``sweep`` and the budget curve plot show)."""
from __future__ import annotations
from collections.abc import Iterable
from dataclasses import dataclass
import solvers
from memplan.planning.analysis import Analysis
from memplan.pipeline.plan import InfeasibleBudgetError, Plan, problem_for, solve_plan


# --------------------------------------------------------------------------- #
# Budget sweep
# --------------------------------------------------------------------------- #


@dataclass
class SweepPoint:
    """One budget of a sweep; ``plan`` is None when the budget is infeasible."""

    label: str  # how the budget was asked for ("80%", "min", "2GB")
    budget: int
    plan: Plan | None
    min_budget: int | None = None  # set when infeasible

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    def as_dict(self) -> dict:
        p = self.plan
        return {
            "label": self.label,
            "budget": self.budget,
            "feasible": p is not None,
            "planned_peak": p.predicted_peak if p else None,
            "predicted_overhead": p.predicted_overhead if p else None,
            "method": p.method if p else None,
            "status": p.status if p else "infeasible",
            "gap": p.gap if p else None,
            "solve_time": p.solve_time if p else None,
            "min_budget": self.min_budget,
        }


def min_budget(analysis: Analysis, offload: bool = False) -> int:
    """The smallest budget the solvers can meet for this step (paging to host memory if ``offload``)."""
    return int(solvers.min_budget(problem_for(analysis, analysis.lowered.problem.budget, offload))[0])


def sweep(
    analysis: Analysis,
    budgets: Iterable[tuple[str, int]],
    *,
    solver: str = "auto",
    time_limit: float | None = None,
    on_point=None,
    offload: bool = False,
) -> list[SweepPoint]:
    """Solve one analyzed step at each ``(label, budget)``; ``on_point(point)`` after each."""
    points = []
    for label, budget in budgets:
        try:
            point = SweepPoint(label, budget, solve_plan(analysis, budget, solver=solver, time_limit=time_limit,
                                                           offload=offload))
        except InfeasibleBudgetError as exc:
            point = SweepPoint(label, budget, None, exc.min_budget)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points
