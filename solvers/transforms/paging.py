"""Paging: move values that sit idle across a schedule's peak out to host memory.

`add_offloads` pages values out of a schedule until it fits the budget.
At the schedule's peak it looks for values that sit idle across the peak
(used before it, next read after it or, for a sink such as a gradient,
needed only at the end) and own their storage; it offloads one right after
its last use, frees the device copy once the copy has had time to finish,
and prefetches it just early enough to land before the next read. Views of
it that are still held are freed with it and recomputed from the prefetched
base before their next read. Windows that hide both copies behind compute
are preferred; only when none covers the peak does it accept a window that
makes compute wait, the one costing the least waiting per byte. Every change
is replayed through the simulator, which has the last word on memory and
time.

`windows` lists every way of paging one value out across a step and
`apply_windows` inserts chosen windows into a schedule; the hierarchical
strategy's paging rows place their copies with them.

Values that cannot be offloaded: sources (parameters, inputs), views (their
base is offloaded instead), values the problem marks (``offloadable``), and
values a view of which must stay resident (a user output's reference).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..core.memory import alias_trees
from ..core.problem import Problem
from ..core.schedule import Op, Schedule, ScheduleError, SimResult, Step, simulate
from ..core.uses import Uses, held_views

MAX_ROUNDS = 5000


@dataclass(frozen=True)
class Window:
    """Page ``value`` out across the steps ``[free_at, prefetch_at)`` of a schedule.

    Positions are insertion points (an item inserted at ``j`` runs right
    before the current step ``j``)."""

    value: int
    offload_at: Optional[int]  # None: a host copy already exists
    free_at: int
    prefetch_at: int
    views: tuple[tuple[int, int], ...]  # (view, position of its recompute) for views freed with the value
    saving: int  # bytes the window removes from the peak
    wait: float  # estimated compute-stream waiting it adds
    # (view, first, last): a view between ``value`` and a held view, re-made at ``first`` to re-make
    # its descendants and freed again at ``last``.
    helpers: tuple[tuple[int, int, int], ...] = ()
    # Set when only views hold the value's storage across the peak: the position of the
    # value's own free, moved to ``free_at`` (its free waits for the copy; a view's would not).
    moved_free: Optional[int] = None


def windows_at(problem: Problem, steps: list[Step], sim: SimResult, k: int,
             values: Optional[Iterable[int]] = None, uses: Optional[Uses] = None) -> list[Window]:
    """Every way of paging one idle value out across step ``k`` (only ``values``, when given;
    ``uses``: the scan of ``steps``, when the caller has it)."""
    uses = Uses(problem, steps) if uses is None else uses
    trees = alias_trees(problem)
    clock = sim.clock
    lists = problem.lists()
    alias_of, recomputable, mem, offloadable = lists.alias_of, lists.recomputable, lists.mem, lists.offloadable
    is_sink = problem.is_sink
    end = len(steps)

    def time_before(j: int) -> float:  # compute-stream time when the step at j starts
        return float(clock[j - 1]) if j > 0 else 0.0

    out: list[Window] = []
    for v in (range(problem.n) if values is None else values):
        if not offloadable[v]:
            continue
        descendants = trees.descendants.get(v, ())
        span = uses.interval(v, k, end)
        moved_free = None
        if span is None:
            # Freed before k, but views made from this instance may still hold its storage:
            # page the storage out all the same, v's own free moving to after the copy.
            span = uses.held_by_views(v, k, end, descendants)
            if span is None:
                continue
            start, stop, moved_free = span
            b = None
        else:
            start, stop = span
        a = uses.last_use(v, start, k)
        if a >= k:
            continue  # read by (or made at) the peak step itself
        if moved_free is None:
            b = uses.next_read(v, k, stop)
            if b is None and is_sink[v] and stop == end:
                b = end  # a sink (a gradient) only has to be back by the end of the step
            if b is None:
                continue  # held for nobody (kept on purpose)
        # Views of v still held across k go with it and are recomputed before their next read.
        held = held_views(problem, uses, descendants, v, start, k, end)
        if held is None:
            continue
        views = held.views
        for _, w_next in views:
            b = w_next if b is None else min(b, w_next)
        a = max(a, held.last_read)
        if b is None:
            continue
        views, helpers = remake_order(views, v, alias_of)
        if helpers is None or any(not recomputable[u] for u, _, _ in helpers):
            continue
        t = problem.transfer_time(v)
        offload_at = None if uses.offloaded[v] is not None and uses.offloaded[v] < a else a + 1
        # Free: the first point after the offload where the copy has had time to finish.
        ready = time_before(a + 1) + (t if offload_at is not None else 0.0)
        free_at, wait = k, 0.0
        for j in range(a + 1, k + 1):
            if time_before(j) >= ready:
                free_at = j
                break
        else:
            wait += ready - time_before(k)
        # Prefetch: the last point after k from which the copy lands before the next read.
        due = time_before(b)
        prefetch_at = k + 1
        for j in range(b, k, -1):
            if time_before(j) + t <= due:
                prefetch_at = j
                break
        else:
            wait += time_before(prefetch_at) + t - due
        if moved_free is not None and offload_at is not None:
            offload_at = min(offload_at, moved_free)  # while v itself is still resident
        out.append(Window(v, offload_at, free_at, prefetch_at, tuple(views), mem[v], max(0.0, wait), tuple(helpers),
                          moved_free))
    return out


def remake_order(views: list[tuple[int, int]], v: int, alias_of: list[int]
                  ) -> tuple[list[tuple[int, int]], Optional[list[tuple[int, int, int]]]]:
    """A view is re-made from its parent view, so every view between ``v`` and a held
    view must be resident when that one is re-made: held ones are re-made no later,
    the others (helpers) are re-made for the purpose and freed after their last child."""
    at = dict(views)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for w, w_at in sorted(views, key=lambda e: e[1]):
        u = alias_of[w]
        while u != v:
            if u < 0:
                return views, None  # not a descendant after all
            if u in at:
                at[u] = min(at[u], w_at)
            else:
                first[u] = min(first.get(u, w_at), w_at)
                last[u] = max(last.get(u, w_at), w_at)
            u = alias_of[u]
    return sorted(at.items()), [(u, first[u], last[u]) for u in sorted(first)]


def apply_windows(problem: Problem, steps: list[Step], windows: Sequence[Window]) -> list[Step]:
    """``steps`` with ``windows`` applied; the windows' positions all refer to ``steps``, so
    their insertions merge in one pass. Windows of one value must be disjoint in time, the
    later ones without an offload of their own (the host copy stays)."""
    names = problem.names
    before: dict[int, list[Step]] = {}

    def put(j: int, step: Step) -> None:
        before.setdefault(j, []).append(step)

    moved: set[int] = set()
    for w in windows:
        if w.offload_at is not None:
            put(w.offload_at, Step(Op.OFFLOAD, names[w.value]))
        for view in sorted((x for x, _ in w.views), reverse=True):  # views before their base
            put(w.free_at, Step(Op.FREE, names[view]))
        put(w.free_at, Step(Op.FREE, names[w.value]))
        put(w.prefetch_at, Step(Op.PREFETCH, names[w.value]))
        remakes = [(at, view) for view, at in w.views] + [(first, view) for view, first, _ in w.helpers]
        for at, view in sorted(remakes):  # bases before their views (values are numbered in graph order)
            put(at, Step(Op.COMPUTE, names[view]))
        for view, _, last in w.helpers:  # after the computes put at the same position
            put(last, Step(Op.FREE, names[view]))
        if w.moved_free is not None:  # the prefetched instance goes once its views are made again
            put(max(at for _, at in w.views), Step(Op.FREE, names[w.value]))
            moved.add(w.moved_free)
    out: list[Step] = []
    for j, step in enumerate(steps):
        out.extend(before.get(j, ()))
        if j not in moved:
            out.append(step)
    out.extend(before.get(len(steps), ()))
    return out


def _choose(windows: list[Window], excess: int) -> Optional[Window]:
    """Hidden windows first: the smallest that removes the whole excess, else the
    largest; otherwise the window with the least waiting per byte saved."""
    hidden = [w for w in windows if w.wait <= 0.0]
    if hidden:
        enough = [w for w in hidden if w.saving >= excess]
        return min(enough, key=lambda w: w.saving) if enough else max(hidden, key=lambda w: w.saving)
    costly = [w for w in windows if w.saving > 0]
    return min(costly, key=lambda w: w.wait / w.saving) if costly else None


def add_offloads(problem: Problem, schedule: Schedule, deadline: float = math.inf) -> Schedule:
    """Page values out of ``schedule`` until it fits ``problem.budget`` (or no
    window helps). Returns the best schedule found: the first that fits, else
    the one with the lowest peak."""
    if not problem.has_host:
        return schedule
    steps = list(schedule.steps)
    sim = simulate(problem, steps)
    best = (sim.peak, steps)
    rejected: set[tuple[int, int]] = set()
    for _ in range(MAX_ROUNDS):
        if sim.peak <= problem.budget or time.perf_counter() > deadline:
            break
        k = sim.peak_step
        if k < 0:
            break  # the sources alone exceed the budget
        windows = [w for w in windows_at(problem, steps, sim, k) if (w.value, w.free_at) not in rejected]
        choice = _choose(windows, sim.peak - problem.budget)
        if choice is None:
            break
        candidate = apply_windows(problem, steps, [choice])
        try:
            after = simulate(problem, candidate)
        except ScheduleError:
            rejected.add((choice.value, choice.free_at))
            continue
        if after.peak_step == k and after.peak >= sim.peak:
            rejected.add((choice.value, choice.free_at))
            continue
        steps, sim = candidate, after
        if sim.peak < best[0]:
            best = (sim.peak, steps)
    if sim.peak <= problem.budget:
        return Schedule(tuple(steps))
    return Schedule(tuple(best[1]))
