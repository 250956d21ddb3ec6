"""Method "offload": joint keep / recompute / offload plans that minimise step time.

Recomputation pays FLOPs for memory; offloading pays host-link time, which
is free as long as the copies hide behind compute. The method works in two
parts:

* `add_offloads` pages values out of a schedule until it fits the budget.
  At the schedule's peak it looks for values that sit idle across the peak
  (used before it, next read after it or, for a sink such as a gradient,
  needed only at the end) and own their storage; it offloads one
  right after its last use, frees the device copy once the copy has had time
  to finish, and prefetches it just early enough to land before the next
  read. Views of it that are still held are freed with it and recomputed
  from the prefetched base before their next read. Windows that hide both
  copies behind compute are preferred; only when none covers the peak does it
  accept a window that makes compute wait, the one costing the least waiting
  per byte. Every change is replayed through the simulator, which has the
  last word on memory and time.

* `solve_offload` first pages store-all's schedule recomputed down to
  budgets between the target and store-all's peak (seconds; capped at
  `DESCENT_SHARE` of the time), then gives the time left to the hierarchical
  strategy on the problem with its host link, with the fastest of those paged
  plans as a seed: each model of its drop search runs without pagings, then
  with them (per group of values: keep, recompute, or page out across a gap
  between uses, with rows that keep the copies within the link's time,
  `hierarchical.pagings`), the paging runs only for as long as they find
  faster plans; the windows of this module place the copies.
  With time still left (the hierarchical search stops at 85% of its limit)
  it builds rematerialization plans at several budgets between the target
  and store-all's peak (a looser budget means fewer recomputations) and
  pages each down to the target, a run only when the time left covers the
  longest run so far. The plan with the shortest simulated step time wins.

Values that cannot be offloaded: sources (parameters, inputs), views (their
base is offloaded instead), values the problem marks (``offloadable``), and
values a view of which must stay resident (a user output's reference).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .bounds import min_budget_cached, store_all_peak
from .memory import alias_trees
from .problem import Problem
from .schedule import Op, Schedule, ScheduleError, SimResult, Step, simulate
from .solution import Solution, finish
from .store_all import solve_store_all

# Rematerialization plans are made at these points between the target budget (0)
# and store-all's peak (1); each then gets offloads until it fits the target.
BASE_FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)
DESCENT_SHARE = 0.05  # of the time limit, at most, for paging store-all recomputed down (the first candidates)
JOINT_SHARE = 1.0  # of the time left then, for the hierarchical strategy (it stops its search at 85% of
# that, then polishes: the sweep gets the rest)
SWEEP_MIN = 0.5  # seconds: the least a remat plan of the sweep is given (none is started with less, once a plan fits)
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


class Uses:
    """Where each value is made resident, read and freed in a schedule."""

    def __init__(self, problem: Problem, steps: list[Step]) -> None:
        index, preds = problem.index, problem.preds
        n = problem.n
        self.starts: list[list[int]] = [[] for _ in range(n)]  # compute or prefetch positions
        self.ends: list[list[int]] = [[] for _ in range(n)]  # free positions
        self.reads: list[list[int]] = [[] for _ in range(n)]  # positions of computes that read it
        self.offloaded: list[Optional[int]] = [None] * n  # position of its offload
        for k, (op, node) in enumerate(steps):
            v = index[node]
            if op is Op.COMPUTE:
                self.starts[v].append(k)
                for p in preds[v]:
                    self.reads[p].append(k)
            elif op is Op.PREFETCH:
                self.starts[v].append(k)
            elif op is Op.FREE:
                self.ends[v].append(k)
            elif op is Op.OFFLOAD:
                self.offloaded[v] = k

    def latest(self, v: int, k: int, end: int) -> Optional[tuple[int, int]]:
        """``[start, stop)`` of the last residency of ``v`` that began at or before step ``k``."""
        starts = self.starts[v]
        i = bisect.bisect_right(starts, k) - 1
        if i < 0:
            return None
        ends = self.ends[v]
        j = bisect.bisect_right(ends, starts[i])
        return starts[i], ends[j] if j < len(ends) else end

    def interval(self, v: int, k: int, end: int) -> Optional[tuple[int, int]]:
        """The residency ``[start, stop)`` of ``v`` that contains step ``k``, if any."""
        span = self.latest(v, k, end)
        return span if span is not None and k < span[1] else None

    def last_use(self, v: int, start: int, k: int) -> int:
        """Last position in ``[start, k]`` where ``v`` is made resident or read."""
        reads = self.reads[v]
        i = bisect.bisect_right(reads, k) - 1
        return max(start, reads[i]) if i >= 0 else start

    def held_by_views(self, v: int, k: int, end: int, views: list[int]) -> Optional[tuple[int, int, int]]:
        """``(start, end, free)`` when ``v``'s latest instance before ``k`` was freed at
        ``free`` < ``k`` while a view made from it is still resident at ``k``."""
        span = self.latest(v, k, end)
        if span is None or span[1] >= k:
            return None  # resident at k, or never freed
        start, freed = span
        for w in views:
            w_span = self.interval(w, k, end)
            if w_span is not None and w_span[0] >= start:
                return start, end, freed
        return None

    def next_read(self, v: int, k: int, stop: int) -> Optional[int]:
        """First position in ``(k, stop)`` where ``v`` is read."""
        reads = self.reads[v]
        i = bisect.bisect_right(reads, k)
        return reads[i] if i < len(reads) and reads[i] < stop else None


def _windows(problem: Problem, steps: list[Step], sim: SimResult, k: int,
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
        descendants = [w for w in trees.members.get(int(trees.root[v]), ()) if _descends(alias_of, w, v)]
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
        views: list[tuple[int, int]] = []
        ok = True
        for w in descendants:
            w_span = uses.interval(w, k, end)
            if w_span is None or w_span[0] < start:
                continue  # not held, or made from an earlier instance of v (another storage)
            w_next = uses.next_read(w, k, w_span[1])
            if w_next is None and is_sink[w] and w_span[1] == end:
                w_next = end
            if w_next is None or not recomputable[w] or uses.last_use(w, w_span[0], k) >= k:
                ok = False
                break
            views.append((w, w_next))
            b = w_next if b is None else min(b, w_next)
            a = max(a, uses.last_use(w, w_span[0], k))
        if not ok or b is None:
            continue
        views, helpers = _remake_order(views, v, alias_of)
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


def _remake_order(views: list[tuple[int, int]], v: int, alias_of: list[int]
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


def _descends(alias_of: list[int], w: int, v: int) -> bool:
    a = alias_of[w]
    while a >= 0:
        if a == v:
            return True
        a = alias_of[a]
    return False


def _apply(problem: Problem, steps: list[Step], windows: Sequence[Window]) -> list[Step]:
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
        windows = [w for w in _windows(problem, steps, sim, k) if (w.value, w.free_at) not in rejected]
        choice = _choose(windows, sim.peak - problem.budget)
        if choice is None:
            break
        candidate = _apply(problem, steps, [choice])
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


def solve_offload(problem: Problem, time_limit: Optional[float] = None, *, joint_share: float = JOINT_SHARE
                  ) -> Solution:
    """Fastest fitting plan of paging store-all recomputed down, of the joint covering ILP
    (``joint_share`` of the time left after that; 0 leaves it out) and of the paging sweep over
    remat plans (with any time still left)."""
    from .auto import solve_auto  # auto dispatches here for problems with a host link
    from .hierarchical import solve_hierarchical  # which pages with this module's windows
    from .repair import descend  # which builds on this module's scans

    started = time.perf_counter()
    remat = problem.with_host(0.0, None)
    if not problem.has_host:
        sol = solve_auto(remat, time_limit)
        return finish(problem, sol.schedule, "offload", started, lower_bound=sol.lower_bound,
                      info={"base": sol.info.get("chosen", sol.method), "offloaded": 0})
    limit = 60.0 if time_limit is None else time_limit
    deadline = started + limit
    best: Optional[tuple[float, int, Schedule, dict]] = None  # (time, peak, schedule, info)
    fallback: Optional[tuple[int, Schedule, dict]] = None
    top = store_all_peak(remat)
    targets = sorted({min(top, int(problem.budget + f * max(0, top - problem.budget))) for f in BASE_FRACTIONS})

    def consider(schedule: Schedule, info: dict) -> bool:
        """Keep ``schedule`` if it is the fastest fitting plan so far (True) or the lowest peak."""
        nonlocal best, fallback
        result = simulate(problem, schedule)
        info = {**info, "offloaded": len(schedule.offloads()), "recomputations": result.recomputations}
        if fallback is None or result.peak < fallback[0]:
            fallback = (result.peak, schedule, info)
        if result.fits and (best is None or result.time < best[0]):
            best = (result.time, result.peak, schedule, info)
            return True
        return False

    # Store-all recomputed down the targets, each from the one above (one repair in all), then
    # paged the rest of the way: seconds, and strong where recomputing a little then paging is
    # best (resnet50 at 50%: 1.0755 against 1.0901 for remat alone). Capped at DESCENT_SHARE of
    # the time: on graphs where paging store-all cannot reach the target it would take it all.
    # The repairs take well under a second; paging is what takes long, the longest from the
    # highest budgets (gpt12 at 30%: 0.03 s from 0.0, 5.7 s from store-all), so it goes from the lowest up.
    descent_end = started + (DESCENT_SHARE if joint_share > 0 else 1.0) * limit
    downs = []
    for target, down in descend(remat, solve_store_all(remat).schedule, sorted(targets, reverse=True), descent_end):
        if not simulate(remat.with_budget(target), down).fits:
            break
        downs.append((target, down))
    for target, down in reversed(downs):
        if time.perf_counter() > descent_end:
            break
        paged = add_offloads(problem, down, descent_end)
        faster = consider(paged, {"base_budget": target, "base": "store_all (repaired)"})
        if not faster and best is not None:
            break  # not faster than the plan from a lower budget: higher ones recompute less but page far more
    if joint_share > 0:
        # The hierarchical strategy's covering ILP chooses keep / recompute / offload per group
        # together; it gets ``joint_share`` of the time that is left, and the fastest paged
        # descent as a seed: `pin_search` and the drop search's paging runs measure themselves
        # against it rather than against remat-only plans.
        left = deadline - time.perf_counter()
        # Only the paged descents have been considered so far: the best plan is the fastest of them.
        seeds = [] if best is None else [(best[2], f"store_all (repaired to {best[3]['base_budget']}, paged)")]
        joint = solve_hierarchical(problem, max(SWEEP_MIN, joint_share * left), seeds=seeds)
        consider(joint.schedule, {"base": "hierarchical (joint)", "chosen": joint.info.get("chosen")})
        # A run of the sweep takes at least the baselines and the store-all descent the joint
        # run took, whatever its limit (gpt12 at 30%: 7 s; an auto run given 0.5 s took 3.3 s).
        shortest = max(SWEEP_MIN, joint.info.get("clock", {}).get("descent", 0.0))
    else:
        shortest = SWEEP_MIN
    for i, target in enumerate(targets):
        left = deadline - time.perf_counter()
        if best is not None and left < shortest:
            break  # a plan fits: do not start a run that would end past the limit
        share = max(SWEEP_MIN, left / (2 * (len(targets) - i)))
        run_started = time.perf_counter()
        base = solve_auto(remat.with_budget(target), share)
        consider(add_offloads(problem, base.schedule, deadline),
                 {"base_budget": target, "base": base.info.get("chosen", base.method)})
        shortest = max(shortest, time.perf_counter() - run_started)
        if time.perf_counter() > deadline and best is not None:
            break
    if best is None:
        _, schedule = min_budget_cached(problem, deadline)
        info = {"base": "min_budget_search", "offloaded": len(schedule.offloads())}
        if simulate(problem, schedule).peak > fallback[0]:
            _, schedule, info = fallback
    else:
        _, _, schedule, info = best
    return finish(problem, schedule, "offload", started, lower_bound=problem.total_cost(), info=info)
