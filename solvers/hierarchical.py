"""Method "hierarchical": near-optimal drop plans for graphs of thousands of values.

Three layers, each cheap on its own:

1. `coarsen` folds views and cheap chains into their producers (gpt12:
   1957 values to compute become 793 groups). Decisions are taken per group.
2. A plan is a *drop set* of groups: values are computed in the problem's
   order; a dropped group is released after each cluster of its uses and
   recomputed (with any dropped input that is not available) right before
   the next cluster. Kept groups live until their last use. Expanded to the
   fine problem and placed by `plan.schedule_from_sequence`, every plan is
   a valid schedule; the fine simulator measures its peak and cost.
3. Which groups to drop is a covering ILP (HiGHS): dropping group g costs
   its recomputations and lowers the memory by its size over the gaps
   between its use clusters; every stage where the keep-all schedule is over
   the budget must be brought down to it. The ILP sees a linear picture
   (no transient memory of recomputations, no chains of recomputed inputs),
   so its answer is replayed by the simulator, and the stages still over the
   budget get the measured excess added to their requirement (row
   generation on the measured error), until the simulator accepts the plan.
   A final pass keeps again dropped groups whose recomputation costs the
   most, while the simulator still fits.

The result is always a simulated schedule: when nothing in this search
fits, the best constructive baseline (or the minimum-budget schedule) is
returned. ``lower_bound``: `solvers.lower_bounds.lower_bound` when that
module is present (valid for every schedule), else the sum of all costs.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .bounds import min_budget_cached
from .coarsen import Coarsening, coarsen
from .memory import memory_of
from .milp_backends import BACKENDS, RAW_FEASIBLE, RAW_OPTIMAL
from .plan import schedule_from_sequence
from .portfolio import best_constructive
from .problem import Problem
from .schedule import Op, Schedule, simulate
from .greedy import solve_greedy
from .select import solve_select
from .solution import FEASIBLE, MethodFailed, Solution, finish
from .store_all import solve_store_all

DEFAULT_TIME_LIMIT = 30.0
CLUSTER_GAP_FRACTION = 1 / 50  # uses further apart than this share of the groups start a new cluster
ROWS_PER_ROUND = 40  # violated stages added to the ILP per round of row generation
MAX_FEEDBACK_ROUNDS = 60
SHORTFALL_PENALTY = 1e4  # objective per unit of uncovered need (needs are scaled to <= 1)


# ----------------------------------------------------------------- drop plans
@dataclass
class Evaluation:
    dropped: frozenset[int]
    schedule: Schedule
    cost: float
    peak: int
    stage_peak: np.ndarray  # fine memory peak per coarse stage (coarse index)

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
            groups: list[tuple[int, int]] = []
            for u in sorted(uses):
                if groups and u - groups[-1][1] <= gap:
                    groups[-1] = (groups[-1][0], u)
                else:
                    groups.append((u, u))
            self.clusters[g] = groups
            self.recompute_points[g] = [a for a, _ in groups[1:]]
        self.last_direct = [max(cp.succs[g], default=g) for g in range(cp.n)]
        self.firsts = [[a for a, _ in cs] for cs in self.clusters]

    def _cluster_end(self, g: int, position: int) -> int:
        k = max(0, bisect_right(self.firsts[g], position) - 1)
        cs = self.clusters[g]
        return cs[k][1] if cs else position

    def sequence(self, dropped: frozenset[int]) -> tuple[list[int], list[int]]:
        """Coarse compute sequence and the stage (coarse index served) of each compute."""
        cp = self.cp
        preds, is_source = cp.preds, cp.lists().is_source
        alive_until: dict[int, int] = {}
        seq: list[int] = []
        stage: list[int] = []
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
            for u in missing:
                seq.append(u)
                stage.append(v)
                alive_until[u] = max(v, self._cluster_end(u, v))
            seq.append(v)
            stage.append(v)
            if v in dropped:
                alive_until[v] = self._cluster_end(v, v + 1) if self.clusters[v] else v
        return seq, stage

    def evaluate(self, dropped: frozenset[int]) -> Evaluation:
        c = self.c
        seq, stage = self.sequence(dropped)
        fine_seq: list[int] = []
        fine_stage: list[int] = []
        for g, s in zip(seq, stage):
            ms = c.members[g]
            fine_seq.extend(ms)
            fine_stage.extend([s] * len(ms))
        schedule = schedule_from_sequence(c.fine, fine_seq)
        result = simulate(c.fine, schedule)
        step_stage = np.empty(len(schedule), dtype=np.int64)
        k = -1
        for i, (op, _) in enumerate(schedule.steps):
            if op is Op.COMPUTE:
                k += 1
            step_stage[i] = fine_stage[max(k, 0)]
        stage_peak = np.full(self.cp.n, result.initial, dtype=np.int64)
        np.maximum.at(stage_peak, step_stage, result.timeline)
        return Evaluation(dropped=dropped, schedule=schedule, cost=result.cost, peak=result.peak,
                          stage_peak=stage_peak)


# -------------------------------------------------------------- covering ILP
@dataclass
class Candidate:
    group: int
    cost: float  # extra compute when dropped (one recomputation per extra cluster)
    gaps: list[tuple[int, int, int]]  # (first stage, last stage, bytes released) per gap


@dataclass
class Penalty:
    """Keeping ``kept`` while ``dropped`` is recomputed holds ``kept`` over [start, stop]."""
    dropped: int  # candidate index
    kept: int  # candidate index, or -1 when that group can never be dropped
    start: int
    stop: int
    size: int


def candidates(planner: DropPlanner) -> tuple[list[Candidate], list[Penalty]]:
    c, cp = planner.c, planner.cp
    fine = c.fine
    base = memory_of(fine, [])
    group_of = c.group_of
    last_read = [max(planner.recompute_points[h], default=h) if planner.droppable[h] else h for h in range(cp.n)]
    out: list[Candidate] = []
    index: dict[int, int] = {}
    for g in cp.non_sources:
        cs = planner.clusters[g]
        if len(cs) < 2 or not planner.droppable[g]:
            continue
        members = c.members[g]
        gaps = []
        for k in range(len(cs) - 1):
            start, stop = cs[k][1] + 1, cs[k + 1][0] - 1
            if start > stop:
                continue
            # Members still read after the gap (directly or by a recomputation) are what keeping holds.
            later = [v for v in members
                     if any(last_read[group_of[w]] >= cs[k + 1][0] for w in fine.succs[v] if group_of[w] != g)]
            size = memory_of(fine, later) - base
            if size > 0:
                gaps.append((start, stop, size))
        if gaps:
            index[g] = len(out)
            out.append(Candidate(group=g, cost=float(cp.cost[g]) * (len(cs) - 1), gaps=gaps))
    penalties: list[Penalty] = []
    for h, i in index.items():
        points = planner.recompute_points[h]
        if not points:
            continue
        for g in cp.preds[h]:
            if cp.is_source[g] or cp.is_sink[g]:
                continue  # always resident anyway
            end = planner.last_direct[g]
            if max(points) <= end:
                continue
            read = [v for v in c.members[g] if any(group_of[w] == h for w in fine.succs[v])]
            size = memory_of(fine, read) - base
            if size > 0:
                penalties.append(Penalty(dropped=i, kept=index.get(g, -1), start=end + 1, stop=max(points), size=size))
    return out, penalties


class CoverModel:
    """min sum(cost * x) s.t. for each chosen stage t: bytes released at t >= need(t).

    Released bytes: the gaps of dropped candidates, minus what a kept input of
    a dropped candidate holds until its recomputations (``z >= x_h - x_g``)."""

    def __init__(self, cands: list[Candidate], penalties: list[Penalty], n_stages: int) -> None:
        self.cands = cands
        self.penalties = penalties
        self.n_stages = n_stages
        self.starts = np.array([s for cd in cands for s, _, _ in cd.gaps], dtype=np.int64)
        self.stops = np.array([e for cd in cands for _, e, _ in cd.gaps], dtype=np.int64)
        self.sizes = np.array([b for cd in cands for _, _, b in cd.gaps], dtype=np.float64)
        self.owner = np.array([i for i, cd in enumerate(cands) for _ in cd.gaps], dtype=np.int64)
        self.p_starts = np.array([p.start for p in penalties], dtype=np.int64)
        self.p_stops = np.array([p.stop for p in penalties], dtype=np.int64)
        self.p_sizes = np.array([p.size for p in penalties], dtype=np.float64)
        self.p_dropped = np.array([p.dropped for p in penalties], dtype=np.int64)
        self.p_kept = np.array([p.kept for p in penalties], dtype=np.int64)

    def released(self, x: np.ndarray) -> np.ndarray:
        """Bytes released at every stage by a 0/1 choice ``x`` (linear model)."""
        diff = np.zeros(self.n_stages + 1, dtype=np.float64)
        on = x[self.owner] > 0.5
        np.add.at(diff, self.starts[on], self.sizes[on])
        np.add.at(diff, self.stops[on] + 1, -self.sizes[on])
        if len(self.penalties):
            kept_dropped = np.where(self.p_kept >= 0, x[np.maximum(self.p_kept, 0)] > 0.5, False)
            act = (x[self.p_dropped] > 0.5) & ~kept_dropped
            np.add.at(diff, self.p_starts[act], -self.p_sizes[act])
            np.add.at(diff, self.p_stops[act] + 1, self.p_sizes[act])
        return np.cumsum(diff)[: self.n_stages]

    def solve(self, rows: dict[int, float], time_limit: float, hint: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """Best 0/1 choice covering ``rows`` (stage -> bytes needed), or None (infeasible / no answer)."""
        b = BACKENDS["highs"]()
        xs = [b.bool_var() for _ in self.cands]
        zs: dict[int, int] = {}
        slacks: list[int] = []
        scale = max(rows.values(), default=1.0) or 1.0
        for t, need in rows.items():
            terms: dict[int, float] = {}
            hit = np.flatnonzero((self.starts <= t) & (self.stops >= t))
            for i, v in zip(self.owner[hit].tolist(), self.sizes[hit].tolist()):
                terms[xs[i]] = terms.get(xs[i], 0.0) + v / scale
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
        cmax = max((cd.cost for cd in self.cands), default=1.0) or 1.0
        # A tiny cost per drop keeps zero-cost groups from being dropped for nothing.
        objective = [(xs[i], cd.cost / cmax + 1e-6) for i, cd in enumerate(self.cands)]
        objective += [(s, SHORTFALL_PENALTY) for s in slacks]
        b.minimize(objective, 0.0)
        raw = b.solve(max(0.05, time_limit), 1)
        if raw.status not in (RAW_OPTIMAL, RAW_FEASIBLE) or raw.values is None:
            return None
        return np.array([raw.values[h] for h in xs]) > 0.5


@dataclass
class SearchLog:
    rounds: int = 0
    ilp_solves: int = 0
    simulations: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def drop_search(planner: DropPlanner, budget: int, deadline: float, log: SearchLog) -> Optional[Evaluation]:
    """Covering ILP with simulator feedback; the cheapest fitting evaluation found."""
    cands, penalties = candidates(planner)
    if not cands:
        return None
    model = CoverModel(cands, penalties, planner.cp.n)
    keep_all = planner.evaluate(frozenset())
    log.simulations += 1
    if keep_all.fits(budget):
        return keep_all
    base = keep_all.stage_peak.astype(np.float64)
    extra = np.zeros(planner.cp.n, dtype=np.float64)  # measured error of the linear model, per stage
    rows: dict[int, float] = {}
    best: Optional[Evaluation] = None
    x: Optional[np.ndarray] = None
    for _ in range(MAX_FEEDBACK_ROUNDS):
        if time.perf_counter() >= deadline:
            break
        log.rounds += 1
        # Row generation against the linear model (rows changed by the feedback force a solve).
        dirty = x is not None
        while time.perf_counter() < deadline:
            need = base + extra - budget
            have = model.released(x) if x is not None else np.zeros_like(need)
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
            x_new = model.solve(rows, min(remaining, max(1.0, remaining / 4)), x)
            log.ilp_solves += 1
            if x_new is None:
                return best
            x = x_new
        if x is None:
            break
        dropped = frozenset(cands[i].group for i in np.flatnonzero(x))
        ev = planner.evaluate(dropped)
        log.simulations += 1
        log.history.append({"dropped": len(dropped), "peak": ev.peak, "cost": ev.cost})
        if ev.fits(budget):
            if best is None or ev.cost < best.cost:
                best = ev
            break
        over = np.flatnonzero(ev.stage_peak > budget)
        for t in over.tolist():
            extra[t] += float(ev.stage_peak[t] - budget)
            rows[t] = max(rows.get(t, 0.0), float(base[t] + extra[t] - budget))
    return best


def keep_again(planner: DropPlanner, best: Evaluation, budget: int, deadline: float, log: SearchLog) -> Evaluation:
    """Undo drops, costliest first, while the simulator still fits."""
    cp = planner.cp
    order = sorted(best.dropped, key=lambda g: -float(cp.cost[g]) * (len(planner.clusters[g]) - 1))
    for g in order:
        if time.perf_counter() >= deadline:
            break
        ev = planner.evaluate(best.dropped - {g})
        log.simulations += 1
        if ev.fits(budget) and ev.cost <= best.cost:
            best = ev
    return best


# ------------------------------------------------------------------- method
def _bound(problem: Problem, time_limit: float) -> tuple[float, str]:
    """Best available lower bound valid for every schedule: the plug-in point for tighter bounds."""
    try:
        from .lower_bounds import lower_bound  # another module; may be absent
    except ImportError:
        return problem.total_cost(), "total_cost"
    try:
        value = float(lower_bound(problem, time_limit))
    except TypeError:
        value = float(lower_bound(problem))
    if not math.isfinite(value):
        return problem.total_cost(), "total_cost"
    return max(value, problem.total_cost()), "lower_bounds.lower_bound"


def solve_hierarchical(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    deadline = started + 0.9 * limit  # leave room for the final simulation and the bound
    info: dict[str, Any] = {}
    budget = problem.budget

    # Fast baselines first: a schedule to return whatever happens next.
    quick: list[Solution] = []
    for name, solve in (("store_all", solve_store_all), ("greedy", solve_greedy), ("select", solve_select)):
        try:
            quick.append(solve(problem, max(0.5, 0.1 * limit)))
        except MethodFailed:
            continue
        if name == "store_all" and quick[-1].fits:
            info["chosen"] = "store_all"
            return finish(problem, quick[-1].schedule, "hierarchical", started, lower_bound=problem.total_cost(),
                          info=info)
    fitting = [s for s in quick if s.fits]
    best_schedule, best_cost, chosen = None, math.inf, None
    if fitting:
        top = min(fitting, key=lambda s: s.cost)
        best_schedule, best_cost, chosen = top.schedule, top.cost, top.method
    info["baseline_cost"] = best_cost

    t0 = time.perf_counter()
    c = coarsen(problem)
    info["coarse_nodes"] = c.coarse.n_compute
    info["coarsen_time"] = round(time.perf_counter() - t0, 3)
    gap = max(1, int(c.coarse.n * CLUSTER_GAP_FRACTION))
    planner = DropPlanner(c, gap)
    log = SearchLog()
    t0 = time.perf_counter()
    found = drop_search(planner, budget, deadline, log)
    info["ilp_time"] = round(time.perf_counter() - t0, 3)
    if found is not None:
        info["ilp_cost"] = found.cost
        t0 = time.perf_counter()
        found = keep_again(planner, found, budget, deadline, log)
        info["keep_again_time"] = round(time.perf_counter() - t0, 3)
        info["keep_again_cost"] = found.cost
        if found.cost < best_cost:
            best_schedule, best_cost, chosen = found.schedule, found.cost, "drop_ilp"
    info.update(rounds=log.rounds, ilp_solves=log.ilp_solves, simulations=log.simulations)

    if best_schedule is None:
        fallback = best_constructive(problem)
        best_schedule, chosen = fallback.schedule, fallback.method
        if not fallback.fits:
            min_b, schedule = min_budget_cached(problem)
            if min_b <= budget:
                best_schedule, chosen = schedule, "min_budget_search"
            # else: over budget, and the caller sees it
    info["chosen"] = chosen
    bound, bound_source = _bound(problem, max(0.1, started + limit - time.perf_counter()))
    info["bound_from"] = bound_source
    sol = finish(problem, best_schedule, "hierarchical", started, lower_bound=bound, status=FEASIBLE, info=info)
    return sol
