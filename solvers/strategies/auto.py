"""Method "auto": the default planner; always returns a schedule that fits when one is known.

* a problem with a host link goes to method "offload", which runs the
  rematerialization strategy on the same graph without the link at several
  budgets and pages values out to host memory on top (graphs of up to
  `offload_milp.MAX_COMPUTE` values to compute: method "offload_milp", which
  also solves its MILP over keep / recompute / offload and keeps the faster
  plan);
* otherwise the rematerialization strategy (`remat.solve_remat`: method
  "hierarchical", then the minimum-budget search's schedule if that fits).

When even that does not fit, the solution is returned as ``over_budget`` and
`solvers.solve` raises `Infeasible`.
"""
from __future__ import annotations

import time
from typing import Optional

from ..core.problem import Problem
from ..core.solution import Solution
from ..methods.offload_milp import MAX_COMPUTE
from .joint import solve_joint
from .offload import solve_offload
from .remat import relabel, solve_remat


def solve_auto(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    if not problem.has_host:
        return solve_remat(problem, time_limit)
    started = time.perf_counter()
    method = solve_joint if problem.n_compute <= MAX_COMPUTE else solve_offload
    return relabel(method(problem, time_limit), started)
