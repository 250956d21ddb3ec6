"""Polish a schedule that fits: undo the recomputations the budget does not need.

Planners reason in their own models (rotor's chain, the drop ILP's stages,
Checkmate's rounded memory), so a plan that fits often recomputes values the
real budget would let it keep. `keep_recomputed` walks a fitting schedule
and, for each recomputation of a value, asks whether keeping the earlier
instance resident instead (deleting its free and the recompute) still fits;
the most cost saved per byte-step held first. A recomputation left unread
(its only reader was itself a recomputation now undone) is then deleted
with its free, and every free goes back to right after its value's last
read (a kept instance whose readers were undone would otherwise be held idle;
the room this makes goes to another pass). Every change only lowers the
compute cost.

Memory is tracked on the simulator's timeline: keeping a value from its
free at ``f`` to its recompute at ``j`` adds its bytes to every step in
``[f, j)`` and changes nothing else. That holds for a value that is no view,
is not moved to the host, and either has no views or has none touched in
``[f, j]`` while its free released and its recompute took exactly its
bytes; other recomputations are left as they are. The simulator replays the
result, and the original schedule is returned if that replay disagrees.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import defaultdict
from typing import Optional

import numpy as np

from ..core.memory import alias_trees
from ..core.problem import Problem
from ..core.schedule import Op, Schedule, ScheduleError, simulate
from ..core.sequence import tighten_frees
from ..core.uses import drop_unread

GONE = -(1 << 62)  # timeline entry of a deleted step


def _plain_values(problem: Problem) -> np.ndarray:
    """Values whose bytes are theirs alone: no alias parent, no view made from them."""
    alias_of = np.asarray(problem.alias_of)
    plain = (alias_of < 0) & ~np.asarray(problem.is_source, dtype=bool)
    parents = alias_of[alias_of >= 0]
    plain[parents] = False
    return plain


def _positions(problem: Problem, steps: list) -> dict[int, list[int]]:
    """Per value, the positions of the steps that name it or read it."""
    index, preds = problem.index, problem.preds
    out: dict[int, list[int]] = defaultdict(list)
    for k, (op, node) in enumerate(steps):
        v = index[node]
        out[v].append(k)
        if op is Op.COMPUTE:
            for p in preds[v]:
                out[p].append(k)
    return out


def _touched_within(positions: list[int], f: int, j: int) -> bool:
    i = bisect.bisect_left(positions, f)
    return i < len(positions) and positions[i] <= j


def _instances(problem: Problem, steps: list) -> dict[int, list[tuple[int, Optional[int]]]]:
    """Per value, its device instances as ``(made at, freed at or None)`` in step order; a value
    with a host copy is left out (its residency has more than one meaning)."""
    index = problem.index
    out: dict[int, list[tuple[int, Optional[int]]]] = defaultdict(list)
    moved: set[int] = set()
    for k, (op, node) in enumerate(steps):
        v = index[node]
        if op is Op.COMPUTE:
            out[v].append((k, None))
        elif op is Op.FREE and out[v] and out[v][-1][1] is None:
            out[v][-1] = (out[v][-1][0], k)
        elif op in (Op.OFFLOAD, Op.PREFETCH):
            moved.add(v)
    for v in moved:
        out.pop(v, None)
    return out


KEEP_PASSES = 3  # passes of `keep_recomputed`: the frees tightened after one can make room for more keeps


def keep_recomputed(problem: Problem, schedule: Schedule, deadline: float = math.inf) -> Schedule:
    """``schedule`` with recomputations undone while it still fits ``problem.budget`` (or
    ``schedule`` itself when it does not fit, or when nothing can be undone).

    Undoing a recomputation stretches the earlier instance to the recompute's free; when a later
    undo removes the reads that stretch was for, the instance is held idle. So after each pass the
    frees go back to the last reads (`plan.tighten_frees`), and the room that makes is offered to
    another pass."""
    for _ in range(KEEP_PASSES):
        polished = _keep_pass(problem, schedule, deadline)
        if polished is schedule or time.perf_counter() > deadline:
            return polished
        schedule = polished
    return schedule


def _keep_pass(problem: Problem, schedule: Schedule, deadline: float) -> Schedule:
    """One pass of `keep_recomputed` (``schedule`` itself when it changes nothing)."""
    steps = list(schedule.steps)
    try:
        sim = simulate(problem, steps)
    except ScheduleError:
        return schedule
    if not sim.fits:
        return schedule
    budget = problem.budget
    timeline = sim.timeline.astype(np.int64).copy()
    plain = _plain_values(problem)
    mem, cost = problem.mem, problem.cost
    removed = np.zeros(len(steps), dtype=bool)
    # Candidates: a recompute at j of a value whose previous instance was freed at f < j, where
    # the free released the value's bytes, the recompute took them again, and no view of its
    # storage is touched in between (then only [f, j) changes, by exactly its bytes).
    base = sim.timeline.astype(np.int64)
    descendants = alias_trees(problem).descendants
    touched = _positions(problem, steps) if descendants else {}
    moves: list[tuple[float, int, int, int]] = []
    for v, inst in _instances(problem, steps).items():
        size = int(mem[v])
        if size <= 0 or problem.alias_of[v] >= 0:
            continue
        for (_, f), (j, _) in zip(inst, inst[1:]):
            if f is None or f >= j or f == 0:
                continue
            if not plain[v]:
                if base[f - 1] - base[f] != size or base[j] - base[j - 1] != size:
                    continue
                if any(_touched_within(touched.get(w, ()), f, j) for w in descendants.get(v, ())):
                    continue
            moves.append((float(cost[v]) / (float(size) * (j - f)), v, f, j))
    moves.sort(reverse=True)
    for _, v, f, j in moves:
        if time.perf_counter() > deadline:
            break
        if int(timeline[f:j].max()) + int(mem[v]) > budget:
            continue
        timeline[f:j] += int(mem[v])
        removed[f] = removed[j] = True
        timeline[f] = timeline[j] = GONE  # steps that are gone never count in a maximum
    if not removed.any():
        return schedule
    kept = [s for s, gone in zip(steps, removed) if not gone]
    kept = tighten_frees(problem, Schedule(tuple(drop_unread(problem, kept))))
    try:
        after = simulate(problem, kept)
    except ScheduleError:
        return schedule
    if not after.fits or after.cost > sim.cost or after.time > sim.time * (1 + 1e-9):
        return schedule
    return kept
