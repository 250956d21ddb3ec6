"""solvers: torch-free rematerialization / offload planners over DAGs.

    problem = solvers.Problem.from_networkx(G, budget)
    solution = solvers.solve(problem, method="auto", time_limit=60)
    solvers.validate(problem, solution.schedule)
"""
from .api import solve
from .bounds import memory_lower_bound, min_budget
from .lower_bounds import lower_bound
from .plan import Plan, PlanError, schedule_from_plan, schedule_from_sequence
from .problem import Problem
from .registry import METHODS
from .schedule import Op, Schedule, ScheduleError, SimResult, Step, simulate, validate
from .solution import Infeasible, MethodFailed, Solution

__all__ = [
    "Problem", "Schedule", "Step", "Op", "SimResult", "ScheduleError", "simulate", "validate",
    "Plan", "PlanError", "schedule_from_plan", "schedule_from_sequence",
    "Solution", "Infeasible", "MethodFailed", "solve", "METHODS", "memory_lower_bound", "min_budget",
    "lower_bound",
]
