"""Baseline "recompute_all": keep only what cannot be recomputed (sources,
sinks, non-recomputable values); every other value is dropped right after
the node that first needed it and recomputed, as late as possible, each
time it is read again. Minimal memory, quadratic cost on chains.

Its schedule can have O(n^2) computes; past ``MAX_COMPUTES`` the method
raises `MethodFailed` instead of building it."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..core.problem import Problem
from ..core.sequence import schedule_from_sequence
from ..core.solution import Solution, finish
from .segments import base_persistent, recompute_sequence

MAX_COMPUTES = 2_000_000


def solve_recompute_all(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    order = problem.non_sources
    segment_of = np.full(problem.n, -1, dtype=np.int64)
    segment_of[list(order)] = np.arange(len(order))  # every value is its own segment
    seq = recompute_sequence(problem, segment_of, base_persistent(problem), MAX_COMPUTES)
    schedule = schedule_from_sequence(problem, seq)
    return finish(problem, schedule, "recompute_all", started, lower_bound=problem.total_cost())

