"""Exact search over all schedules of a small graph (ground truth for tests).

Uniform-cost search (Dijkstra) over states ``(computed-ever set, resident
set)``; moves are "compute v" (cost ``cost[v]``, its inputs resident, never
again if v is not recomputable) and "free v" (cost 0). Memory must stay
within the budget after every move. The goal: everything computed at least
once and every sink resident. Values are computed in any order.

Two restricted variants serve as references for Checkmate:

* ``order``: first computations must follow the given topological order;
  recomputations may happen anywhere.
* ``stages=True`` (with an order): Checkmate's own space. Stage t
  recomputes some earlier values, each at most once and in index order, then
  computes node t for the first time; a final stage only recomputes (this
  matches `checkmate.py`'s virtual end node).

`min_peak` runs the same search minimising the peak instead of the cost,
which gives the exact minimum budget.

The state space grows like 3^n: the search refuses graphs with more than
``MAX_NODES`` values to compute.
"""
from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable, Optional, Sequence

from ..core.memory import memory_of
from ..core.problem import Problem
from ..core.schedule import Op, Schedule, Step
from ..core.solution import OPTIMAL, MethodFailed, Solution, finish

MAX_NODES = 10


class _Space:
    """Bitmask encoding of a problem's non-source values and the memory of every resident mask."""

    def __init__(self, problem: Problem) -> None:
        m = problem.n_compute
        if m > MAX_NODES:
            raise MethodFailed(f"exhaustive search is limited to {MAX_NODES} values to compute, got {m}")
        self.problem = problem
        self.m = m
        self.nodes = problem.non_sources  # bit i <-> node nodes[i]
        bit = {v: i for i, v in enumerate(self.nodes)}
        self.need = [0] * m  # mask of non-source inputs of each value
        for i, v in enumerate(self.nodes):
            for p in problem.preds[v]:
                if p in bit:
                    self.need[i] |= 1 << bit[p]
        self.cost = [float(problem.cost[v]) for v in self.nodes]
        self.recomputable = [bool(problem.recomputable[v]) for v in self.nodes]
        self.sinks = sum(1 << bit[v] for v in problem.sinks)
        self.full = (1 << m) - 1
        # Memory of every resident mask, from the shared memory arithmetic.
        self.memory = [memory_of(problem, [self.nodes[i] for i in range(m) if mask >> i & 1])
                       for mask in range(1 << m)]


