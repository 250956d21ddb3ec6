"""Drop plans: which coarse groups are recomputed, and the schedule that follows from it.

`coarsen` folds views and single-consumer chains into their producers; the
strategy decides per group. A plan is a *drop set* of groups
(`DropPlanner`): values are computed in the problem's order; a dropped group
is released after each cluster of its uses and recomputed (with any dropped
input that is not available) right before the next cluster. A group's uses
include the points where a droppable consumer would be recomputed, since that
reads it again. Expanded to the fine problem and placed by
`schedule_from_sequence`, every plan is a valid schedule; the fine simulator
measures its peak, cost and step time (`Evaluation`).

With a host link a plan may also page kept groups out to host memory across
one gap between their clusters (`Paging`): the offload pager's windows place
the copies on the fine schedule (`DropPlanner.evaluate`).
"""
from __future__ import annotations

import math
import time
from bisect import bisect_right
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ...core.memory import Residency
from ...core.problem import Problem
from ...core.schedule import Op, Schedule, ScheduleError, Step, simulate
from ...core.sequence import schedule_from_sequence
from ...core.uses import Uses, cluster_end, cluster_positions
from ...transforms.coarsen import Coarsening
from ...transforms.paging import Window, apply_windows, windows_at


@dataclass(frozen=True)
class Paging:
    """Page group ``group`` out to host memory across one gap between its clusters of uses: copied
    out after the cluster before the gap, back in before the one after it. In the linear model the
    device copy is gone over stages ``first..last`` (copy out done, copy in not yet begun, in
    keep-all's clock) and the copies occupy the link during ``out_span`` and ``in_span``."""

    cand: int  # candidate index
    group: int
    first: int
    last: int
    size: int
    probe: int  # a stage inside the gap, where the group's values sit idle
    out_span: tuple[float, float]
    in_span: tuple[float, float]


@dataclass
class Evaluation:
    dropped: frozenset[int]
    schedule: Schedule
    cost: float
    peak: int
    stage_peak: np.ndarray  # fine memory peak per coarse stage (coarse index)
    peak_step: int
    charge: dict[int, float]  # recomputation cost charged to each dropped group
    time: float  # simulated step time (compute plus waits for copies)
    paged: tuple[Paging, ...] = ()
    step_stage: Optional[np.ndarray] = None  # coarse stage of each schedule step

    def fits(self, budget: int) -> bool:
        return self.peak <= budget


