"""Method "hierarchical": near-optimal drop plans for graphs of thousands of values.

Layers, each cheap on its own:

1. `coarsen` folds views and single-consumer chains into their producers
   (gpt12: 1957 values to compute become 793 groups); decisions are per group.
2. A plan is a *drop set* of groups (`DropPlanner`): values are computed in
   the problem's order; a dropped group is released after each cluster of its
   uses and recomputed (with any dropped input that is not available) right
   before the next cluster. A group's uses include the points where a
   droppable consumer would be recomputed, since that reads it again.
   Expanded to the fine problem and placed by `plan.schedule_from_sequence`,
   every plan is a valid schedule; the fine simulator measures peak and cost.
3. Which groups to drop is a covering ILP (HiGHS, `CoverModel`): dropping
   group g costs its recomputations and frees its held bytes over the gaps
   between its clusters, minus the transient of recomputing it whole, minus
   what its kept inputs must then hold until its recomputation; with
   ``chains`` a cluster made only of a consumer's recomputation points costs
   (and holds) only when that consumer is dropped too. Every stage where the
   keep-all schedule is over the budget must come down to it (rows added as
   the linear model violates them, soft so that the ILP always answers).
4. The simulator closes the loop: stages still over budget get the measured
   excess added to their requirement; a plan that fits feeds back what each
   dropped group's recomputations really cost (chains included); when the
   ILP repeats itself, the target is lowered; a plan still over budget is
   repaired by dropping, most bytes per cost first, what is resident at the
   peak (a near miss, within `NEAR_MISS`, at once). A stage whose peak step
   holds nothing a drop could release (sources, gradients, what the step
   reads: gpt12 at 30% ends 0.15% over, summing the tied embedding's two
   gradients while all the others are held) is a *floor* (`_floor_stages`):
   the model aims at its peak there, and plans over budget only at floors are
   searched on like fitting ones and left, the cheapest first, to
   `repair.add_recomputations`, which can move a gradient past that step.
   `keep_again` then undoes drops, costliest first, while it fits.

   With a host link (``problem.has_host``) the ILP also chooses *pagings*
   (`pagings`): a kept group copied to host memory across one gap between
   its clusters, freeing its bytes from the end of the copy out to the start
   of the copy in (keep-all's clock); rows keep the copies overlapping any
   stage within its duration, one at a time each way, and the host memory
   within its capacity. Groups that cannot be recomputed are candidates for
   paging only. The offload pager's windows place the copies on the fine
   schedule (`DropPlanner._page`); plans are compared by simulated step time.
   Each model runs without pagings, then with them; the paging runs stop at
   the first whose plan is not faster than the best plan so far (plans made
   elsewhere, ``seeds``, count): on graphs where paging does not pay, the
   descents and `pin_search` get the time.

5. A small portfolio of cluster gaps and chain models shares the time; the
   cheapest fitting plan wins. Graphs small enough get the exhaustive search
   (<= 8 values) or Checkmate on the fine or coarse graph (<= 60).

The result is always a simulated schedule: the fast baselines (store_all,
greedy, select, and rotor's chain DP when `solvers.rotor` is present; sqrt_n
when time is left) compete with the drop plans and are the fallback; plans
over the budget that cost less than the best fitting one are repaired by
`repair.add_recomputations`, and store-all is recomputed down to the
budget in steps (`repair.recompute_down`), again through other stops with
half the time left (the greedy repair ends far apart from one set of stops to
another); `pin_search` spends the rest keeping values the best plan
recomputes and repairing elsewhere (unet 30%: 1.5554 -> 1.4990 of total
cost); when nothing fits the lowest peak found is
returned (status ``over_budget``). A fitting
winner is polished by `polish.keep_recomputed` (recomputations the budget
does not need are undone).
``lower_bound``: `solvers.methods.lower_bounds.lower_bound` when that module is
present (valid for every schedule), else the sum of all costs (`_bound` is
the plug-in point), computed in a child process on a second core while the
search runs (`background`, limits of `BACKGROUND_MIN_LIMIT` seconds or more),
else in the last tenth of the limit.
"""
from __future__ import annotations

import math
import random
import time
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np

from ..core.memory import Residency, memory_of
from ..core.method import RACE, portfolio
from ..core.problem import Problem
from ..core.schedule import Op, Schedule, ScheduleError, Step, simulate
from ..core.sequence import schedule_from_sequence
from ..core.solution import FEASIBLE, MethodFailed, Solution, finish
from ..core.uses import Uses, cluster_end, cluster_positions, residencies, resident_at
from ..methods.catalog import METHOD_INFOS
from ..methods.checkmate import solve_checkmate
from ..methods.exhaustive import solve_exhaustive
from ..methods.milp_backends import BACKENDS, RAW_FEASIBLE, RAW_OPTIMAL
from ..methods.sqrt_n import solve_sqrt_n
from ..transforms.coarsen import Coarsening, coarsen
from ..transforms.paging import Window, apply_windows, windows_at
from ..transforms.pin_search import pin_search
from ..transforms.polish import keep_recomputed
from ..transforms.repair import DESCENT, add_recomputations, recompute_down
from .background import BackgroundBound, usable_cores

DEFAULT_TIME_LIMIT = 30.0
# (cluster gap as a share of the coarse graph, chains modelled) for each run of the drop search:
# uses further apart than the gap start a new cluster. 1/100 first: on gpt12 at 30% it settles
# in about 6 s at 1.2042 of total cost before the repair of its floor (1/50: 1.2111).
VARIANTS = ((1 / 100, False), (1 / 50, False), (1 / 50, True), (1 / 25, False), (1 / 100, True), (1 / 25, True),
            (1 / 200, False), (1 / 12, False), (1 / 200, True), (1 / 12, True), (1 / 400, False), (1 / 400, True))
