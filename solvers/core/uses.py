"""One scan of a schedule's uses: where values are made, read, freed and resident.

Every transform reads a schedule the same way the simulator executes it: a
compute or a prefetch makes a value resident, a free drops it, an offload
leaves the device copy in place. The scans the transforms and strategies
share live here, so that they agree with the simulator and with each other:

* `Uses`: per value, the positions of its starts, reads, frees and offload;
* `residencies` / `resident_at`: the resident set after each step;
* `held_views`: the views of a value's instance held across a step;
* `use_clusters`: a value's consumers grouped where they are close;
* `compute_sequence` / `drop_unread` / `without_unread`: the computes of a
  schedule, and the schedule (or sequence) less the recomputations nothing reads.
"""
from __future__ import annotations

import bisect
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from .memory import Residency
from .problem import Problem
from .schedule import Op, Schedule, Step
from .sequence import schedule_from_sequence


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


def residencies(problem: Problem, steps: Iterable[Step]) -> Iterator[Residency]:
    """The resident set after each step (a compute counts while it runs): one `Residency`,
    updated in place and yielded once per step."""
    mem = Residency(problem)
    index = problem.index
    for op, node in steps:
        if op is Op.COMPUTE or op is Op.PREFETCH:
            mem.add(index[node])
        elif op is Op.FREE:
            mem.remove(index[node])
        yield mem


def resident_at(problem: Problem, steps: list[Step], k: int) -> Residency:
    """The resident set after step ``k`` (a compute counts while it runs)."""
    mem = Residency(problem)
    for mem in residencies(problem, steps[:k + 1]):
        pass
    return mem


@dataclass(frozen=True)
class HeldViews:
    """The views made from one instance of a value that are held across a step ``k``."""

    views: list[tuple[int, int]]  # (view, position of its next read, or the end for a sink)
    last_read: int  # last position before k where a held view is made or read (-1: none)
    last_free: int  # last position before k where a view of the instance is freed (-1: none)


def held_views(problem: Problem, uses: Uses, descendants: Iterable[int], v: int, start: int, k: int, end: int
               ) -> Optional[HeldViews]:
    """Views (``descendants`` of ``v``) made from ``v``'s instance that begins at ``start`` and
    held across ``k``; None when one of them cannot go (read at ``k``, held for nobody, or not
    recomputable), since then ``v``'s storage stays."""
    lists = problem.lists()
    recomputable, is_sink = lists.recomputable, problem.is_sink
    views: list[tuple[int, int]] = []
    last_read = last_free = -1
    for w in descendants:
        for e in uses.ends[w]:
            if start <= e < k:
                last_free = max(last_free, e)  # a view freed before k still held the storage until then
        w_span = uses.interval(w, k, end)
        if w_span is None or w_span[0] < start:
            continue  # not held, or made from an earlier instance of v (another storage)
        w_last = uses.last_use(w, w_span[0], k)
        if w_last >= k or not recomputable[w]:
            return None
        w_next = uses.next_read(w, k, w_span[1])
        if w_next is None and is_sink[w] and w_span[1] == end:
            w_next = end
        if w_next is None:
            return None
        views.append((w, w_next))
        last_read = max(last_read, w_last)
    return HeldViews(views, last_read, last_free)


def cluster_positions(positions: Iterable[int], gap: int) -> list[tuple[int, int]]:
    """Sorted ``positions`` grouped into clusters ``(first, last)``: two consecutive positions
    further apart than ``gap`` start a new cluster (a value could be dropped in between)."""
    groups: list[tuple[int, int]] = []
    for u in sorted(positions):
        if groups and u - groups[-1][1] <= gap:
            groups[-1] = (groups[-1][0], u)
        else:
            groups.append((u, u))
    return groups


def use_clusters(problem: Problem, gap: int) -> list[list[tuple[int, int]]]:
    """Per value: its consumers' positions grouped into clusters (`cluster_positions`)."""
    return [cluster_positions(problem.succs[v], gap) for v in range(problem.n)]


def cluster_end(clusters: Sequence[tuple[int, int]], firsts: Sequence[int], position: int) -> int:
    """Last position of the cluster that contains (or next follows) ``position``; ``firsts``
    are the clusters' first positions. ``position`` itself when there is no cluster."""
    if not clusters:
        return position
    k = max(0, bisect_right(firsts, position) - 1)
    return clusters[k][1]


def compute_sequence(problem: Problem, schedule: Schedule) -> list[int]:
    """The values ``schedule`` computes, in order (recomputations included)."""
    index = problem.index
    return [index[node] for op, node in schedule if op is Op.COMPUTE]


def drop_unread(problem: Problem, steps: Sequence[Step]) -> list[Step]:
    """``steps`` less every recomputation that nothing reads before its instance ends (with its
    free), until none is left. A value's first compute, the last compute of a sink (held to the
    end) and values with host copies stay. A view's compute reads its base, so a base that a
    view is made from is read."""
    index, preds, is_sink = problem.index, problem.preds, problem.is_sink
    steps = list(steps)
    while True:
        live: dict[int, int] = {}  # value -> position of the compute of its current instance
        reads: dict[int, int] = {}  # compute position -> reads of that instance
        freed_at: dict[int, int] = {}  # compute position -> position of its instance's free
        last_compute: dict[int, int] = {}
        first: set[int] = set()
        moved: set[int] = set()
        for k, (op, node) in enumerate(steps):
            v = index[node]
            if op is Op.COMPUTE:
                for p in preds[v]:
                    at = live.get(p)
                    if at is not None:
                        reads[at] += 1
                if v not in last_compute:
                    first.add(k)
                live[v] = last_compute[v] = k
                reads[k] = 0
            elif op is Op.FREE:
                at = live.pop(v, None)
                if at is not None:
                    freed_at[at] = k
            elif op is Op.OFFLOAD or op is Op.PREFETCH:
                moved.add(v)
        gone: set[int] = set()
        for at, n_reads in reads.items():
            v = index[steps[at].node]
            if n_reads or at in first or v in moved or (is_sink[v] and last_compute[v] == at):
                continue
            gone.add(at)
            if at in freed_at:
                gone.add(freed_at[at])
        if not gone:
            return steps
        steps = [s for k, s in enumerate(steps) if k not in gone]


def without_unread(problem: Problem, seq: Sequence[int]) -> list[int]:
    """`drop_unread` for a compute sequence (scheduled with frees after last reads)."""
    steps = drop_unread(problem, schedule_from_sequence(problem, seq).steps)
    return compute_sequence(problem, Schedule(tuple(steps)))
