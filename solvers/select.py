"""Method "select": choose which long-lived values to drop and recompute on demand.

Training graphs keep forward values alive across a long gap (from the forward
pass to their use in the backward pass). This method decides, per value,
whether to keep it across its gaps or to drop it after each cluster of uses
and recompute it (and, recursively, any dropped input) right before the next
cluster. That is activation checkpointing at the granularity of single
values, and it scales: each candidate plan is one linear pass to build plus
one simulation.

The drop set grows greedily: simulate, look at the values resident at the
peak that are between two clusters of uses, drop the ones that free the
most bytes per unit of recomputation, repeat until the peak fits. A second
pass tries to keep again the costliest dropped values while the budget
still holds.

Search space: schedules that compute values in the problem's order, recompute
only dropped values, and free after last use. Lower bound: the sum of all
costs (every value is computed at least once), valid for every schedule.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_right
from typing import Optional

import numpy as np

from .plan import schedule_from_sequence
from .problem import Problem
from .schedule import Schedule, simulate
from .solution import Solution, finish


def use_clusters(problem: Problem, gap: int) -> list[list[tuple[int, int]]]:
    """Per value: its consumers' positions grouped into clusters ``(first, last)``.

    Two consecutive uses further apart than ``gap`` positions start a new
    cluster: the value could be dropped in between.
    """
    clusters: list[list[tuple[int, int]]] = []
    for v in range(problem.n):
        uses = sorted(problem.succs[v])
        groups: list[tuple[int, int]] = []
        for u in uses:
            if groups and u - groups[-1][1] <= gap:
                groups[-1] = (groups[-1][0], u)
            else:
                groups.append((u, u))
        clusters.append(groups)
    return clusters


class _Builder:
    """Builds the compute sequence for a drop set: problem order plus on-demand recomputation."""

    def __init__(self, problem: Problem, clusters: list[list[tuple[int, int]]]) -> None:
        self.problem = problem
        self.clusters = clusters
        self.cluster_firsts = [[c[0] for c in cs] for cs in clusters]

    def _cluster_end(self, v: int, position: int) -> int:
        """Last use of ``v`` in the cluster that contains (or next follows) ``position``."""
        firsts = self.cluster_firsts[v]
        k = bisect_right(firsts, position) - 1
        if k < 0:
            k = 0
        return self.clusters[v][k][1]

    def sequence(self, dropped: set[int]) -> list[int]:
        p = self.problem
        preds, is_source = p.preds, p.is_source
        alive_until: dict[int, int] = {}  # dropped value -> last position its current instance serves
        seq: list[int] = []

        def ensure(u: int, position: int) -> None:
            if is_source[u] or u not in dropped:
                return
            if alive_until.get(u, -1) >= position:
                return
            for q in preds[u]:
                ensure(q, position)
            seq.append(u)
            alive_until[u] = max(position, self._cluster_end(u, position))

        for v in range(p.n):
            if is_source[v]:
                continue
            for q in preds[v]:
                ensure(q, v)
            seq.append(v)
            if v in dropped:
                alive_until[v] = self._cluster_end(v, v + 1) if self.clusters[v] else v
        return seq


def _candidates(problem: Problem, clusters: list[list[tuple[int, int]]]) -> list[int]:
    """Values worth dropping: recomputable, with at least two clusters of uses."""
    return [
        v
        for v in problem.non_sources
        if problem.recomputable[v] and len(clusters[v]) >= 2 and not problem.is_sink[v]
    ]


def _alias_group(problem: Problem, v: int, candidates: set[int]) -> list[int]:
    """``v`` and the candidates sharing its storage: dropping one alone frees nothing."""
    root = v
    while problem.alias_of[root] >= 0:
        root = int(problem.alias_of[root])
    group = {w for w in candidates if _root(problem, w) == root}
    group.add(v)
    return sorted(group)


def _root(problem: Problem, v: int) -> int:
    while problem.alias_of[v] >= 0:
        v = int(problem.alias_of[v])
    return v


def _resident_at(problem: Problem, schedule: Schedule, step: int) -> set[int]:
    resident: set[int] = set()
    for op, node in schedule.steps[: step + 1]:
        v = problem.index[node]
        if op == "compute":
            resident.add(v)
        else:
            resident.discard(v)
    return resident


def solve_select(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    deadline = started + (time_limit if time_limit is not None else 60.0)
    gap = max(4, problem.n // 50)
    clusters = use_clusters(problem, gap)
    builder = _Builder(problem, clusters)
    candidates = _candidates(problem, clusters)
    candidate_set = set(candidates)
    cost = problem.cost
    mem = problem.mem

    def evaluate(dropped: set[int]):
        schedule = schedule_from_sequence(problem, builder.sequence(dropped))
        return schedule, simulate(problem, schedule)

    dropped: set[int] = set()
    schedule, result = evaluate(dropped)
    best = (schedule, result) if result.fits else None
    # Grow the drop set until the peak fits.
    while not result.fits and time.perf_counter() < deadline:
        at_peak = _resident_at(problem, schedule, result.peak_step)
        options = [v for v in at_peak if v in candidate_set and v not in dropped]
        if not options:
            break
        scored = []
        for v in options:
            group = _alias_group(problem, v, candidate_set - dropped)
            root = _root(problem, v)
            if root in group:
                freed = int(mem[root])
            elif root in at_peak:
                continue  # its storage stays alive through the root anyway
            else:
                freed = int(mem[v])
            extra = sum(float(cost[w]) * (len(clusters[w]) - 1) for w in group)
            scored.append((freed / (extra + 1e-9), freed, group))
        if not scored:
            break
        scored.sort(key=lambda s: -s[0])
        excess = result.peak - problem.budget
        released = 0
        for _, freed, group in scored:
            dropped.update(group)
            released += freed
            if released >= excess:
                break
        schedule, result = evaluate(dropped)
        if result.fits:
            best = (schedule, result)
    if best is None:
        return finish(problem, schedule, "select", started, lower_bound=problem.total_cost())
    # Keep again what no longer needs dropping, costliest first.
    for v in sorted(dropped, key=lambda w: -float(cost[w]) * (len(clusters[w]) - 1)):
        if time.perf_counter() >= deadline:
            break
        trial = dropped - {v}
        schedule, result = evaluate(trial)
        if result.fits and result.cost <= best[1].cost:
            dropped = trial
            best = (schedule, result)
    return finish(problem, best[0], "select", started, lower_bound=problem.total_cost(),
                  info={"dropped": len(dropped), "candidates": len(candidates)})