FIRST_SHARE = 2 / 3  # of the search window for the first variant
POLISHED = 3  # best plans (of different variants) polished by keep_again, time permitting
# keep_again takes back at most about half of a plan's cost (unet 30%: 6.43 -> 2.91 of the total,
# 3.30 -> 2.73): a drop plan more than this many times slower than the best plan is not polished.
KEEP_AGAIN_REACH = 2.0
SEARCH_SHARE = 0.6  # of the time limit for the drop searches; the rest polishes the best plan
SEARCH_END = 0.7  # when nothing fits, the drop searches go on until this share of the time limit
REPAIR_END = 0.9  # repairs of cheaper plans over the budget end by this share
DESCENT_END = 0.25  # store-all's descent to the budget by recomputation ends by this share
ROWS_PER_ROUND = 40  # violated stages added to the ILP per round of row generation
MAX_FEEDBACK_ROUNDS = 60
MAX_MARGIN_STEPS = 4  # times the model's target may be lowered when stuck over budget
EXACT_NODES = 8  # exhaustive search up to this many values to compute
CHECKMATE_NODES = 60  # Checkmate on the fine (else coarse) graph up to this many values
MORE_DESCENTS = 64  # store-all descents through other stops, when time is left
MORE_DESCENTS_SHARE = 0.5  # of the search time left for them; `pin_search` has the rest
# `pin_search` stops after this many times the solve so far without a faster plan (unet 30% with
# a 60 s limit: 1.4660 in 43 s at 1x, 1.4483 in 57 s at 2x; both from 1.4990 at 20 s).
PIN_PATIENCE = 2.0
BOUND_END = 0.98  # the lower bound (last) ends by this share of the limit: the rest is the final simulation
SEARCH_DEADLINE = 0.85  # the search ends by this share of the limit, leaving the bound its tenth
# With the bound in a child process (`background`, when a second core is free and the limit is at
# least BACKGROUND_MIN_LIMIT seconds), the search runs until BACKGROUND_SEARCH_DEADLINE instead and
# the child has the whole limit less BACKGROUND_START seconds (to start Python and import
# `solvers`: 1-2 s).
BACKGROUND_MIN_LIMIT = 10.0
# ... and only on graphs of more than this many values to compute: on smaller ones the bound takes
# milliseconds here and the exact phase answers, while a child costs a core its interpreter's start
# (hundreds of tiny test problems spent CI minutes starting children).
BACKGROUND_MIN_VALUES = CHECKMATE_NODES
BACKGROUND_SEARCH_DEADLINE = 0.93
BACKGROUND_START = 1.5
# The search stops once its best plan is certified this close to optimal by a quick bound (the
# moments and LPs of `lower_bounds.lower_bound`, no MILP: 0.2 s on unet, 1.1 s on gpt12, within
# 0.7% of the full bound there), so that a small model is planned in seconds, not the limit.
EARLY_GAP = 0.005
QUICK_BOUND_SHARE = 0.05  # of the time limit, at most, for that bound
# Only graphs up to this many values try to stop early: on larger ones the quick bound costs
# seconds that the final bound spends again (gpt48: 3.8 s, and 1.0175 against the full 1.0621).
EARLY_STOP_MAX_VALUES = 1000
NEAR_MISS = 0.01  # a plan this much over budget is repaired on the spot
SHORTFALL_PENALTY = 1e4  # objective per unit of uncovered need (needs are scaled to <= 1)


# ----------------------------------------------------------------- drop plans
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
        preds, is_source = cp.preds, cp.lists().is_source
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


# -------------------------------------------------------------- covering ILP
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


@dataclass
class Candidate:
    group: int
    cost: float  # extra compute when dropped: one recomputation per later cluster with a direct use
    gaps: list[tuple[int, int, int]]  # (first stage, last stage, bytes released) per gap
    # Clusters made only of recomputation points of consumers, as (first stage, last stage,
    # bytes, consumers): a dropped group is recomputed (and held) there only when one of
    # those consumers is dropped too.
    potential: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    droppable: bool = True  # False: a group that cannot be recomputed, only paged out (host link)


@dataclass
class Penalty:
    """Keeping ``kept`` while ``dropped`` is recomputed holds ``kept`` over [start, stop]."""
    dropped: int  # candidate index
    kept: int  # candidate index, or -1 when that group can never be dropped
    start: int
    stop: int
    size: int


def candidates(planner: DropPlanner, chains: bool = True, pageable: Optional[bool] = None
               ) -> tuple[list[Candidate], list[Penalty]]:
    """Droppable groups and the penalties of keeping inputs of dropped ones. ``chains``: model the
    clusters made only of consumers' recomputation points as conditional (else as real uses).
    With ``pageable`` (default: the fine problem has a host link), groups that cannot be
    recomputed are candidates too, to be paged out only."""
    c, cp = planner.c, planner.cp
    fine = c.fine
    base = memory_of(fine, [])
    group_of = c.group_of
    last_read = [max(planner.recompute_points[h], default=h) if planner.droppable[h] else h for h in range(cp.n)]
    # Per fine value: the stage of its last reader outside its group. A kept input of a dropped
    # group is freed after that in the keep-all schedule, but must stay until the recomputation.
    last_use = [max((int(group_of[w]) for w in fine.succs[v] if group_of[w] != group_of[v]), default=-1)
                for v in range(fine.n)]
    out: list[Candidate] = []
    index: dict[int, int] = {}
    allow_paging = fine.has_host if pageable is None else pageable
    for g in cp.non_sources:
        cs = planner.clusters[g]
        if len(cs) < 2 or not (planner.droppable[g] or (allow_paging and not cp.is_sink[g])):
            continue
        members = c.members[g]
        direct = sorted(cp.succs[g])
        # Clusters with a direct use always recompute a dropped group; the others (made of
        # consumers' recomputation points only) only when one of those consumers is dropped too.
        real: list[tuple[int, int]] = []
        maybe: list[tuple[int, int, list[int]]] = []
        for a, b in cs:
            k = bisect_right(direct, b) - 1
            if not real or not chains or (k >= 0 and direct[k] >= a):
                real.append((a, b))
            else:
                maybe.append((a, b, [h for h in cp.succs[g] if planner.droppable[h]
                                     and any(a <= u <= b for u in planner.recompute_points[h])]))
        gaps = []
        for k in range(len(real) - 1):
            start, stop = real[k][1] + 1, real[k + 1][0] - 1
            if start > stop:
                continue
            # Members still read after the gap (directly or by a recomputation) are what keeping holds.
            later = [v for v in members
                     if any(last_read[group_of[w]] >= real[k + 1][0] for w in fine.succs[v] if group_of[w] != g)]
            size = held_memory(fine, later, base)
            if size > 0:
                gaps.append((start, stop, size))
        if gaps:
            held = max(s for _, _, s in gaps)
            # Recomputing the group brings back all its members for a moment, also those that
            # keep-all would already have freed by then (a multi-output op's big output).
            for a, _ in real[1:]:
                alive = [v for v in members if last_use[v] >= a]
                extra = int(cp.mem[g]) - held_memory(fine, alive, base)
                if extra > 0:
                    gaps.append((a, a, -extra))
            index[g] = len(out)
            out.append(Candidate(group=g, cost=float(cp.cost[g]) * (len(real) - 1), gaps=gaps,
                                 potential=[(a, b, held, hs) for a, b, hs in maybe],
                                 droppable=planner.droppable[g]))
    for cd in out:  # consumers as candidate indices (a consumer that is no candidate is never dropped)
        cd.potential = [(a, b, s, [index[h] for h in hs if h in index]) for a, b, s, hs in cd.potential]
        cd.potential = [p for p in cd.potential if p[3]]
    penalties: list[Penalty] = []
    for h, i in index.items():
        points = planner.recompute_points[h]
        if not points:
            continue
        point = max(points)
        for g in cp.preds[h]:
            if cp.is_source[g] or cp.is_sink[g]:
                continue  # always resident anyway
            late = [v for v in c.members[g]
                    if last_use[v] < point and any(group_of[w] == h for w in fine.succs[v])]
            if not late:
                continue
            size = held_memory(fine, late, base)
            if size > 0:
                start = min(last_use[v] for v in late) + 1
                penalties.append(Penalty(dropped=i, kept=index.get(g, -1), start=start, stop=point, size=size))
    return out, penalties


