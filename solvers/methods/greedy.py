"""Baseline "greedy": DTR-style eviction (Kirisame et al. 2021, "Dynamic
Tensor Rematerialization").

Values are first computed in topological order. Before each compute, while
the result would not fit the budget, the resident value with the smallest
``cost / (mem * staleness)`` is evicted (staleness: steps since it was last
read or written). A value whose last consumer has been computed is freed.
When a node reads an evicted value, the missing ancestors are recomputed on
demand, in topological order, before it.

Non-recomputable values are never evicted. Once such a value is freed, the
resident values computed from it can no longer be recomputed either, so they
become non-evictable too ("irreplaceable"); a value of that kind is only freed
when nothing still needed would have to be recomputed from it.

Memory is tracked with `memory.Residency`; the resulting compute sequence is
turned into a schedule by `plan.schedule_from_sequence`, and `finish`
simulates it. When nothing can be evicted the greedy carries on over budget,
and the solution's status says ``over_budget``.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np

from ..core.memory import Residency
from ..core.problem import Problem
from ..core.sequence import schedule_from_sequence
from ..core.solution import MethodFailed, Solution, finish


class _Greedy:
    def __init__(self, problem: Problem, deadline: float = math.inf) -> None:
        self.p = problem
        self.deadline = deadline
        n = problem.n
        self.res = Residency(problem)
        self.resident = self.res.resident
        self.rem = np.array([len(s) for s in problem.succs], dtype=np.int64) + problem.is_sink
        self.pin = np.zeros(n, dtype=np.int64)
        self.irreplaceable = ~problem.recomputable.copy()
        self.evictable_static = ~problem.is_source & problem.recomputable & (problem.mem > 0)
        self.last_access = np.zeros(n, dtype=np.float64)
        self.clock = 0.0
        self.seq: list[int] = []
        self.over_budget = False
        self.evictions = 0

    # ----------------------------------------------------------- eviction
    def _victim(self) -> int:
        p = self.p
        mask = self.res.mask & self.evictable_static & (self.pin == 0) & ~self.irreplaceable
        candidates = np.flatnonzero(mask)
        if candidates.size == 0:
            return -1
        staleness = self.clock - self.last_access[candidates] + 1.0
        score = p.cost[candidates] / (p.mem[candidates] * staleness)
        return int(candidates[np.argmin(score)])

    def _make_room(self, v: int) -> None:
        budget = self.p.budget
        while self.res.total_if_added(v) > budget:
            u = self._victim()
            if u < 0:
                self.over_budget = True
                return
            self.res.remove(u)
            self.evictions += 1

    # ------------------------------------------------------------ freeing
    def _release(self, u: int) -> None:
        """Free ``u`` if nothing needs it any more."""
        if not self.resident[u] or self.p.is_source[u] or self.pin[u] > 0 or self.rem[u] > 0:
            return
        if self.irreplaceable[u] and not self._freeze_dependants(u):
            return  # something still needed would have to be recomputed from u: keep it
        self.res.remove(u)

    def _freeze_dependants(self, u: int) -> bool:
        # Walk forward from u through values that are not resident: if one is still
        # needed, u must stay; otherwise the resident values reached become irreplaceable.
        succs, resident, rem = self.p.succs, self.resident, self.rem
        frontier: list[int] = []
        stack = list(succs[u])
        seen = set(stack)
        while stack:
            w = stack.pop()
            if resident[w]:
                frontier.append(w)
                continue
            if rem[w] > 0:
                return False
            for x in succs[w]:
                if x not in seen:
                    seen.add(x)
                    stack.append(x)
        self.irreplaceable[frontier] = True
        return True

    # ------------------------------------------------------------ compute
    def materialize(self, v: int) -> None:
        """Make ``v`` resident, recomputing its missing ancestors first."""
        p, resident = self.p, self.resident
        missing: list[int] = []
        stack = [q for q in p.preds[v] if not resident[q]]
        seen = set(stack)
        while stack:
            u = stack.pop()
            if self.irreplaceable[u]:
                raise MethodFailed(f"greedy: {p.names[u]!r} is needed again but cannot be recomputed")
            missing.append(u)
            for q in p.preds[u]:
                if not resident[q] and q not in seen:
                    seen.add(q)
                    stack.append(q)
        missing.sort()
        todo = missing + [v]
        # Pin every input until its last consumer in `todo` has run.
        for x in todo:
            for q in p.preds[x]:
                self.pin[q] += 1
        for x in todo:
            self._make_room(x)
            self.res.add(x)
            self.seq.append(x)
            self.clock += 1.0
            self.last_access[x] = self.clock
            for q in p.preds[x]:
                self.last_access[q] = self.clock
                self.pin[q] -= 1
            for q in p.preds[x]:
                self._release(q)

    def run(self) -> list[int]:
        p = self.p
        for k, v in enumerate(p.non_sources):
            if k % 64 == 0 and time.perf_counter() >= self.deadline:
                raise MethodFailed("greedy: out of time")
            self.materialize(v)
            for q in p.preds[v]:
                self.rem[q] -= 1
                self._release(q)
            self._release(v)
        # Sinks must be resident at the end: pin the ones that are, bring back the rest.
        for s in p.sinks:
            if self.resident[s]:
                self.pin[s] += 1
        for s in p.sinks:
            if not self.resident[s]:
                self.materialize(s)
                self.pin[s] += 1
        return self.seq


def solve_greedy(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    """The greedy's schedule; with ``time_limit``, `MethodFailed` once it has run that long (a budget
    far below what it reaches has it recompute on and on: on a 1.3B-parameter GPT, 113 s)."""
    started = time.perf_counter()
    g = _Greedy(problem, started + time_limit if time_limit is not None else math.inf)
    seq = g.run()
    schedule = schedule_from_sequence(problem, seq)
    return finish(problem, schedule, "greedy", started, lower_bound=problem.total_cost(),
                  info={"evictions": g.evictions})
