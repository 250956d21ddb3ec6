"""solvers: torch-free rematerialization / offload planners over DAGs.

    problem = solvers.Problem.from_networkx(G, budget)
    solution = solvers.solve(problem, method="auto", time_limit=60)
    solvers.validate(problem, solution.schedule)
"""
from .api import solve
from .core.problem import Problem
from .core.schedule import (
    Op,
    Schedule,
    ScheduleError,
    SimResult,
    Step,
    simulate,
    validate,
)
from .core.sequence import (
    PlanError,
    StagePlan,
    schedule_from_plan,
    schedule_from_sequence,
)
from .core.solution import Infeasible, MethodFailed, Solution
from .methods.lower_bounds import lower_bound
from .methods.memory_bounds import memory_lower_bound
from .registry import METHODS
from .strategies.min_budget import min_budget

__all__ = [
    "Problem", "Schedule", "Step", "Op", "SimResult", "ScheduleError", "simulate", "validate",
    "StagePlan", "PlanError", "schedule_from_plan", "schedule_from_sequence",
    "Solution", "Infeasible", "MethodFailed", "solve", "METHODS", "memory_lower_bound", "min_budget",
    "lower_bound",
]
