"""Shared engine of the recompute-on-demand baselines (recompute_all, sqrt_n).

Values are first computed in topological order, which is cut into segments.
A value is *available* from its computation until the end of the segment in
which it was (re)computed, unless it is *persistent* (sources, sinks,
non-recomputable values and whatever the method chooses to checkpoint), in
which case it stays available for good. When a value needs a predecessor
that is not available, the missing ancestors are recomputed first, as late
as possible, stopping at available values.

The result is a plain compute sequence; `plan.schedule_from_sequence` then
places the frees (after each instance's last read), so this module never
looks at memory.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.problem import Problem
from ..core.solution import MethodFailed


def base_persistent(problem: Problem) -> np.ndarray:
    """Values that must never be dropped: sources, sinks, and values that cannot be recomputed."""
    return problem.is_source | problem.is_sink | ~problem.recomputable


def recompute_sequence(problem: Problem, segment_of: Sequence[int], persistent: np.ndarray,
                       max_computes: int) -> list[int]:
    """Compute sequence for the policy above. ``segment_of[v]`` is the segment
    of non-source ``v`` (non-decreasing along the order). Raises
    `MethodFailed` when the sequence would exceed ``max_computes`` computes."""
    preds = problem.preds
    available = problem.is_source.copy()
    order = problem.non_sources
    seq: list[int] = []
    temporary: list[int] = []  # non-persistent values made available in the current segment

    def recompute_missing(v: int) -> None:
        # Collect the unavailable ancestors of v (through unavailable values only).
        missing: list[int] = []
        seen = {v}
        stack = [p for p in preds[v] if not available[p]]
        seen.update(stack)
        while stack:
            u = stack.pop()
            if not problem.recomputable[u]:
                raise MethodFailed(f"value {problem.names[u]!r} is needed again but cannot be recomputed")
            missing.append(u)
            for p in preds[u]:
                if not available[p] and p not in seen:
                    seen.add(p)
                    stack.append(p)
        missing.sort()  # index order is a topological order
        for u in missing:
            seq.append(u)
            available[u] = True
            if not persistent[u]:
                temporary.append(u)

    for k, v in enumerate(order):
        recompute_missing(v)
        seq.append(v)
        available[v] = True
        if not persistent[v]:
            temporary.append(v)
        if len(seq) > max_computes:
            raise MethodFailed(f"schedule would exceed {max_computes} computes")
        last_of_segment = k + 1 == len(order) or segment_of[order[k + 1]] != segment_of[v]
        if last_of_segment:
            for u in temporary:
                available[u] = False
            temporary.clear()
    return seq