def _search(space: _Space, budget: float, objective: str, order: Optional[Sequence[int]],
            stages: bool) -> Optional[tuple[float, list[Step]]]:
    """Best (objective value, steps) or None if no schedule fits ``budget``.

    ``objective`` is "cost" (sum of compute costs) or "peak" (max memory)."""
    m, need, cost, memory = space.m, space.need, space.cost, space.memory
    names = [space.problem.names[v] for v in space.nodes]
    pos_in_order: Optional[list[int]] = None
    if order is not None:
        bit = {v: i for i, v in enumerate(space.nodes)}
        order_bits = [bit[v] for v in order]
        pos_in_order = order_bits
    start_peak = memory[0]
    if start_peak > budget:
        return None
    # State: (computed, resident, stage cursor). The cursor is used only in stage mode:
    # the next bit that may be recomputed in the current stage (m+1 when unused).
    start = (0, 0, 0)
    best: dict[tuple[int, int, int], float] = {start: start_peak if objective == "peak" else 0.0}
    parent: dict[tuple[int, int, int], tuple[tuple[int, int, int], Optional[Step]]] = {start: (start, None)}
    counter = itertools.count()
    heap = [(best[start], next(counter), start)]

    def relax(state: tuple[int, int, int], value: float, prev: tuple[int, int, int], step: Optional[Step]) -> None:
        if value < best.get(state, float("inf")):
            best[state] = value
            parent[state] = (prev, step)
            heapq.heappush(heap, (value, next(counter), state))

    while heap:
        value, _, state = heapq.heappop(heap)
        if value > best.get(state, float("inf")):
            continue
        computed, resident, cursor = state
        if computed == space.full and resident & space.sinks == space.sinks:
            steps: list[Step] = []
            s = state
            while True:
                prev, step = parent[s]
                if step is None:
                    break
                steps.append(step)
                s = prev
            steps.reverse()
            return value, steps

        def moved(new_resident: int) -> Optional[float]:
            mem = memory[new_resident]
            if mem > budget:
                return None
            return max(value, mem) if objective == "peak" else value

        # Frees.
        r = resident
        while r:
            low = r & -r
            i = low.bit_length() - 1
            r ^= low
            nv = moved(resident & ~low)
            if nv is not None:
                relax((computed, resident & ~low, cursor), nv, state, Step(Op.FREE, names[i]))
        # Computes.
        n_first = bin(computed).count("1")
        if stages:
            assert pos_in_order is not None
            # Stage t = n_first: recompute candidates are earlier bits of the order at index >= cursor.
            t = n_first
            # Stage m (after the last first computation) only recomputes, e.g. sinks freed earlier.
            for k in range(cursor, t + 1 if t < m else m):
                i = pos_in_order[k]
                b = 1 << i
                if k < t:
                    if resident & b or not space.recomputable[i] or need[i] & ~resident:
                        continue
                    nv = moved(resident | b)
                    if nv is not None:
                        step_value = nv + (cost[i] if objective == "cost" else 0.0)
                        relax((computed, resident | b, k + 1), step_value, state, Step(Op.COMPUTE, names[i]))
                else:
                    if need[i] & ~resident:
                        continue
                    nv = moved(resident | b)
                    if nv is not None:
                        step_value = nv + (cost[i] if objective == "cost" else 0.0)
                        relax((computed | b, resident | b, 0), step_value, state, Step(Op.COMPUTE, names[i]))
            continue
        for i in range(m):
            b = 1 << i
            if resident & b or need[i] & ~resident:
                continue
            if computed & b:
                if not space.recomputable[i]:
                    continue
            elif pos_in_order is not None and (n_first >= m or pos_in_order[n_first] != i):
                continue
            nv = moved(resident | b)
            if nv is not None:
                step_value = nv + (cost[i] if objective == "cost" else 0.0)
                relax((computed | b, resident | b, 0), step_value, state, Step(Op.COMPUTE, names[i]))
    return None


def _solve(problem: Problem, method: str, order: Optional[Sequence[int]], stages: bool) -> Solution:
    started = time.perf_counter()
    space = _Space(problem)
    found = _search(space, problem.budget, "cost", order, stages)
    if found is None:
        # Nothing fits in this search space: report the least-memory schedule of the space instead.
        peak_found = _search(space, float("inf"), "peak", order, stages)
        assert peak_found is not None
        schedule = Schedule(tuple(peak_found[1]))
        return finish(problem, schedule, method, started, lower_bound=None)
    value, steps = found
    if order is None and not problem.has_host:  # the optimum over every schedule (offloads aside)
        return finish(problem, Schedule(tuple(steps)), method, started, lower_bound=value, status=OPTIMAL)
    # Optimal in a restricted space only: that bound is kept apart; every schedule costs at least the sum.
    return finish(problem, Schedule(tuple(steps)), method, started, lower_bound=problem.total_cost(),
                  status=OPTIMAL, info={"model_bound": value})


def solve_exhaustive(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    """Exact optimum over all schedules (any order). lower_bound = the optimum."""
    return _solve(problem, "exhaustive", None, False)


def solve_exhaustive_fixed(problem: Problem, time_limit: Optional[float] = None,
                           order: Optional[Sequence[int]] = None) -> Solution:
    """Exact optimum over schedules whose first computations follow ``order``
    (default: the problem's order); recomputations anywhere."""
    return _solve(problem, "exhaustive_fixed", list(order or problem.non_sources), False)


def solve_exhaustive_stages(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    """Exact optimum over Checkmate's space (stages in the problem's order)."""
    return _solve(problem, "exhaustive_stages", list(problem.non_sources), True)


def min_peak(problem: Problem) -> tuple[int, Schedule]:
    """Exact minimum peak over all schedules, with a schedule achieving it."""
    found = _search(_Space(problem), float("inf"), "peak", None, False)
    assert found is not None  # with an unlimited budget store_all always works
    return int(found[0]), Schedule(tuple(found[1]))


SOLVERS: dict[str, Callable[..., Solution]] = {
    "exhaustive": solve_exhaustive,
    "exhaustive_fixed": solve_exhaustive_fixed,
    "exhaustive_stages": solve_exhaustive_stages,
}
