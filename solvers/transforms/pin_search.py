"""Pin search: a local search over fitting schedules that keeps what a greedy repair recomputes.

`repair.add_recomputations` lowers one peak at a time, and what it frees at an
early peak it must then recompute at every later use. On a U-Net at 30% of
store-all's activations the schedules it ends with recompute the first encoder
level four times just to remake a 2 MB downsampled input, when holding that
input through the backward pass would cost a little more recomputation at the
peaks it crosses. No single peak sees that trade; a move that makes it whole
does:

* *pin* a value that the schedule computes more than once: keep its first
  instance resident until its last read (or keep one instance until the next
  one's reads, the finer move) and delete its other computes;
* delete every recomputation that nothing reads any more (the chains that only
  fed the deleted computes), on the compute sequence, repeatedly;
* rebuild the schedule (`plan.schedule_from_sequence`: frees after last read),
  and where it is now over the budget, repair it with `add_recomputations`,
  which may free anything but the pinned value;
* polish with `polish.keep_recomputed`; the simulator measures the result, and
  the move is taken when it fits and is faster.

Moves are tried in order of the compute they can save (the costliest
recomputations first, those that failed on an earlier schedule last); the
first that helps is taken and the scan starts again on the new schedule. A
repair that already costs more than the best plan is abandoned.

When a whole scan finds nothing (a local optimum), the search is *kicked*
until the deadline: one random move, repaired at any cost, then the local
search from there; the result replaces the best plan when it is faster (an
iterated local search, seeded so that a run repeats).
It only ever returns a schedule that fits and is at least as fast as the one it
was given.
"""
from __future__ import annotations

import math
import random
import time
from typing import Optional

import numpy as np

from ..core.problem import Problem
from ..core.schedule import Schedule, ScheduleError, simulate
from ..core.sequence import schedule_from_sequence
from ..core.uses import compute_sequence, without_unread
from .polish import keep_recomputed
from .repair import add_recomputations


def _moves(problem: Problem, seq: list[int], tried: set) -> list[tuple[int, int]]:
    """Move keys ``(v, c)``: ``c == 0`` pins value ``v`` whole, ``c > 0`` deletes only its c-th
    recomputation (for values computed three times or more; with two that is the whole pin).
    Those not ``tried`` on an earlier schedule first, then by the compute of the deleted
    computes (the chains that only fed them go too, and are not counted here)."""
    alias_of, cost = problem.alias_of, problem.cost
    counts = np.bincount(np.asarray(seq, dtype=np.int64), minlength=problem.n)
    # Views are remade from their base for nothing: pin the base instead.
    again = [v for v in np.flatnonzero(counts > 1).tolist() if alias_of[v] < 0]
    keys = [(v, c) for v in again for c in range(counts[v] if counts[v] > 2 else 1)]
    keys.sort(key=lambda key: (key in tried, -cost[key[0]] * (counts[key[0]] - 1 if key[1] == 0 else 1), key))
    return keys


def _moved(seq: list[int], key: tuple[int, int]) -> list[int]:
    """``seq`` after move ``key`` (see `_moves`)."""
    v, c = key
    out = []
    made = 0
    for u in seq:
        if u == v:
            made += 1
            if made > 1 and (c == 0 or made - 1 == c):
                continue
        out.append(u)
    return out


def _try(problem: Problem, seq: list[int], pinned: int, deadline: float, max_cost: float
         ) -> Optional[tuple[Schedule, float]]:
    """``seq`` made a fitting schedule (repaired with ``pinned`` kept, then polished) and its
    time; None when it does not fit. The repair returns a schedule that fits unchanged, and the
    polish one that does not."""
    try:
        schedule = schedule_from_sequence(problem, without_unread(problem, seq))
        schedule = add_recomputations(problem, schedule, deadline, frozenset([pinned]), max_cost)
        schedule = keep_recomputed(problem, schedule, deadline)
        result = simulate(problem, schedule)
    except ScheduleError:
        return None
    return (schedule, result.time) if result.fits else None


class _Clock:
    """When the search stops: at ``deadline``, or once ``patience`` seconds have passed without a
    plan faster than the best so far (a quick answer stays quick, a search that keeps finding
    better plans goes on)."""

    def __init__(self, deadline: float, patience: float, best_time: float) -> None:
        self.deadline, self.patience, self.best_time = deadline, patience, best_time
        self.last = time.perf_counter()

    def improved(self, found_time: float) -> None:
        if found_time < self.best_time * (1 - 1e-9):
            self.best_time, self.last = found_time, time.perf_counter()

    def stopped(self) -> bool:
        now = time.perf_counter()
        return now >= self.deadline or now - self.last >= self.patience


def _local(problem: Problem, schedule: Schedule, schedule_time: float, clock: _Clock
           ) -> tuple[Schedule, float]:
    """First-improvement descent from ``schedule`` (which fits) to a schedule no move improves,
    or the best one reached when ``clock`` stops."""
    best, best_time = schedule, schedule_time
    tried: set[tuple[int, int]] = set()  # moves that did not help (on some earlier schedule)
    improved = True
    deadline = clock.deadline
    while improved and not clock.stopped():
        improved = False
        seq = compute_sequence(problem, best)
        for key in _moves(problem, seq, tried):
            if clock.stopped():
                break
            tried.add(key)
            # A repair that already costs more than the best plan is abandoned (the polish after
            # it rarely takes much back).
            found = _try(problem, _moved(seq, key), key[0], deadline, best_time)
            if found is not None and found[1] < best_time * (1 - 1e-9):
                best, best_time = found
                clock.improved(best_time)
                improved = True
                break
    return best, best_time


def pin_search(problem: Problem, schedule: Schedule, deadline: float = math.inf, kicks: Optional[int] = None,
               seed: int = 0, patience: float = math.inf) -> Schedule:
    """A schedule that fits and is at least as fast as ``schedule`` (which must fit; one with
    host transfers, or that does not fit, comes back unchanged). After the first local optimum
    the search is kicked ``kicks`` times (None: until it stops; never when neither ``deadline``
    nor ``patience`` is finite). It stops at ``deadline``, or after ``patience`` seconds without
    a faster plan."""
    if schedule.has_transfers():
        return schedule
    try:
        result = simulate(problem, schedule)
    except ScheduleError:
        return schedule
    if not result.fits:
        return schedule
    clock = _Clock(deadline, patience, result.time)
    best, best_time = _local(problem, schedule, result.time, clock)
    rng = random.Random(seed)
    left = (math.inf if math.isfinite(min(deadline, patience)) else 0) if kicks is None else kicks
    while left > 0 and not clock.stopped():
        left -= 1
        seq = compute_sequence(problem, best)
        keys = _moves(problem, seq, set())
        if not keys:
            break
        key = rng.choice(keys)
        kicked = _try(problem, _moved(seq, key), key[0], deadline, math.inf)
        if kicked is None:
            continue
        found, found_time = _local(problem, *kicked, clock)
        if found_time < best_time * (1 - 1e-9):
            best, best_time = found, found_time
    return best
