"""memplan: plan a training step's memory under a byte budget (torch side).

``memplan.optimize(model, budget="16GB")`` returns a module that trains to the
same gradients with a peak device memory under the budget. See DESIGN.md.
"""
from memplan.analysis import Analysis, analyze
from memplan.api import OptimizedModule, WithLoss, optimize, parse_budget
from memplan.capture import CaptureError
from memplan.costs import PROFILES, DeviceProfile
from memplan.measure import measure_peak
from memplan.plan import InfeasibleBudgetError, Plan
from memplan.planio import PlanMismatchError, SavedPlan, load_plan

__all__ = [
    "Analysis",
    "CaptureError",
    "DeviceProfile",
    "InfeasibleBudgetError",
    "OptimizedModule",
    "PROFILES",
    "Plan",
    "PlanMismatchError",
    "SavedPlan",
    "WithLoss",
    "analyze",
    "load_plan",
    "measure_peak",
    "optimize",
    "parse_budget",
]