def pagings(planner: DropPlanner, cands: list[Candidate], problem: Problem) -> list[Paging]:
    """The ways of paging a candidate out across one of its gaps that free device memory for at
    least one stage, timed by keep-all's clock (the coarse costs in order): the copy out starts
    when the gap does, the copy in ends when it ends."""
    if not problem.has_host:
        return []
    cp = planner.cp
    clock = np.concatenate([[0.0], np.cumsum(cp.cost)])  # start of each stage; clock[s + 1] is its end
    offloadable, alias_of = problem.offloadable, problem.alias_of
    out: list[Paging] = []
    for i, cd in enumerate(cands):
        members = planner.c.members[cd.group]
        if not any(offloadable[v] or alias_of[v] >= 0 for v in members):
            continue
        for start, stop, size in cd.gaps:
            if size <= 0:
                continue  # the transient of a recomputation, not a gap
            copy = size / problem.host_bandwidth
            ready, due = float(clock[start]) + copy, float(clock[stop + 1]) - copy
            first = max(start, int(np.searchsorted(clock, ready, "left")))
            last = min(stop, int(np.searchsorted(clock, due, "right")) - 2)
            if first > last:
                continue  # the copies take longer than the gap
            out.append(Paging(cand=i, group=cd.group, first=first, last=last, size=size, probe=(first + last) // 2,
                              out_span=(float(clock[start]), ready), in_span=(due, float(clock[stop + 1]))))
    return out


def _link_rows(pages: list[Paging], clock: np.ndarray) -> list[tuple[float, list[tuple[int, float]]]]:
    """One row per stage and direction: the copies overlapping a stage fit in its duration
    (one copy at a time each way; a copy that would queue is not modelled, so forbid it)."""
    rows = []
    for span_of in (lambda p: p.out_span, lambda p: p.in_span):
        by_stage: dict[int, list[tuple[int, float]]] = {}
        for k, p in enumerate(pages):
            a, b = span_of(p)
            s = max(0, int(np.searchsorted(clock, a, "right")) - 1)
            while s + 1 < len(clock) and clock[s] < b:
                overlap = min(b, clock[s + 1]) - max(a, clock[s])
                if overlap > 0:
                    by_stage.setdefault(s, []).append((k, overlap))
                s += 1
        for s, terms in by_stage.items():
            duration = float(clock[s + 1] - clock[s])
            if sum(o for _, o in terms) > duration * (1 + 1e-9):
                rows.append((duration, terms))
    return rows


