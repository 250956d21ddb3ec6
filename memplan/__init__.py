"""memplan: plan a training step's memory under a byte budget (torch side).

``memplan.optimize(model, budget="16GB")`` returns a module that trains to the
same gradients with a peak device memory under the budget.

The subpackages, lowest first (each imports only from those before it;
``tests/test_layers.py`` checks it, and ARCHITECTURE.md draws the tree):

* ``models`` (model definitions), ``core`` (storages, units, host marks, the tunables),
  ``ops`` (how one node runs), ``measure`` (the memory tracker, op timings);
* the stages: ``passes`` and ``capture`` (the joint graph), ``costs`` (bytes and seconds
  per node), ``updates`` (the optimizer's step in the plan), ``planning`` (lowering to the
  torch-free ``solvers.Problem``; stage 4 is ``solvers``), ``runtime`` (running a plan,
  eagerly or compiled);
* ``pipeline``: the stages called in order once for every caller, ``Plan``, saved plans,
  the typed options;
* ``frontend``: ``optimize``, ``OptimizedModule``, the ``torch.compile`` backend;
* ``tools``: the CLI, reports and plots, the demo.
"""
from memplan.planning.analysis import Analysis
from memplan.pipeline.stages import analyze
from memplan.pipeline.sweep import SweepPoint, min_budget, sweep
from memplan.frontend.backend import BudgetSplitWarning, MemplanBackend, SplitBudgetError, backend
from memplan.frontend.budget import parse_budget
from memplan.frontend.module import GraphBreakWarning, LossOutsideWarning, OptimizedModule, WithLoss
from memplan.frontend.entry import optimize
from memplan.capture.signature import CaptureError
from memplan.runtime.inductor.reports import CompileWarning
from memplan.costs.cost_model import PROFILES, DeviceProfile
from memplan.frontend.distributed import DistributedTrainingError, DistributedWarning
from memplan.frontend.sharded import fully_shard
from memplan.measure.tracker import measure_peak
from memplan.updates.probe import UnsupportedOptimizer
from memplan.pipeline.options import PlanOptions, StepOptions
from memplan.pipeline.clock import PlanningTimeWarning
from memplan.pipeline.plan import InfeasibleBudgetError, Plan
from memplan.updates.host_memory import HostMemoryError
from memplan.pipeline.saved import PlanMismatchError, SavedPlan, load_plan

__all__ = [
    "Analysis",
    "BudgetSplitWarning",
    "CaptureError",
    "CompileWarning",
    "DeviceProfile",
    "DistributedTrainingError",
    "DistributedWarning",
    "GraphBreakWarning",
    "HostMemoryError",
    "InfeasibleBudgetError",
    "LossOutsideWarning",
    "MemplanBackend",
    "OptimizedModule",
    "PROFILES",
    "Plan",
    "PlanMismatchError",
    "PlanOptions",
    "PlanningTimeWarning",
    "SavedPlan",
    "SplitBudgetError",
    "StepOptions",
    "UnsupportedOptimizer",
    "WithLoss",
    "analyze",
    "backend",
    "load_plan",
    "measure_peak",
    "fully_shard",
    "optimize",
    "parse_budget",
    "min_budget",
    "sweep",
    "SweepPoint",
]
