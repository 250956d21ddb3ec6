"""The covering ILP that chooses which groups to drop (and, with a host link, to page out).

Dropping group g (a `Candidate`) costs its recomputations and frees its held
bytes over the gaps between its clusters of uses, minus the transient of
recomputing it whole, minus what its kept inputs must then hold until its
recomputation (`Penalty`); with ``chains`` a cluster made only of a
consumer's recomputation points costs (and holds) only when that consumer is
dropped too. Every stage where the keep-all schedule is over the budget must
come down to it: `CoverModel` takes those rows one stage at a time (the
search adds them as the linear model violates them), soft so that the ILP
(HiGHS) always answers.

With a host link (``problem.has_host``) the ILP also chooses *pagings*
(`pagings`): a kept group copied to host memory across one gap between its
clusters, freeing its bytes from the end of the copy out to the start of the
copy in (keep-all's clock); rows keep the copies overlapping any stage within
its duration, one at a time each way, and the host memory within its
capacity. Groups that cannot be recomputed are candidates for paging only.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ...core.memory import memory_of
from ...core.problem import Problem
from ...methods.milp_backends import BACKENDS, RAW_FEASIBLE, RAW_OPTIMAL
from .planner import DropPlanner, Paging, held_memory

SHORTFALL_PENALTY = 1e4  # objective per unit of uncovered need (needs are scaled to <= 1)
# Each cover solve stops once its drop set is proven within this share of the cheapest: the model
# is linear and its answer is measured by the simulator and fed back anyway, and proving the last
# percent took most of each solve (gpt2 12 layers at 50%: the first fitting plan, 1.0641 of the
# total cost, in 4 s at 1e-7, in 1 s at 1%).
COVER_GAP = 0.01


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
        raw = b.solve(max(0.05, time_limit), 1, gap=COVER_GAP)
        if raw.status not in (RAW_OPTIMAL, RAW_FEASIBLE) or raw.values is None:
            return None
        return np.array([raw.values[h] for h in xs]) > 0.5, np.array([raw.values[h] for h in ys], dtype=float) > 0.5