class CoverModel:
    """min sum(cost * x) s.t. for each chosen stage t: bytes released at t >= need(t).

    Released bytes: the gaps of dropped candidates, minus what a kept input of
    a dropped candidate holds until its recomputations (``z >= x_h - x_g``),
    plus the pagings chosen (``y``, only for kept candidates, within the host
    link's time and the host memory)."""

    def __init__(self, cands: list[Candidate], penalties: list[Penalty], n_stages: int, cost: np.ndarray,
                 pages: Optional[list[Paging]] = None, host_capacity: Optional[int] = None) -> None:
        self.cands = cands
        self.pages = pages or []
        self.host_capacity = host_capacity
        self.clock = np.concatenate([[0.0], np.cumsum(cost)])
        self.cost_of = cost
        self.penalties = penalties
        self.n_stages = n_stages
        self.starts = np.array([s for cd in cands for s, _, _ in cd.gaps], dtype=np.int64)
        self.stops = np.array([e for cd in cands for _, e, _ in cd.gaps], dtype=np.int64)
        self.sizes = np.array([b for cd in cands for _, _, b in cd.gaps], dtype=np.float64)
        self.owner = np.array([i for i, cd in enumerate(cands) for _ in cd.gaps], dtype=np.int64)
        pots = [(i, a, b, s, hs) for i, cd in enumerate(cands) for a, b, s, hs in cd.potential]
        self.pots = pots
        self.q_starts = np.array([a for _, a, _, _, _ in pots], dtype=np.int64)
        self.q_stops = np.array([b for _, _, b, _, _ in pots], dtype=np.int64)
        self.p_starts = np.array([p.start for p in penalties], dtype=np.int64)
        self.p_stops = np.array([p.stop for p in penalties], dtype=np.int64)
        self.p_sizes = np.array([p.size for p in penalties], dtype=np.float64)
        self.p_dropped = np.array([p.dropped for p in penalties], dtype=np.int64)
        self.p_kept = np.array([p.kept for p in penalties], dtype=np.int64)

    def released(self, x: np.ndarray, y: Optional[np.ndarray] = None) -> np.ndarray:
        """Bytes released at every stage by a 0/1 choice ``x`` (and pagings ``y``; linear model)."""
        diff = np.zeros(self.n_stages + 1, dtype=np.float64)
        if y is not None:
            for k in np.flatnonzero(y).tolist():
                p = self.pages[k]
                diff[p.first] += p.size
                diff[p.last + 1] -= p.size
        on = x[self.owner] > 0.5
        np.add.at(diff, self.starts[on], self.sizes[on])
        np.add.at(diff, self.stops[on] + 1, -self.sizes[on])
        if len(self.penalties):
            kept_dropped = np.where(self.p_kept >= 0, x[np.maximum(self.p_kept, 0)] > 0.5, False)
            act = (x[self.p_dropped] > 0.5) & ~kept_dropped
            np.add.at(diff, self.p_starts[act], -self.p_sizes[act])
            np.add.at(diff, self.p_stops[act] + 1, self.p_sizes[act])
        for i, a, b_, s, hs in self.pots:
            if x[i] > 0.5 and any(x[h] > 0.5 for h in hs):
                diff[a] -= s
                diff[b_ + 1] += s
        return np.cumsum(diff)[: self.n_stages]

    def solve(self, rows: dict[int, float], time_limit: float) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """Best 0/1 choice ``(x, y)`` covering ``rows`` (stage -> bytes needed), or None (no answer)."""
        b = BACKENDS["highs"]()
        xs = [b.bool_var() for _ in self.cands]
        ys = [b.bool_var() for _ in self.pages]
        for i, cd in enumerate(self.cands):
            if not cd.droppable:
                b.add([(xs[i], 1.0)], -math.inf, 0.0)
        for k, p in enumerate(self.pages):
            b.add([(xs[p.cand], 1.0), (ys[k], 1.0)], -math.inf, 1.0)  # a dropped group has nothing to page
        for duration, terms in _link_rows(self.pages, self.clock):
            b.add([(ys[k], o) for k, o in terms], -math.inf, duration)
        if self.host_capacity is not None and sum(p.size for p in self.pages) > self.host_capacity:
            # A host copy stays until the end of the step (the simulator's rule): one row for all.
            b.add([(ys[k], float(p.size)) for k, p in enumerate(self.pages)], -math.inf, float(self.host_capacity))
        p_first = np.array([p.first for p in self.pages], dtype=np.int64)
        p_last = np.array([p.last for p in self.pages], dtype=np.int64)
        zs: dict[int, int] = {}
        slacks: list[int] = []
        # w >= x_g + x_h - 1: a dropped group recomputed (and held) for a dropped consumer.
        ws: list[int] = []
        for i, a, b_, s, hs in self.pots:
            w = b.num_var(0.0, 1.0)
            ws.append(w)
            for h in hs:
                b.add([(w, 1.0), (xs[i], -1.0), (xs[h], -1.0)], -1.0, math.inf)
        scale = max(rows.values(), default=1.0) or 1.0
        for t, need in rows.items():
            terms: dict[int, float] = {}
            hit = np.flatnonzero((self.starts <= t) & (self.stops >= t))
            for i, v in zip(self.owner[hit].tolist(), self.sizes[hit].tolist()):
                terms[xs[i]] = terms.get(xs[i], 0.0) + v / scale
            for k in np.flatnonzero((p_first <= t) & (p_last >= t)).tolist():
                terms[ys[k]] = terms.get(ys[k], 0.0) + self.pages[k].size / scale
            if self.pots:
                for k in np.flatnonzero((self.q_starts <= t) & (self.q_stops >= t)).tolist():
                    terms[ws[k]] = terms.get(ws[k], 0.0) - self.pots[k][3] / scale
            if len(self.penalties):
                for k in np.flatnonzero((self.p_starts <= t) & (self.p_stops >= t)).tolist():
                    p = self.penalties[k]
                    if p.kept < 0:
                        var = xs[p.dropped]
                    else:
                        var = zs.get(k, -1)
                        if var < 0:
                            var = zs[k] = b.num_var(0.0, 1.0)
                            b.add([(var, 1.0), (xs[p.dropped], -1.0), (xs[p.kept], 1.0)], 0.0, math.inf)
                    terms[var] = terms.get(var, 0.0) - p.size / scale
            # Soft rows: a stage the linear model cannot cover still gets the most it can.
            short = b.num_var(0.0, math.inf)
            slacks.append(short)
            terms[short] = 1.0
            b.add(list(terms.items()), need / scale, math.inf)
        cmax = max((float(self.cost_of[cd.group]) for cd in self.cands), default=1.0) or 1.0
        # A tiny cost per drop keeps zero-cost groups from being dropped for nothing.
        objective = [(xs[i], cd.cost / cmax + 1e-6) for i, cd in enumerate(self.cands)]
        for k, (i, _, _, _, _) in enumerate(self.pots):
            objective.append((ws[k], float(self.cost_of[self.cands[i].group]) / cmax))
        # A page is free when its copies hide behind compute (the link rows see to that); a tiny
        # cost per second on the link keeps useless ones out.
        objective += [(ys[k], (p.out_span[1] - p.out_span[0]) * 1e-3 / cmax + 1e-7) for k, p in enumerate(self.pages)]
        objective += [(s, SHORTFALL_PENALTY) for s in slacks]
        b.minimize(objective, 0.0)
        raw = b.solve(max(0.05, time_limit), 1)
        if raw.status not in (RAW_OPTIMAL, RAW_FEASIBLE) or raw.values is None:
            return None
        return np.array([raw.values[h] for h in xs]) > 0.5, np.array([raw.values[h] for h in ys], dtype=float) > 0.5


@dataclass
class SearchLog:
    rounds: int = 0
    ilp_solves: int = 0
    simulations: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    closest: Optional[Evaluation] = None  # lowest peak seen among plans that do not fit
    floored: Optional[Evaluation] = None  # cheapest plan over the budget only at floors (`_floor_stages`)


