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

import time
from typing import Optional

import numpy as np

from ..core.memory import alias_trees
from ..core.problem import Problem
from ..core.schedule import simulate
from ..core.sequence import schedule_from_sequence
from ..core.solution import Solution, finish
from ..core.uses import cluster_end, resident_at, use_clusters


class _Builder:
    """Builds the compute sequence for a drop set: problem order plus on-demand recomputation."""

    def __init__(self, problem: Problem, clusters: list[list[tuple[int, int]]]) -> None:
        self.problem = problem
        self.clusters = clusters
        self.cluster_firsts = [[c[0] for c in cs] for cs in clusters]

    def _cluster_end(self, v: int, position: int) -> int:
        """Last use of ``v`` in the cluster that contains (or next follows) ``position``."""
        return cluster_end(self.clusters[v], self.cluster_firsts[v], position)

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


def _storage_groups(problem: Problem, root: np.ndarray, gap: int) -> dict[int, list[int]]:
    """Droppable storages: alias root -> the root and every value living in its storage.

    Dropping a view alone frees nothing while its base lives, and dropping a
    base frees nothing while a view of it lives: a storage is dropped whole.
    A group qualifies when all its values may be recomputed and its uses,
    taken together, have a gap in which the storage could be released.
    """
    members: dict[int, list[int]] = {}
    for v in range(problem.n):
        members.setdefault(int(root[v]), []).append(v)
    groups: dict[int, list[int]] = {}
    for r, ms in members.items():
        if problem.is_source[r] or any(not problem.recomputable[w] or problem.is_sink[w] for w in ms):
            continue
        uses = sorted(u for w in ms for u in problem.succs[w] if root[u] != r)
        if any(b - a > gap for a, b in zip(uses, uses[1:])):
            groups[r] = ms
    return groups


def solve_select(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    started = time.perf_counter()
    deadline = started + (time_limit if time_limit is not None else 60.0)
    gap = max(1, problem.n // 50)
    clusters = use_clusters(problem, gap)
    builder = _Builder(problem, clusters)
    root = alias_trees(problem).root
    groups = _storage_groups(problem, root, gap)
    cost, mem = problem.cost, problem.mem
    # Extra cost of dropping a storage: each of its values recomputed once per extra cluster of uses.
    extra_cost = {r: sum(float(cost[w]) * max(1, len(clusters[w]) - 1) for w in ms) for r, ms in groups.items()}

    def evaluate(dropped: set[int]):
        schedule = schedule_from_sequence(problem, builder.sequence(dropped))
        return schedule, simulate(problem, schedule)

    dropped: set[int] = set()
    dropped_roots: set[int] = set()
    schedule, result = evaluate(dropped)
    best = (schedule, result) if result.fits else None
    # Grow the drop set until the peak fits: storages live at the peak, most bytes per recompute cost first.
    while not result.fits and time.perf_counter() < deadline:
        at_peak = resident_at(problem, list(schedule.steps), result.peak_step)
        live = {int(root[v]) for v in np.flatnonzero(at_peak.mask)} & (groups.keys() - dropped_roots)
        if not live:
            break
        scored = sorted(live, key=lambda r: -float(mem[r]) / (extra_cost[r] + 1e-12))
        excess, released = result.peak - problem.budget, 0
        for r in scored:
            dropped.update(groups[r])
            dropped_roots.add(r)
            released += int(mem[r])
            if released >= excess:
                break
        schedule, result = evaluate(dropped)
        if result.fits:
            best = (schedule, result)
    if best is None:
        return finish(problem, schedule, "select", started, lower_bound=problem.total_cost())
    # Keep again what no longer needs dropping, costliest first.
    for r in sorted(dropped_roots, key=lambda r: -extra_cost[r]):
        if time.perf_counter() >= deadline:
            break
        trial = dropped - set(groups[r])
        schedule, result = evaluate(trial)
        if result.fits and result.cost <= best[1].cost:
            dropped, best = trial, (schedule, result)
            dropped_roots.discard(r)
    return finish(problem, best[0], "select", started, lower_bound=problem.total_cost(),
                  info={"dropped": len(dropped_roots), "candidates": len(groups)})
