"""Coarsening: fold views and cheap chains into their producers.

Joint graphs of real models are mostly views (``view``, ``getitem``,
``transpose``: zero cost, living in their base's storage) and short chains
whose intermediate values die as soon as their one consumer runs. A plan
loses nothing by treating such a cluster as one unit, and the solvers get a
graph several times smaller.

A *group* is a producer (its root) plus values folded into it. A value
``v`` joins the group ``G`` of its inputs when every non-source input of
``v`` lies in ``G`` (then contracting cannot create a cycle, and the members
of ``G`` only read ``G`` or sources) and

* ``v`` costs nothing (views, getitems), or
* ``v`` is the only consumer of the member it reads (a chain: that member
  dies as soon as ``v`` exists, so it is never worth keeping on its own).

Sinks stay alone (the simulator keeps a sink to the end, so a group that
held one would outlive its coarse lifetime), and nothing joins a sink.

`Coarsening.coarse` is a `Problem` over the groups. Expanding a coarse
compute sequence computes each group's members in index order;
`plan.schedule_from_sequence` on the fine problem then frees every fine value
after its last read, which is never later than the coarse free of its group.
The coarse memory of a group is the largest memory any subset of its
members can take under the alias rule (a view whose base has been freed
counts on its own), so at every instant the fine memory is at most the
coarse memory: a coarse schedule that fits maps to a fine one that fits.
The fine simulator still has the last word (`Coarsening.fine_schedule`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..core.problem import Problem
from ..core.schedule import Op, Schedule
from ..core.sequence import schedule_from_sequence


@dataclass(frozen=True, eq=False)
class Coarsening:
    fine: Problem
    coarse: Problem
    members: tuple[tuple[int, ...], ...]  # per coarse node: its fine values, in index order
    group_of: np.ndarray  # fine index -> coarse index

    def expand(self, coarse_computes: Iterable[int]) -> list[int]:
        """Fine compute sequence for a coarse one (coarse indices in, fine indices out)."""
        out: list[int] = []
        for g in coarse_computes:
            out.extend(self.members[g])
        return out

    def fine_schedule(self, coarse_computes: Iterable[int]) -> Schedule:
        return schedule_from_sequence(self.fine, self.expand(coarse_computes))

    def fine_schedule_of(self, coarse_schedule: Schedule) -> Schedule:
        """Map a schedule of the coarse problem (its frees are dropped and re-placed)."""
        index = self.coarse.index
        return self.fine_schedule(index[node] for op, node in coarse_schedule if op is Op.COMPUTE)


def _fold(problem: Problem) -> list[int]:
    """Group root of every value (sources are their own roots)."""
    n = problem.n
    preds, succs = problem.preds, problem.succs
    is_source, is_sink = problem.is_source, problem.is_sink
    cost = problem.cost
    root = list(range(n))
    sinky = [False] * n  # group (by root) holds a sink: nothing joins it
    for v in range(n):
        if is_source[v]:
            continue
        if is_sink[v]:
            sinky[v] = True
            continue
        inner = [q for q in preds[v] if not is_source[q]]
        if not inner:
            continue
        groups = {root[q] for q in inner}
        if len(groups) != 1:
            continue
        (g,) = groups
        if sinky[g]:
            continue
        chain = len(inner) == 1 and len(succs[inner[0]]) == 1
        if cost[v] == 0 or chain:
            root[v] = g
    return root


def _group_memory(problem: Problem, members: Sequence[int]) -> int:
    """Largest memory of any subset of ``members`` under the alias rule.

    Per alias subtree: either its top member is resident (and covers the
    rest) or the best of its children's subtrees; a member whose alias chain
    reaches a source is always covered."""
    alias_of, mem, is_source = problem.alias_of, problem.mem, problem.is_source
    inside = set(members)
    covered: dict[int, bool] = {}
    children: dict[int, list[int]] = {}
    tops: list[int] = []
    for v in members:  # index order: a member's alias parent comes first
        a = int(alias_of[v])
        covered[v] = a >= 0 and (bool(is_source[a]) or covered.get(a, False))
        if a >= 0 and a in inside:
            children.setdefault(a, []).append(v)
        else:
            tops.append(v)
    best: dict[int, int] = {}
    for v in reversed(members):  # children before parents
        below = sum(best[c] for c in children.get(v, ()))
        own = 0 if covered[v] else int(mem[v])
        best[v] = max(own, below)
    return sum(best[v] for v in tops)


def coarsen(problem: Problem) -> Coarsening:
    root = _fold(problem)
    n = problem.n
    roots = sorted(set(root))  # a group's external consumers are later roots: root order is topological
    index = {r: i for i, r in enumerate(roots)}
    members: list[list[int]] = [[] for _ in roots]
    for v in range(n):
        members[index[root[v]]].append(v)
    group_of = np.array([index[root[v]] for v in range(n)], dtype=np.int64)
    preds: list[tuple[int, ...]] = []
    mem, cost, recomputable = [], [], []
    for g, ms in enumerate(members):
        outside = sorted({int(group_of[q]) for v in ms for q in problem.preds[v]} - {g})
        preds.append(tuple(outside))
        r = ms[0]
        mem.append(int(problem.mem[r]) if problem.is_source[r] else _group_memory(problem, ms))
        cost.append(float(sum(problem.cost[v] for v in ms)))
        recomputable.append(bool(all(problem.recomputable[v] for v in ms)))
    coarse = Problem(
        names=tuple(problem.names[r] for r in roots),
        preds=tuple(preds),
        mem=np.array(mem, dtype=np.int64),
        cost=np.array(cost, dtype=np.float64),
        recomputable=np.array(recomputable, dtype=bool),
        alias_of=np.full(len(roots), -1, dtype=np.int64),
        budget=problem.budget,
    )
    return Coarsening(fine=problem, coarse=coarse, members=tuple(tuple(ms) for ms in members), group_of=group_of)