def drop_search(planner: DropPlanner, budget: int, deadline: float, log: SearchLog,
                chains: bool = True, paging: bool = True) -> Optional[Evaluation]:
    """Covering ILP with simulator feedback; the fastest fitting evaluation found. With a host
    link on the fine problem (and ``paging``) the ILP also chooses pagings (keep / recompute /
    offload)."""
    fine = planner.c.fine
    paging = paging and fine.has_host
    cands, penalties = candidates(planner, chains, pageable=paging)
    if not cands:
        return None
    pages = pagings(planner, cands, fine) if paging else []
    model = CoverModel(cands, penalties, planner.cp.n, planner.cp.cost, pages, fine.host_capacity)
    modelled = [cd.cost for cd in cands]
    keep_all = planner.evaluate(frozenset())
    log.simulations += 1
    if keep_all.fits(budget):
        return keep_all
    if pages:
        pages = planner.realizable(keep_all, pages)
        model = CoverModel(cands, penalties, planner.cp.n, planner.cp.cost, pages, fine.host_capacity)
    base = keep_all.stage_peak.astype(np.float64)
    extra = np.zeros(planner.cp.n, dtype=np.float64)  # measured error of the linear model, per stage
    rows: dict[int, float] = {}
    best: Optional[Evaluation] = None
    closest: Optional[Evaluation] = None  # lowest peak among plans that do not fit
    seen: set[tuple[frozenset[int], tuple[int, ...]]] = set()
    x: Optional[np.ndarray] = None
    y: Optional[np.ndarray] = None
    target = budget  # what the linear model aims at; lowered when the ILP is stuck over budget
    margin_steps = 0
    # Per stage, a peak no drop can lower (nothing droppable resident at it: sources, gradients,
    # the inputs of the step). The model aims at it there instead of the budget, and plans over
    # budget only there are searched on like fitting ones and left to the caller's repair
    # (`repair.add_recomputations` can reorder and recompute what a drop plan cannot).
    floor = np.zeros(planner.cp.n, dtype=np.float64)
    by_group = {cd.group: cd for cd in cands}
    floored = False
    for _ in range(MAX_FEEDBACK_ROUNDS):
        if time.perf_counter() >= deadline:
            break
        log.rounds += 1
        # Row generation against the linear model (rows changed by the feedback force a solve).
        dirty = x is not None
        while time.perf_counter() < deadline:
            need = base + extra - np.maximum(target, floor)
            have = model.released(x, y) if x is not None else np.zeros_like(need)
            short = need - have
            violated = np.array([t for t in np.flatnonzero(short > 0.5).tolist()
                                 if rows.get(t, -1.0) < need[t] - 0.5], dtype=np.int64)
            if violated.size == 0 and not dirty:
                break  # covered, or only rows the ILP already has (soft rows it cannot cover)
            dirty = False
            top = violated[np.argsort(-short[violated])][:ROWS_PER_ROUND]
            for t in top.tolist():
                rows[t] = max(rows.get(t, 0.0), float(need[t]))
            remaining = deadline - time.perf_counter()
            x_new = model.solve(rows, min(remaining, max(1.0, remaining / 4)))
            log.ilp_solves += 1
            if x_new is None:
                return best
            x, y = x_new
        if x is None:
            break
        dropped = frozenset(cands[i].group for i in np.flatnonzero(x))
        paged = tuple(pages[k] for k in np.flatnonzero(y))
        key = (dropped, tuple(np.flatnonzero(y).tolist()))
        if key in seen:
            # The ILP repeats itself: the stages over budget cannot be covered locally. Aim
            # lower everywhere by the last overshoot (a few times), then give up.
            if best is not None or closest is None or margin_steps >= MAX_MARGIN_STEPS or floored:
                break
            margin_steps += 1
            target -= closest.peak - budget + budget // 1000
            for t in list(rows):
                rows[t] = float(base[t] + extra[t] - max(target, floor[t]))
            continue
        seen.add(key)
        ev = planner.evaluate(dropped, paged, deadline)
        log.simulations += 1
        log.history.append({"dropped": len(dropped), "paged": len(paged), "peak": ev.peak, "time": ev.time})
        for t, level in _floor_stages(planner, ev, by_group, np.maximum(budget, floor)).items():
            # What was fed back at t so far was this floor, not an error of the model.
            floor[t] = max(floor[t], float(level))
            extra[t] = 0.0
            if t in rows:
                rows[t] = float(base[t] - max(target, floor[t]))
        limit = np.maximum(budget, floor)
        floored = bool(np.all(ev.stage_peak <= limit))  # fits, or over only where no drop helps
        if not ev.fits(budget):
            if _closer(ev, closest, budget):
                closest = ev
            if _closer(ev, log.closest, budget):
                log.closest = ev
        if floored:
            if ev.fits(budget) and (best is None or ev.time < best.time):
                best = ev
            if not ev.fits(budget) and (log.floored is None or ev.time < log.floored.time):
                log.floored = ev
            # Cost feedback: a dropped group costs what its recomputations cost in the simulation
            # (chains of dropped inputs included); solve again with those costs.
            for i, cd in enumerate(cands):
                cd.cost = max(modelled[i], ev.charge.get(cd.group, 0.0)) if cd.group in dropped else modelled[i]
            continue  # x is set: the next round solves again
        if ev.peak <= budget * (1 + NEAR_MISS):
            # A few more drops at the peak usually close a near miss; cheaper than more ILP rounds.
            now = time.perf_counter()
            fixed = repair(planner, ev, cands, budget, now + 0.1 * max(0.0, deadline - now), log)
            if fixed is not None and (best is None or fixed.time < best.time):
                best = fixed
        over = np.flatnonzero(ev.stage_peak > limit)
        for t in over.tolist():
            extra[t] += float(ev.stage_peak[t] - limit[t])
            rows[t] = max(rows.get(t, 0.0), float(base[t] + extra[t] - max(target, floor[t])))
    if best is None and closest is not None:
        best = repair(planner, closest, cands, budget, deadline, log)
    return best


PEAK_TIE = 0.001  # over-budget plans whose peaks differ by less than this share of the budget tie


def _closer(ev: Evaluation, than: Optional[Evaluation], budget: int) -> bool:
    """Whether over-budget ``ev`` is a better plan to repair than ``than``: a lower peak, or a
    peak as low (within `PEAK_TIE`) at a lower cost. Plans often stall at one peak that no drop
    can lower (a step where only sources, gradients and the inputs of the step are resident);
    the cheapest of those is the one to hand to the repair."""
    if than is None:
        return True
    tie = PEAK_TIE * budget
    return ev.peak < than.peak - tie or (ev.peak <= than.peak + tie and ev.time < than.time)


def _droppable(planner: DropPlanner, resident: np.ndarray, dropped: frozenset[int],
               by_group: dict[int, Candidate], busy: frozenset[int] = frozenset()) -> list[int]:
    """Groups with a value in ``resident`` (a mask of fine values) that a drop could release:
    kept droppable candidates, less the ``busy`` ones."""
    groups = {int(g) for g in np.unique(planner.c.group_of[np.flatnonzero(resident)])} - dropped - busy
    return [g for g in groups if g in by_group and by_group[g].droppable]


def _droppable_at_peak(planner: DropPlanner, ev: Evaluation, by_group: dict[int, Candidate]) -> list[int]:
    """Groups resident at ``ev``'s peak step that a drop could release (kept droppable candidates)."""
    resident = resident_at(planner.c.fine, list(ev.schedule.steps), ev.peak_step).mask
    return _droppable(planner, resident, ev.dropped, by_group)


def _floor_stages(planner: DropPlanner, ev: Evaluation, by_group: dict[int, Candidate],
                  limit: np.ndarray) -> dict[int, int]:
    """Stages over ``limit`` whose peak step holds nothing a drop could release (sources,
    gradients, values that cannot be recomputed, the groups the step computes and reads),
    with their peaks: no drop set lowers them. One pass over the schedule."""
    over = set(np.flatnonzero(ev.stage_peak > limit).tolist())
    if not over or ev.step_stage is None:
        return {}
    fine, group_of = planner.c.fine, planner.c.group_of
    steps = ev.schedule.steps
    found: dict[int, int] = {}
    for k, mem in enumerate(residencies(fine, steps)):
        t = int(ev.step_stage[k])
        if t not in over or mem.total != ev.stage_peak[t]:
            continue
        over.discard(t)
        op, node = steps[k]
        busy: frozenset[int] = frozenset()
        if op is Op.COMPUTE:
            v = fine.index[node]
            busy = frozenset(int(group_of[u]) for u in (v, *fine.preds[v]))
        if not _droppable(planner, mem.mask, ev.dropped, by_group, busy):
            found[t] = int(ev.stage_peak[t])
        if not over:
            break
    return found


