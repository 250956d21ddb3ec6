"""Baseline "store_all": compute every value once, in topological order, and
free it right after its last use. No recomputation, so its cost (the sum of
all compute costs) is a lower bound for every schedule: any schedule
computes each value at least once."""
from __future__ import annotations

import time
from typing import Optional

from ..core.problem import Problem
from ..core.sequence import schedule_from_sequence
from ..core.solution import Solution, finish


def solve_store_all(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    schedule = schedule_from_sequence(problem, problem.non_sources)
    return finish(problem, schedule, "store_all", started, lower_bound=problem.total_cost())
