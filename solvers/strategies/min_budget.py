"""The minimum-budget search: the smallest budget at which a schedule is found.

`min_budget` searches for the smallest budget with a schedule: exactly for
graphs small enough for the exhaustive search, otherwise by binary search
over budgets with the greedy and "select", starting from the lowest peak of
the budget-oblivious baselines and of rotor's chain program asked for the
trivial lower bound (`memory_bounds.memory_lower_bound`) (its lowest-peak schedule: on transformers far below what
the greedy reaches). The lowest-peak schedule is then recomputed down toward
the trivial bound (`repair.add_recomputations`): the greedy decides value by
value and leaves idle activations resident across the peak that a later
recomputation frees.
With a host link, the schedule found is then paged out to host memory as
far as it goes (`offload.add_offloads`). Every candidate is verified by the
simulator.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from functools import partial

from ..core.method import OBLIVIOUS, portfolio
from ..core.problem import Problem
from ..core.schedule import Schedule, simulate
from ..core.solution import MethodFailed
from ..methods.catalog import METHOD_INFOS
from ..methods.exhaustive import MAX_NODES as EXHAUSTIVE_MAX_NODES
from ..methods.exhaustive import min_peak
from ..methods.greedy import solve_greedy
from ..methods.memory_bounds import memory_lower_bound
from ..methods.rotor import solve_rotor
from ..methods.select import solve_select
from ..methods.store_all import solve_store_all
from ..transforms.paging import add_offloads
from ..transforms.repair import add_recomputations

# Exact minimum (exhaustive search) up to this many values to compute.
EXACT_MIN_BUDGET_NODES = 8
ROTOR_TIME_LIMIT = 10.0  # seconds for rotor's lowest-peak schedule
PAGING_TIME_LIMIT = 10.0  # seconds for paging out each schedule with a host link
# Seconds for recomputing the lowest-peak schedule down toward `memory_lower_bound`: on a
# ResNet-50 joint graph 10 s take the bisection's 943 MB to 777 MB (converging at 0.71x in 34 s).
REPAIR_TIME_LIMIT = 10.0
# The bisection stops within this share of the budget: the greedy's answers are not monotone
# in the budget anyway, and each probe costs seconds on thousands of values.
BISECTION_RESOLUTION = 1e-3


def min_budget(problem: Problem, deadline: float = math.inf) -> tuple[int, Schedule]:
    """Smallest budget at which a schedule is found, and that schedule. At ``deadline`` (a
    ``time.perf_counter()`` reading) the search stops with the lowest peak found so far."""
    assert EXACT_MIN_BUDGET_NODES <= EXHAUSTIVE_MAX_NODES
    if problem.n_compute <= EXACT_MIN_BUDGET_NODES:
        return min_peak(problem)
    unlimited = problem.with_budget(2**62)
    floor = problem.with_budget(memory_lower_bound(problem))
    store_all = solve_store_all(unlimited, None)
    best: tuple[int, Schedule] = (store_all.peak, store_all.schedule)
    # Rotor asked for the trivial bound gives its lowest-peak schedule; the budget-oblivious
    # baselines have one schedule each, whatever the budget.
    starts = [lambda: solve_rotor(floor, max(0.1, min(ROTOR_TIME_LIMIT, deadline - time.perf_counter())))]
    starts += [partial(method.solve, unlimited, None) for method in portfolio(METHOD_INFOS, OBLIVIOUS)
               if method.max_compute is None or problem.n_compute <= method.max_compute]
    for i, start in enumerate(starts):
        if i > 0 and time.perf_counter() >= deadline:
            break
        try:
            sol = start()
        except MethodFailed:
            continue  # e.g. no chain in the graph for rotor
        if sol.peak < best[0]:
            best = (sol.peak, sol.schedule)
    lo = floor.budget - 1  # greedy is not known to succeed at lo
    hi = best[0]
    while hi - lo > max(1, int(hi * BISECTION_RESOLUTION)) and time.perf_counter() < deadline:
        mid = (lo + hi) // 2
        probe = problem.with_budget(mid)
        try:
            sol = solve_greedy(probe, None if deadline == math.inf else max(0.0, deadline - time.perf_counter()))
        except MethodFailed:
            break  # out of time: the lowest peak found so far
        if not sol.fits:
            sol = solve_select(probe, None)
        if sol.fits:
            hi = sol.peak  # the greedy may land below mid: jump straight there
            best = (sol.peak, sol.schedule)
        else:
            lo = mid
    best = _recompute_down(floor, best, min(deadline, time.perf_counter() + REPAIR_TIME_LIMIT))
    peak = simulate(problem, best[1]).peak
    assert peak == best[0]
    if problem.has_host:
        # Page out the lowest-peak schedule and store-all's: with every value kept, more of
        # them sit idle across the peak (tiny GPT: 2.38 MB paged from rotor's, 2.32 from store-all's).
        for schedule in (best[1], store_all.schedule):
            paged = add_offloads(floor, schedule, min(deadline, time.perf_counter() + PAGING_TIME_LIMIT))
            paged_peak = simulate(problem, paged).peak
            if paged_peak < best[0]:
                best = (paged_peak, paged)
    return best


def _recompute_down(floor: Problem, best: tuple[int, Schedule], deadline: float) -> tuple[int, Schedule]:
    """``best`` with idle values freed across its peak and recomputed later, aimed at
    ``floor.budget``: the bisection's greedy and "select" decide what to keep value by value,
    and leave whole stages of activations resident that a later recomputation would free."""
    repaired = add_recomputations(floor, best[1], deadline)
    peak = simulate(floor, repaired).peak
    return (peak, repaired) if peak < best[0] else best


# Searches remembered by problem content, across Problem objects (`min_budget_cached`).
_FOUND: OrderedDict[bytes, tuple[int, Schedule]] = OrderedDict()
FOUND_KEPT = 32  # the most recent searches remembered (each holds one schedule)


def _content_key(problem: Problem) -> bytes:
    """A digest of everything but the budget that a schedule's peak depends on."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(repr((problem.names, problem.preds, problem.host_bandwidth, problem.host_capacity)).encode())
    for arr in (problem.mem, problem.cost, problem.recomputable, problem.alias_of, problem.offloadable,
                problem.same_storage, problem.host_work):
        digest.update(arr.tobytes())
    return digest.digest()


def min_budget_cached(problem: Problem, deadline: float = math.inf) -> tuple[int, Schedule]:
    """`min_budget`, remembered per graph and host link (the budget does not change the
    answer, so every `Problem.with_budget` variant shares it), and for the process by the
    problem's content: the search's repair and paging stop at time limits, so a second search
    on a busier machine may stop higher, and a user who plans at the minimum an `Infeasible`
    reported (a second `memplan.optimize` builds a new Problem) must get that minimum's plan.
    A search cut short by ``deadline`` is returned but not remembered."""
    cache = problem.budget_free_cache
    if "min_budget" not in cache:
        key = _content_key(problem)
        if key in _FOUND:
            _FOUND.move_to_end(key)
        else:
            found = min_budget(problem, deadline)
            if time.perf_counter() >= deadline:
                return found  # cut short: not the answer to remember
            _FOUND[key] = found
            while len(_FOUND) > FOUND_KEPT:
                _FOUND.popitem(last=False)
        cache["min_budget"] = _FOUND[key]
    return cache["min_budget"]