def repair(planner: DropPlanner, ev: Evaluation, cands: list[Candidate], budget: int, deadline: float,
           log: SearchLog) -> Optional[Evaluation]:
    """Drop more, guided by the simulator: groups resident at the peak, most bytes per cost first."""
    by_group = {cd.group: cd for cd in cands}
    while not ev.fits(budget) and time.perf_counter() < deadline:
        scored = sorted(_droppable_at_peak(planner, ev, by_group),
                        key=lambda g: -max(s for _, _, s in by_group[g].gaps) / (by_group[g].cost + 1e-12))
        if not scored:
            return None
        excess, freed, extra = ev.peak - budget, 0, set()
        for g in scored:
            extra.add(g)
            freed += max(s for _, _, s in by_group[g].gaps)
            if freed >= excess:
                break
        ev = planner.evaluate(ev.dropped | extra, tuple(p for p in ev.paged if p.group not in extra), deadline)
        log.simulations += 1
        log.history.append({"repair": len(extra), "peak": ev.peak, "time": ev.time})
    return ev if ev.fits(budget) else None


def keep_again(planner: DropPlanner, best: Evaluation, budget: int, deadline: float, log: SearchLog) -> Evaluation:
    """Undo drops, costliest first, while the simulator still fits and the step is no slower."""
    cp = planner.cp
    order = sorted(best.dropped, key=lambda g: -float(cp.cost[g]))
    for g in order:
        if time.perf_counter() >= deadline:
            break
        ev = planner.evaluate(best.dropped - {g}, best.paged, deadline)
        log.simulations += 1
        if ev.fits(budget) and ev.time <= best.time:
            best = ev
    return best


# ------------------------------------------------------------------- method
@dataclass
class _Incumbent:
    """The fastest fitting plan found so far, and the fastest without host transfers (where
    `pin_search` starts: it moves recomputations, not copies)."""

    schedule: Optional[Schedule] = None
    time: float = math.inf
    label: Optional[str] = None
    remat: Optional[tuple[Schedule, float, str]] = None

    def offer(self, schedule: Schedule, step_time: float, label: str) -> bool:
        """Keep ``schedule`` (which fits) if it is faster; True when it is the best plan now."""
        if not schedule.has_transfers() and (self.remat is None or step_time < self.remat[1]):
            self.remat = (schedule, step_time, label)
        if step_time < self.time:
            self.schedule, self.time, self.label = schedule, step_time, label
            return True
        return False


def _descent(problem: Problem, schedule: Schedule, end: float, stops: tuple[float, ...] = DESCENT
             ) -> Optional[tuple[Schedule, float]]:
    """``schedule`` recomputed down to the budget through ``stops`` (`repair.recompute_down`),
    then polished, with its simulated step time; None when it does not fit by ``end``.

    Where views share one storage (`Problem.same_storage`), the descent is also run with each
    view counted on its own (`Problem.with_views_apart`): its plans fit the problem too, and
    the greedy steps it takes differ. Neither is better everywhere (store-all descents on
    gpt48 at 30%: 1.1717 of total cost views apart, 1.2148 shared; unet at 30%: 1.6397
    apart, 1.6158 shared), so the faster plan is kept."""
    found = None
    for guide in dict.fromkeys((problem.with_views_apart(), problem)):
        down = recompute_down(guide, schedule, end, stops)
        if not simulate(guide, down).fits:
            continue
        polished = keep_recomputed(problem, down, end)
        step_time = simulate(problem, polished).time
        if found is None or step_time < found[1]:
            found = polished, step_time
    return found


def _random_stops(rng: random.Random) -> tuple[float, ...]:
    """Stops for `repair.recompute_down`: one to eight shares of the way, decreasing, then 0."""
    return tuple(sorted({round(rng.random(), 2) for _ in range(rng.randint(1, 8))}, reverse=True)) + (0.0,)


def _bound(problem: Problem, time_limit: float, milp: bool = True) -> tuple[float, str]:
    """Best available lower bound valid for every schedule: the plug-in point for tighter bounds.
    ``milp=False``: only the quick relaxations (no MILP)."""
    try:
        from ..methods.lower_bounds import lower_bound  # another module; may be absent
    except ImportError:
        return problem.total_cost(), "total_cost"
    try:
        value = float(lower_bound(problem, time_limit, milp=milp))
    except Exception:  # another module's failure must not sink a valid schedule
        return problem.total_cost(), "total_cost"
    if not math.isfinite(value):
        return problem.total_cost(), "total_cost"
    return max(value, problem.total_cost()), "lower_bounds.lower_bound"


