"""A solved plan for one input signature: the schedule, its predictions, its report.

``make_plan`` is the pipeline of DESIGN.md in one place:
capture -> costs -> Problem -> solver -> Program.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

import solvers
from memplan.analysis import Analysis, analyze_capture, replay_eager_peak
from memplan.capture import capture
from memplan.costs import DeviceProfile
from memplan.problem import BACKWARD, USER_SUFFIX
from memplan.runtime import Program, build_program


class InfeasibleBudgetError(ValueError):
    """No plan fits the budget; ``min_budget`` is the smallest budget memplan can meet."""

    def __init__(self, budget: int, min_budget: int):
        self.budget = budget
        self.min_budget = min_budget
        super().__init__(
            f"budget {format_bytes(budget)} is below the smallest feasible plan for this model and input: "
            f"{format_bytes(min_budget)} ({min_budget} bytes); raise the budget or shrink the batch"
        )


def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class ValueDecision:
    """What the plan does with one value computed in forward and needed in backward."""

    name: str
    nbytes: int
    decision: str  # "keep" | "recompute"
    computations: int


@dataclass
class Plan:
    """The plan for one input signature, with what it predicts."""

    budget: int
    predicted_peak: int
    predicted_time: float
    store_all_time: float
    store_all_peak: int
    method: str
    lower_bound: float | None
    solve_time: float
    status: str
    decisions: list[ValueDecision]
    schedule: "solvers.Schedule" = field(repr=False)
    analysis: Analysis = field(repr=False)

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over store-all's (>= 1.0)."""
        return self.predicted_time / self.store_all_time if self.store_all_time else 1.0

    @property
    def gap(self) -> float | None:
        """Relative distance of the plan's cost from the solver's proven lower bound."""
        if self.lower_bound is None or self.lower_bound <= 0:
            return None
        return max(0.0, self.predicted_time / self.lower_bound - 1.0)

    def save(self, path: str) -> None:
        """Write the plan to ``path`` (JSON) for ``memplan.load_plan`` / ``optimize(..., plan=path)``."""
        from memplan.planio import save_plan

        save_plan(self, path)

    def report(self) -> str:
        a = self.analysis
        counts = Counter(d.decision for d in self.decisions)
        recomputed = sum(d.nbytes for d in self.decisions if d.decision == "recompute")
        lines = [
            "memplan plan",
            f"  parameters       {format_bytes(a.param_bytes)}",
            f"  eager peak       {format_bytes(a.eager_peak)} (eager autograd, replayed on fake tensors)",
            f"  store-all peak   {format_bytes(self.store_all_peak)} (joint graph, every value kept until last use)",
            f"  budget           {format_bytes(self.budget)}",
            f"  planned peak     {format_bytes(self.predicted_peak)} (predicted)",
            f"  overhead         {self.predicted_overhead:.3f}x store-all step time (predicted)",
            f"  method           {self.method} ({self.status}), solved in {self.solve_time:.2f} s"
            + (f", gap {self.gap:.1%}" if self.gap is not None else ""),
            f"  values           {counts.get('keep', 0)} kept, {counts.get('recompute', 0)} recomputed "
            f"({format_bytes(recomputed)} not held across the step)",
        ]
        return "\n".join(lines)


def _decisions(analysis: Analysis, schedule: "solvers.Schedule") -> list[ValueDecision]:
    low = analysis.lowered
    computes = Counter(str(node) for op, node in schedule if op == "compute")
    out = []
    for name, node in low.fx_nodes.items():
        if node.op != "call_function" or name.endswith(USER_SUFFIX) or name == BACKWARD:
            continue
        n = computes.get(name, 0)
        if n == 0:
            continue
        out.append(ValueDecision(name, analysis.costs.values[name].new_bytes, "recompute" if n > 1 else "keep", n))
    return out


def make_plan(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    budget: int,
    *,
    solver: str = "auto",
    time_limit: float | None = None,
    profile: DeviceProfile,
    measure_on: torch.device | None = None,
) -> tuple[Plan, Program]:
    """Capture, cost, lower, solve and lower back to a runnable :class:`Program`.

    ``measure_on``: time every op on that device instead of using the roofline.
    """
    cap = capture(model, args, kwargs)
    analysis = analyze_capture(cap, profile, replay_eager_peak(model, args, kwargs), measure_on)
    plan = solve_plan(analysis, budget, solver=solver, time_limit=time_limit)
    return plan, build_program(cap, analysis.lowered, plan.schedule)


def solve_plan(analysis: Analysis, budget: int, *, solver: str = "auto", time_limit: float | None = None) -> Plan:
    """Solve an analyzed step for one budget (a sweep solves one analysis many times)."""
    problem = analysis.lowered.with_budget(budget)
    start = time.perf_counter()
    try:
        sol = solvers.solve(problem, method=solver, time_limit=time_limit)
    except solvers.Infeasible as exc:
        raise InfeasibleBudgetError(budget, int(exc.min_budget)) from None
    return plan_from_schedule(
        analysis, budget, sol.schedule, method=sol.method, status=sol.status,
        lower_bound=sol.lower_bound, solve_time=time.perf_counter() - start,
    )


def plan_from_schedule(
    analysis: Analysis,
    budget: int,
    schedule: "solvers.Schedule",
    *,
    method: str,
    status: str,
    lower_bound: float | None = None,
    solve_time: float = 0.0,
) -> Plan:
    """A :class:`Plan` for a schedule, validated against the analysis' Problem under ``budget``.

    Peak and time come from the simulator, never from whoever made the schedule.
    Raises ``solvers.ScheduleError`` if the schedule is invalid or over the budget.
    """
    result = solvers.validate(analysis.lowered.with_budget(budget), schedule)
    return Plan(
        budget=budget,
        predicted_peak=result.peak,
        predicted_time=result.cost,
        store_all_time=analysis.store_all.cost,
        store_all_peak=analysis.store_all.peak,
        method=method,
        lower_bound=lower_bound,
        solve_time=solve_time,
        status=status,
        decisions=_decisions(analysis, schedule),
        schedule=schedule,
        analysis=analysis,
    )
