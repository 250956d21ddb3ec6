"""memplan: plan a training step's memory under a byte budget (torch side).

``memplan.optimize(model, budget="16GB")`` returns a module that trains to the
same gradients with a peak device memory under the budget.

The modules, in pipeline order (a stage imports only from the stages above it;
``tests/test_layers.py`` checks there are no import cycles):

* leaves: ``storage`` (which storages hold a value), ``units`` (byte counts for people),
  ``distributed`` (what memplan refuses under DDP and FSDP until it plans them);
* ``capture``: the joint graph, with its graph passes ``compaction`` and ``output_use``;
* ``costs`` (bytes, FLOPs, time per value), with ``measure`` (the memory tracker)
  and ``profiling`` (timings on the device) beside it; ``options`` (the typed options of
  ``optimize``, the backend and the CLI) above it;
* ``problem``: the lowering to the torch-free ``solvers.Problem``;
* ``analysis``: costs, Problem and store-all baseline of one step;
* ``runtime``: a schedule as straight-line code;
* ``planformat`` (the saved-plan file), ``plan`` (solve and predict), ``planio`` (reuse saved plans);
* ``api``: ``OptimizedModule``; ``dynamo`` (the ``torch.compile`` backend: one plan per dynamo
  graph, the step's budget shared); ``front``: ``optimize``, which picks between them;
  then ``viz`` and ``cli`` on top.

``memplan.models`` (the built-in model zoo and ``make demo``) is no part of the
pipeline: nothing above imports it but the CLI.
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
from memplan.measure.tracker import measure_peak
from memplan.updates.probe import UnsupportedOptimizer
from memplan.pipeline.options import PlanOptions, StepOptions
from memplan.pipeline.plan import InfeasibleBudgetError, Plan, PlanningTimeWarning
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
    "optimize",
    "parse_budget",
    "min_budget",
    "sweep",
    "SweepPoint",
]