def solve_hierarchical(problem: Problem, time_limit: Optional[float] = None, *, exact: bool = True,
                       seeds: Sequence[tuple[Schedule, str]] = ()) -> Solution:
    """The search ends early once its best plan is within `EARLY_GAP` of a quick lower bound.
    ``exact=False`` leaves out the exact phase for small graphs (to measure the drop search alone).
    ``seeds``: plans made elsewhere (`offload.solve_offload`'s paged descents), each with a label;
    those that fit join the baselines, so that the search is measured against them."""
    started = time.perf_counter()
    limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    deadline = started + SEARCH_DEADLINE * limit  # leave room for the final simulation and the bound
    info: dict[str, Any] = {}
    budget = problem.budget
    clock: dict[str, float] = {}  # phase -> seconds since the start when it ended (where the time went)

    def lap(phase: str) -> None:
        clock[phase] = round(time.perf_counter() - started, 3)

    quick_bound: list[float] = []  # computed once, when the first plan fits

    def near_quick_bound(cost: float) -> bool:
        return bool(quick_bound) and cost <= quick_bound[0] * (1 + EARLY_GAP)

    def certified() -> bool:
        """Whether the best plan is within `EARLY_GAP` of a lower bound: the search can stop."""
        if best.schedule is None or problem.n > EARLY_STOP_MAX_VALUES:
            return False
        if not quick_bound:
            quick_bound.append(_bound(problem, QUICK_BOUND_SHARE * limit, milp=False)[0])
            info["quick_bound"] = quick_bound[0]
        if not near_quick_bound(best.time):
            return False
        info.setdefault("certified_at", round(time.perf_counter() - started, 3))
        return True

    # Fast baselines first: a schedule to return whatever happens next.
    quick: list[Solution] = []
    for method in portfolio(METHOD_INFOS, RACE):
        name = method.name
        try:
            quick.append(method.solve(problem, max(0.5, 0.1 * limit)))
        except MethodFailed:
            continue
        if name == "store_all" and quick[-1].fits:
            info["chosen"] = "store_all"
            return finish(problem, quick[-1].schedule, "hierarchical", started, lower_bound=problem.total_cost(),
                          info=info)
    lap("baselines")
    # The lower bound on a second core while the search goes on: then the search, not the bound,
    # has the end of the time limit (`background`).
    background = None
    if (limit >= BACKGROUND_MIN_LIMIT and problem.n_compute > BACKGROUND_MIN_VALUES and not problem.has_host
            and usable_cores() >= 2):
        child_limit = started + BOUND_END * limit - time.perf_counter() - BACKGROUND_START
        background = BackgroundBound.start(problem, child_limit)
        if background is not None:
            deadline = started + BACKGROUND_SEARCH_DEADLINE * limit
    info["bound_in_background"] = background is not None
    fitting = [s for s in quick if s.fits]
    best = _Incumbent()
    for s in fitting:
        best.offer(s.schedule, s.objective, s.method)
    for schedule, label in seeds:
        result = simulate(problem, schedule)
        if result.fits:
            best.offer(schedule, result.time, label)
    info["baseline_cost"] = best.time
    # Each baseline polished (milliseconds): the ranking can change once their models' slack is used.
    for s in fitting:
        polished = keep_recomputed(problem, s.schedule, started + 0.2 * limit)
        if polished is not s.schedule:
            result = simulate(problem, polished)
            best.offer(polished, result.time, s.method + " (polished)")
    # Store-all recomputed down to the budget in steps (a second or so), then polished: often
    # the best plan on CNNs and U-Nets (unet 50%: 1.1597 of total cost, rotor 1.1846).
    store_all = next((s for s in quick if s.method == "store_all"), None)
    if store_all is not None:
        found = _descent(problem, store_all.schedule, started + DESCENT_END * limit)
        if found is not None:
            info["descent"] = found[1]
            best.offer(*found, "store_all (recomputed down)")
    info["baseline_polished"] = best.time
    lap("descent")

    t0 = time.perf_counter()
    c = coarsen(problem)
    info["coarse_nodes"] = c.coarse.n_compute
    info["coarsen_time"] = round(time.perf_counter() - t0, 3)
    # A small portfolio of models: cluster gaps and the two readings of recomputation chains.
    # Each run is cheap; the cheapest fitting plan is then polished by `keep_again`.
    log = SearchLog()
    t0 = time.perf_counter()
    results: list[tuple[DropPlanner, Evaluation, str]] = []
    planners: dict[int, DropPlanner] = {}
    tried = []
    search_end = started + SEARCH_SHARE * (deadline - started)
    # Second pass (the first two variants again, from scratch, until `SEARCH_END` of the limit)
    # only when nothing fits yet: polishing is worth nothing without a plan.
    # With a host link every model is run without pagings (the remat-only search, quicker per
    # round) and then with them. The paging runs stop at the first whose plan is not faster than
    # the best plan so far: each takes 5-7x a remat-only run (unet 30%: 1.0-1.4 s against 0.2 s),
    # time the descents and `pin_search` turn into faster plans where paging does not pay.
    # Models that round to the same cluster gap on a small graph are run once.
    variants = list(dict.fromkeys(
        (max(1, int(c.coarse.n * f)), ch, paging)
        for f, ch in VARIANTS for paging in ((False, True) if problem.has_host else (False,))))
    paging_pays = True  # until a paging run finds a plan, but none faster than the best so far
    for k, (gap, chains, paging) in enumerate(variants + variants[:2]):
        now = time.perf_counter()
        second_pass = k >= len(variants)
        if (second_pass and results) or certified():
            break
        if paging and not paging_pays:
            continue
        # Nothing fits yet: search on, but leave the repairs their share.
        end = started + SEARCH_END * limit if (second_pass or not results) and now >= search_end else search_end
        if now >= end:
            if second_pass or results:
                break
            continue
        if gap not in planners:
            planners[gap] = DropPlanner(c, gap)
        planner = planners[gap]
        # Two thirds of the window to the first variant (it ends early once its ILP repeats itself),
        # then half of what is left to each next one (later ones get what the earlier ones leave).
        share = max(0.5, (end - now) * (FIRST_SHARE if k == 0 else 0.5))
        so_far = min([best.time] + [r[1].time for r in results])
        found = drop_search(planner, budget, min(end, now + share), log, chains=chains, paging=paging)
        label = f"gap={gap},chains={int(chains)}" + (",paging" if paging else "") + (",again" if second_pass else "")
        tried.append({"variant": label, "step_time": None if found is None else found.time,
                      "time": round(time.perf_counter() - now, 2)})
        if found is not None:
            results.append((planner, found, label))
        if paging and found is not None:  # no plan at all says little: the next model may find one
            paging_pays = found.time < so_far
    info["variants"] = tried
    lap("drop_search")
    info["ilp_time"] = round(time.perf_counter() - t0, 3)
    if results:
        results.sort(key=lambda r: r[1].time)
        info["ilp_time_found"] = results[0][1].time
        t0 = time.perf_counter()
        for planner, found, label in results[:POLISHED]:
            if time.perf_counter() >= deadline or found.time > KEEP_AGAIN_REACH * best.time or certified():
                break
            found = keep_again(planner, found, budget, deadline, log)
            if best.offer(found.schedule, found.time, "drop_ilp"):
                info["variant"] = label
                info["keep_again_step_time"] = found.time
        info["keep_again_time"] = round(time.perf_counter() - t0, 3)
        lap("keep_again")
    info.update(rounds=log.rounds, ilp_solves=log.ilp_solves, simulations=log.simulations)

    # Small graphs: the exact search, or Checkmate on the fine or coarse graph, with the time left.
    exact_bound = -math.inf
    remaining = deadline - time.perf_counter()
    if not exact or certified():
        pass
    elif problem.n_compute <= EXACT_NODES:
        try:
            sol = solve_exhaustive(problem, remaining)
            info["exact"] = sol.status
            if sol.fits:
                best.offer(sol.schedule, sol.objective, "exhaustive")
            if sol.fits and sol.lower_bound is not None:
                exact_bound = sol.lower_bound
        except MethodFailed:
            pass
    elif remaining > 0.5 and min(problem.n_compute, c.coarse.n_compute) <= CHECKMATE_NODES:
        on_fine = problem.n_compute <= CHECKMATE_NODES
        target = problem if on_fine else c.coarse
        sol = solve_checkmate(target, remaining)
        schedule = sol.schedule if on_fine else c.fine_schedule_of(sol.schedule)
        result = simulate(problem, schedule)
        info["checkmate"] = {"graph": "fine" if on_fine else "coarse", "status": sol.status, "cost": result.cost}
        if result.fits:
            best.offer(schedule, result.time, "checkmate_" + ("fine" if on_fine else "coarse"))

    # Plans over the budget that cost less than the best fitting one (rotor's chain model and the
    # drop ILP miss tight budgets, often by little): repaired by recomputation, then polished.
    over = [(s.peak, s.objective, s.schedule, s.method) for s in quick if not s.fits]
    if log.closest is not None:
        over.append((log.closest.peak, log.closest.time, log.closest.schedule, "drop_ilp (closest)"))
    if log.floored is not None and log.floored is not log.closest:
        over.append((log.floored.peak, log.floored.time, log.floored.schedule, "drop_ilp (floored)"))
    over = [e for e in sorted(over, key=lambda e: e[:2]) if e[1] < best.time]  # nearest the budget first
    repairs = []
    repair_end = started + REPAIR_END * limit
    for i, (_, cost, schedule, label) in enumerate(over):
        now = time.perf_counter()
        if cost >= best.time or now >= repair_end or certified():
            continue
        fixed = add_recomputations(problem, schedule, now + (repair_end - now) / (len(over) - i))
        result = simulate(problem, fixed)
        repairs.append({"from": label, "fits": result.fits, "time": result.time})
        if result.fits:
            best.offer(fixed, result.time, label + " (repaired)")
    if repairs:
        info["repairs"] = repairs
    lap("exact_and_repairs")

    # Time left: store-all recomputed down through other stops. The stepwise repair is greedy and
    # where it ends depends much on the stops (unet 30%: 1.56 to 2.05 of total cost over 40 stop
    # sets), so more descents are a cheap search; seeded, so a run is reproducible. They take at
    # most as long again as the solve so far: a quick answer stays quick.
    if store_all is not None and best.schedule is not None:
        rng = random.Random(0)
        fitting_descents = 0
        now = time.perf_counter()
        descents_end = min(now + MORE_DESCENTS_SHARE * (deadline - now), now + (now - started))
        for _ in range(MORE_DESCENTS):
            if time.perf_counter() >= descents_end or certified():
                break
            stops = _random_stops(rng)
            found = _descent(problem, store_all.schedule, descents_end, stops)
            if found is None:
                continue
            fitting_descents += 1
            if best.offer(*found, "store_all (recomputed down, other stops)"):
                info["descent_stops"] = stops
        info["more_descents"] = fitting_descents
        lap("more_descents")

    # The rest of the search time: pin what the best plan recomputes, repairing elsewhere. It
    # stops once it has gone `PIN_PATIENCE` times as long as the solve so far without finding a
    # faster plan: a quick answer stays quick, and a long time limit buys more search where it
    # keeps paying.
    # With a host link it starts from the fastest plan without copies, which may then win.
    if best.remat is not None and time.perf_counter() < deadline and not certified():
        t0 = time.perf_counter()
        start, start_time, start_label = best.remat
        pinned = pin_search(problem, start, deadline, patience=PIN_PATIENCE * (t0 - started))
        if pinned is not start:
            after = simulate(problem, pinned).time
            info["pin_search"] = {"before": start_time, "after": after, "time": round(time.perf_counter() - t0, 3)}
            best.offer(pinned, after, f"{start_label} (pinned)")
        lap("pin_search")

    best_schedule, best_cost, chosen = best.schedule, best.time, best.label
    if best_schedule is None:
        # Nothing fits yet: the other constructive baselines if time allows, then the lowest peak.
        pool: list[tuple[int, float, Schedule, str]] = [(s.peak, s.cost, s.schedule, s.method) for s in quick]
        if log.closest is not None:
            pool.append((log.closest.peak, log.closest.cost, log.closest.schedule, "drop_ilp (closest)"))
        for name, solve in (("sqrt_n", solve_sqrt_n),):  # recompute_all: minutes on gpt12, never better
            if time.perf_counter() >= started + 0.5 * limit:
                break  # seconds on large graphs
            try:
                s = solve(problem, None)
            except MethodFailed:
                continue
            pool.append((s.peak, s.cost, s.schedule, name))
        fitting = [e for e in pool if e[0] <= budget]
        pick = min(fitting, key=lambda e: e[1]) if fitting else min(pool, key=lambda e: (e[0], e[1]))
        best_schedule, chosen = pick[2], pick[3]  # over budget when nothing fits: the caller sees it
    if best_schedule is not None and best_cost < math.inf:
        # The winner was planned in some model (rotor's chain, the stages); undo the
        # recomputations the real budget does not need.
        t0 = time.perf_counter()
        polished = keep_recomputed(problem, best_schedule, started + 0.95 * limit)
        if polished is not best_schedule:
            info["polished"] = {"before": best_cost, "time": round(time.perf_counter() - t0, 3)}
            best_schedule = polished
    info["chosen"] = chosen
    t0 = time.perf_counter()
    if near_quick_bound(best_cost):
        bound, bound_source = quick_bound[0], "lower_bounds.lower_bound (quick)"  # certified: done
        if background is not None:
            background.close()
    else:
        # A search that used its time waits for the child, which has had all of it. One that ended
        # early takes what the child has proved so far and computes the bound here as before, so
        # that it still answers early (a child starved by other work would make it wait).
        waited = background is not None and time.perf_counter() >= deadline
        until = started + BOUND_END * limit if waited else time.perf_counter()
        value = None if background is None else background.result(until)
        proved = value if value is not None and math.isfinite(value) else None
        if proved is not None and waited:
            bound, bound_source = max(proved, problem.total_cost()), "lower_bounds.lower_bound (background)"
        else:
            left = started + BOUND_END * limit - time.perf_counter()
            bound, bound_source = _bound(problem, max(0.1, min(0.1 * limit, left)))
            if proved is not None and proved > bound:
                bound, bound_source = proved, "lower_bounds.lower_bound (background)"
        if quick_bound and quick_bound[0] > bound:
            bound, bound_source = quick_bound[0], "lower_bounds.lower_bound (quick)"
    info["bound_time"] = round(time.perf_counter() - t0, 3)
    lap("bound")
    info["clock"] = clock
    if exact_bound > bound:
        bound, bound_source = exact_bound, "exhaustive"
    cost = simulate(problem, best_schedule).cost
    if bound > cost * (1 + 1e-6):  # a bound above a simulated schedule is wrong: do not pass it on
        info["bound_rejected"] = bound
        bound, bound_source = problem.total_cost(), "total_cost"
    info["bound_from"] = bound_source
    sol = finish(problem, best_schedule, "hierarchical", started, lower_bound=bound, status=FEASIBLE, info=info)
    return sol
