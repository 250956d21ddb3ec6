"""Method "offload": keep / recompute / offload plans that minimise step time.

Recomputation pays FLOPs for memory; offloading pays host-link time, which
is free as long as the copies hide behind compute. `solve_offload` first
pages (`paging.add_offloads`) store-all's schedule recomputed down to
budgets between the target and store-all's peak (seconds; capped at
`DESCENT_SHARE` of the time), then gives the time left to the hierarchical
strategy on the problem with its host link, with the fastest of those paged
plans as a seed: each model of its drop search runs without pagings, then
with them (per group of values: keep, recompute, or page out across a gap
between uses, with rows that keep the copies within the link's time,
`hierarchical.pagings`), the paging runs only for as long as they find
faster plans; the paging windows place the copies. With time still left
(the hierarchical search stops at 85% of its limit) it builds
rematerialization plans at several budgets between the target and
store-all's peak (a looser budget means fewer recomputations) and pages each
down to the target, a run only when the time left covers the longest run so
far. The plan with the shortest simulated step time wins.
"""
from __future__ import annotations

import time
from typing import Optional

from ..core.problem import Problem
from ..core.schedule import Schedule, simulate
from ..core.solution import Solution, finish
from ..methods.memory_bounds import store_all_peak
from ..methods.store_all import solve_store_all
from ..transforms.paging import add_offloads
from ..transforms.repair import descend
from .hierarchical import solve_hierarchical
from .min_budget import min_budget_cached
from .remat import solve_remat

# Rematerialization plans are made at these points between the target budget (0)
# and store-all's peak (1); each then gets offloads until it fits the target.
BASE_FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)
DESCENT_SHARE = 0.05  # of the time limit, at most, for paging store-all recomputed down (the first candidates)
HIERARCHICAL_SHARE = 1.0  # of the time left then, for the hierarchical strategy (it stops its search at 85% of
# that, then polishes: the sweep gets the rest)
SWEEP_MIN = 0.5  # seconds: the least a remat plan of the sweep is given (none is started with less, once a plan fits)


def solve_offload(problem: Problem, time_limit: Optional[float] = None, *, hierarchical_share: float = HIERARCHICAL_SHARE
                  ) -> Solution:
    """Fastest fitting plan of paging store-all recomputed down, of the joint covering ILP
    (``hierarchical_share`` of the time left after that; 0 leaves it out) and of the paging sweep over
    remat plans (with any time still left)."""
    started = time.perf_counter()
    remat = problem.with_host(0.0, None)
    if not problem.has_host:
        sol = solve_remat(remat, time_limit)
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
    descent_end = started + (DESCENT_SHARE if hierarchical_share > 0 else 1.0) * limit
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
    if hierarchical_share > 0:
        # The hierarchical strategy's covering ILP chooses keep / recompute / offload per group
        # together; it gets ``hierarchical_share`` of the time that is left, and the fastest paged
        # descent as a seed: `pin_search` and the drop search's paging runs measure themselves
        # against it rather than against remat-only plans.
        left = deadline - time.perf_counter()
        # Only the paged descents have been considered so far: the best plan is the fastest of them.
        seeds = [] if best is None else [(best[2], f"store_all (repaired to {best[3]['base_budget']}, paged)")]
        joint = solve_hierarchical(problem, max(SWEEP_MIN, hierarchical_share * left), seeds=seeds)
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
        base = solve_remat(remat.with_budget(target), share)
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
