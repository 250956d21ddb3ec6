"""Baseline "sqrt_n" (Chen et al. 2016, "Training deep nets with sublinear
memory cost"), generalised from chains to DAGs.

The topological order of the values to compute is cut into segments of
about sqrt(n). The checkpoints are the values that cross a segment boundary
into the next segment (for a chain: the segment's last activation), plus
sources, sinks and non-recomputable values; they are kept until their last
use. Every other value is dropped at the end of the segment it was computed
in, and recomputed from the nearest checkpoints when a later node (typically
in the backward pass) reads it; recomputed values are then held until the
end of that later segment, so a segment is recomputed once per segment that
needs it, as in Chen's scheme.

The budget is not consulted: this is the classic fixed policy.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np

from ..core.problem import Problem
from ..core.sequence import schedule_from_sequence
from ..core.solution import Solution, finish
from .segments import base_persistent, recompute_sequence

MAX_COMPUTES = 2_000_000


def checkpoints(problem: Problem, segment_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment of every value and the checkpoint mask for segments of ``segment_length`` values."""
    order = problem.non_sources
    position = np.full(problem.n, -1, dtype=np.int64)
    position[list(order)] = np.arange(len(order))
    segment_of = np.where(position >= 0, position // segment_length, -1)
    persistent = base_persistent(problem)
    # A value crosses into the next segment when a consumer lies in a later segment
    # no further than the next one.
    for v in order:
        seg = segment_of[v]
        for w in problem.succs[v]:
            if segment_of[w] == seg + 1:
                persistent[v] = True
                break
    return segment_of, persistent


def solve_sqrt_n(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    m = max(1, problem.n_compute)
    length = max(1, math.ceil(math.sqrt(m)))
    segment_of, persistent = checkpoints(problem, length)
    seq = recompute_sequence(problem, segment_of, persistent, MAX_COMPUTES)
    schedule = schedule_from_sequence(problem, seq)
    return finish(problem, schedule, "sqrt_n", started, lower_bound=problem.total_cost(),
                  info={"segment_length": length, "checkpoints": int(persistent[~problem.is_source].sum())})