class DropPlanner:
    """Builds and simulates the schedule of a drop set over a coarsening."""

    def __init__(self, c: Coarsening, gap: int) -> None:
        self.c = c
        cp = c.coarse
        self.cp = cp
        self.gap = gap
        # A dropped consumer reads its inputs again whenever it is recomputed, so a
        # group's uses include its droppable consumers' recomputation points
        # (consumers come later in the order: walk backwards).
        self.droppable = [bool(cp.recomputable[g] and not cp.is_sink[g] and not cp.is_source[g])
                          for g in range(cp.n)]
        self.clusters: list[list[tuple[int, int]]] = [[] for _ in range(cp.n)]
        self.recompute_points: list[list[int]] = [[] for _ in range(cp.n)]
        for g in reversed(range(cp.n)):
            uses = set(cp.succs[g])
            for h in cp.succs[g]:
                if self.droppable[h]:
                    uses.update(self.recompute_points[h])
            groups = cluster_positions(uses, gap)
            self.clusters[g] = groups
            # Only clusters with a direct use are sure to recompute a dropped group; passing on
            # the others would make every value upstream of a residual stream "used" everywhere.
            direct = sorted(cp.succs[g])
            self.recompute_points[g] = [a for a, b in groups[1:]
                                        if bisect_right(direct, b) > bisect_right(direct, a - 1)]
        self.last_direct = [max(cp.succs[g], default=g) for g in range(cp.n)]
        self.firsts = [[a for a, _ in cs] for cs in self.clusters]

    def _cluster_end(self, g: int, position: int) -> int:
        return cluster_end(self.clusters[g], self.firsts[g], position)

    def sequence(self, dropped: frozenset[int]) -> tuple[list[int], list[int], dict[int, float]]:
        """Coarse compute sequence, the stage (coarse index served) of each compute, and the
        recomputation cost charged to each dropped group (a stage's recomputations are split
        between the dropped inputs its compute asked for)."""
        cp = self.cp
        preds = cp.preds
        alive_until: dict[int, int] = {}
        seq: list[int] = []
        stage: list[int] = []
        charge: dict[int, float] = {}
        cost = cp.lists().cost
        for v in cp.non_sources:
            missing: list[int] = []
            stack = [q for q in preds[v] if q in dropped and alive_until.get(q, -1) < v]
            seen = set(stack)
            while stack:
                u = stack.pop()
                missing.append(u)
                for q in preds[u]:
                    if q in dropped and q not in seen and alive_until.get(q, -1) < v:
                        seen.add(q)
                        stack.append(q)
            missing.sort()  # index order is topological
            if missing:
                roots = [q for q in preds[v] if q in seen]
                share = sum(cost[u] for u in missing) / len(roots)
                for r in roots:
                    charge[r] = charge.get(r, 0.0) + share
            for u in missing:
                seq.append(u)
                stage.append(v)
                alive_until[u] = max(v, self._cluster_end(u, v))
            seq.append(v)
            stage.append(v)
            if v in dropped:
                alive_until[v] = self._cluster_end(v, v + 1) if self.clusters[v] else v
        return seq, stage, charge

    def evaluate(self, dropped: frozenset[int], paged: tuple[Paging, ...] = (),
                 deadline: float = math.inf) -> Evaluation:
        """Simulate the plan of ``dropped`` with ``paged`` (pagings left out once ``deadline`` has
        passed)."""
        c = self.c
        seq, stage, charge = self.sequence(dropped)
        fine_seq: list[int] = []
        fine_stage: list[int] = []
        for g, s in zip(seq, stage):
            ms = c.members[g]
            fine_seq.extend(ms)
            fine_stage.extend([s] * len(ms))
        schedule = schedule_from_sequence(c.fine, fine_seq)
        step_stage = np.empty(len(schedule), dtype=np.int64)
        k = -1
        for i, (op, _) in enumerate(schedule.steps):
            if op is Op.COMPUTE:
                k += 1
            step_stage[i] = fine_stage[max(k, 0)]
        if paged:
            schedule, step_stage = self._page(schedule, step_stage, paged, deadline)
        result = simulate(c.fine, schedule)
        stage_peak = np.full(self.cp.n, result.initial, dtype=np.int64)
        np.maximum.at(stage_peak, step_stage, result.timeline)
        return Evaluation(dropped=dropped, schedule=schedule, cost=result.cost, peak=result.peak,
                          stage_peak=stage_peak, peak_step=result.peak_step, charge=charge, time=result.time,
                          paged=tuple(paged), step_stage=step_stage)

    def realizable(self, keep_all: Evaluation, pages: list[Paging]) -> list[Paging]:
        """The pagings whose windows exist on keep-all's schedule, each sized by what its windows
        save (a value the pager cannot move, such as a view held for nobody, saves nothing)."""
        steps = list(keep_all.schedule.steps)
        stage = keep_all.step_stage
        out = []
        for p, found in zip(pages, self.windows_per_paging(steps, stage, pages)):
            saving = min(p.size, sum(w.saving for w in found))
            if saving > 0:
                out.append(replace(p, size=saving))
        return out

    def _page(self, schedule: Schedule, step_stage: np.ndarray, paged: tuple[Paging, ...],
              deadline: float = math.inf) -> tuple[Schedule, np.ndarray]:
        """``schedule`` with the values of each paged group copied out across its gap (the offload
        pager's windows), and the stage of every step. The windows are first computed on
        ``schedule`` and merged in one pass; when that does not replay (views re-made from two
        windows can clash), the windows that re-make no view are merged and the other pagings
        applied one at a time, each computed on the schedule so far, until ``deadline``; a
        paging that does not replay is left out: the simulator's excess then steers the model."""
        fine = self.c.fine
        original = list(schedule.steps)
        stage_of = {id(step): int(st) for step, st in zip(original, step_stage)}
        steps = original
        order = sorted(paged, key=lambda p: p.probe)
        windows = self._windows_of(steps, step_stage, order)
        merged = apply_windows(fine, steps, windows)
        if _replays(fine, merged):
            steps = merged
        else:
            plain = [w for w in windows if not (w.views or w.helpers or w.moved_free is not None)]
            merged = apply_windows(fine, steps, plain)
            if _replays(fine, merged):
                steps = merged
                done = {w.value for w in plain}
                order = [p for p in order if not self.paged_values(p) <= done]
            for p in order:
                if time.perf_counter() > deadline:
                    break
                found = self._windows_of(steps, _stages(steps, stage_of), [p])  # values paged already have none
                candidate = apply_windows(fine, steps, found)
                if found and _replays(fine, candidate):
                    steps = candidate
        return Schedule(tuple(steps)), _stages(steps, stage_of)

    def paged_values(self, p: Paging) -> set[int]:
        """The values a paging moves: its group's, a view's base in its place."""
        alias_of, is_source = self.c.fine.alias_of, self.c.fine.is_source
        values = set()
        for v in self.c.members[p.group]:
            while alias_of[v] >= 0 and not is_source[alias_of[v]]:
                v = int(alias_of[v])
            values.add(v)
        return values

    def _windows_of(self, steps: list[Step], stage: np.ndarray, pages: list[Paging]) -> list[Window]:
        """The pager's windows for the values of every paging, computed on ``steps``: the windows
        of one value in two gaps are both kept, the later one without its own offload (the host
        copy stays)."""
        windows: dict[int, list[Window]] = {}  # value -> its windows, in step order
        for found in self.windows_per_paging(steps, stage, pages):
            for w in found:
                mine = windows.setdefault(w.value, [])
                if mine and mine[-1].free_at == w.free_at:
                    continue  # the same idle stretch, reached from two groups
                if mine and w.offload_at is not None:
                    w = replace(w, offload_at=None)  # the host copy of the earlier window is still there
                mine.append(w)
        return [w for ws in windows.values() for w in ws]

    def windows_per_paging(self, steps: list[Step], stage: np.ndarray, pages: list[Paging]
                           ) -> list[list[Window]]:
        """For each paging, the pager's windows on ``steps`` (``stage``: the coarse stage of each
        step) at the first step of its probe stage, for the values it moves."""
        fine = self.c.fine
        sim = simulate(fine, steps)
        uses = Uses(fine, steps)
        out: list[list[Window]] = []
        for p in pages:
            k = int(np.searchsorted(stage, p.probe, "left"))
            out.append(windows_at(fine, steps, sim, k, sorted(self.paged_values(p)), uses) if k < len(steps) else [])
        return out


def _stages(steps: list[Step], stage_of: dict[int, int]) -> np.ndarray:
    """The coarse stage of every step: an original step's (kept as the same object), and for a
    step inserted by paging the stage of the original step it precedes."""
    out = np.empty(len(steps), dtype=np.int64)
    current = max(stage_of.values(), default=0)
    for i in range(len(steps) - 1, -1, -1):
        current = stage_of.get(id(steps[i]), current)
        out[i] = current
    return out


def _replays(problem: Problem, steps: list[Step]) -> bool:
    try:
        simulate(problem, steps)
    except ScheduleError:
        return False
    return True


def held_memory(problem: Problem, values: list[int], base: int) -> int:
    """Bytes ``values`` hold beyond the sources, views made from their resident bases (as they
    are when a group is computed in one go): add the alias ancestors first, then drop them."""
    if not values:
        return 0
    alias_of = problem.alias_of
    closure = set(values)
    for v in values:
        a = int(alias_of[v])
        while a >= 0 and a not in closure:
            closure.add(a)
            a = int(alias_of[a])
    res = Residency(problem)
    for v in sorted(closure):
        if v not in res:
            res.add(v)
    for v in closure.difference(values):
        if v in res and not problem.is_source[v]:
            res.remove(v)
    return res.total - base
