"""Method "offload_milp" (formerly "joint"): the keep / recompute / offload MILP, run well.

With a host link: first the heuristic "offload"
method (`offload.solve_offload`, a quarter of the time limit); then the
MILP in the problem's order and, when it differs, in the order in which the
heuristic's schedule first computes values (that order comes from an
any-order remat plan, which the problem's order may not allow at tight
budgets), splitting the remaining time. Each MILP is warm-started with the
cheapest fitting remat-only schedule that lies in its space (the
heuristic's, when it has no transfers, or store-all / greedy / select). The
method returns whichever schedule has the shortest simulated time among
those that fit (ties: lower compute cost), so it is never slower than the
heuristic run it made. ``info["milp"]`` records each MILP run (status,
variables, seconds, warm start, its schedule's simulated time and whether
it fits, the model's own time); ``info["chosen"]`` says which candidate won
(``milp0``: problem order, ``milp1``: heuristic's order, ``offload``).
The lower bound is the sum of all compute costs, the only bound valid for
every schedule (the MILP's dual bound is not: its space is restricted).

Without a host link the method is rematerialization only and delegates to
the rematerialization strategy (`remat.solve_remat`).
"""
from __future__ import annotations

import time
from typing import Optional

from ..core.method import HINTS, portfolio
from ..core.problem import Problem
from ..core.schedule import Schedule, simulate
from ..core.solution import MethodFailed, Solution, finish
from ..methods.catalog import METHOD_INFOS
from ..methods.offload_milp import MAX_COMPUTE, first_compute_order, solve_milp
from .offload import solve_offload
from .remat import solve_remat

METHOD = "offload_milp"
DEFAULT_TIME_LIMIT = 30.0
HEURISTIC_SHARE = 0.25  # of the time limit given to the "offload" heuristic run first


def _better(a: Solution, b: Optional[Solution]) -> bool:
    """Whether ``a`` beats ``b``: fitting first, then shorter time, then lower cost / peak."""
    if b is None:
        return True
    if a.fits != b.fits:
        return a.fits
    if not a.fits:
        return a.peak < b.peak
    tol = 1e-9 * max(1.0, b.time)
    if abs(a.time - b.time) > tol:
        return a.time < b.time
    return a.cost < b.cost - 1e-9 * max(1.0, b.cost)


def _remat_hints(problem: Problem, heuristic: Schedule) -> list[Schedule]:
    """Fitting schedules without transfers to warm-start the MILP, cheapest first:
    the heuristic's own when it has none, and the fast remat-only baselines."""
    found: list[tuple[float, Schedule]] = []
    if not heuristic.has_transfers():
        result = simulate(problem, heuristic)
        if result.fits:
            found.append((result.time, heuristic))
    remat = problem.with_host(0.0)
    for method in portfolio(METHOD_INFOS, HINTS):
        try:
            sol = method.solve(remat, None)
        except MethodFailed:
            continue
        if sol.fits:
            found.append((sol.cost, sol.schedule))
    return [schedule for _, schedule in sorted(found, key=lambda item: item[0])]


def solve_joint(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    """Keep / recompute / offload every value to minimise simulated step time within the budget."""
    started = time.perf_counter()
    m = problem.n_compute
    if m > MAX_COMPUTE:
        raise MethodFailed(f"joint: limited to {MAX_COMPUTE} values to compute, got {m}")
    limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    deadline = started + limit
    total = problem.total_cost()
    if not problem.has_host:
        sol = solve_remat(problem, limit)
        # auto's bound holds for every schedule (remat-only is all there is without a link).
        bound = total if sol.lower_bound is None else max(total, sol.lower_bound)
        return finish(problem, sol.schedule, METHOD, started, lower_bound=bound,
                      info={"chosen": sol.info.get("chosen", sol.method), "host": False})
    info: dict = {"host": True}
    # The heuristic first: a schedule to fall back on, and its order of first
    # computations (free of the problem's order) to try in the MILP as well.
    heuristic = solve_offload(problem, max(0.5, HEURISTIC_SHARE * limit))
    info.update(offload_time=heuristic.time, offload_fits=heuristic.fits)
    candidates: list[tuple[str, Schedule]] = []
    orders = [list(problem.non_sources)]
    other = first_compute_order(problem, heuristic.schedule)
    if other != orders[0]:
        orders.append(other)
    hints = _remat_hints(problem, heuristic.schedule)
    runs = []
    for k, order in enumerate(orders):
        remaining = deadline - time.perf_counter()
        if k > 0 and remaining < 0.5:
            break
        run = solve_milp(problem, order, max(0.5, remaining / (len(orders) - k)), hints)
        runs.append(run)
        if run.schedule is not None:
            candidates.append((f"milp{k}", run.schedule))
    info["milp"] = [{"status": r.status, "model_time": r.model_time, "variables": r.variables, "hinted": r.hinted,
                     "seconds": round(r.seconds, 3),
                     "time": None if r.schedule is None else simulate(problem, r.schedule).time,
                     "fits": None if r.schedule is None else simulate(problem, r.schedule).fits} for r in runs]
    candidates.append(("offload", heuristic.schedule))
    best: Optional[Solution] = None
    for name, schedule in candidates:
        # finish calls it optimal only when its step time meets the bound: nothing
        # recomputed and no waits, so no schedule is faster.
        sol = finish(problem, schedule, METHOD, started, lower_bound=total, info={**info, "chosen": name})
        if _better(sol, best):
            best = sol
    assert best is not None
    best.solve_time = time.perf_counter() - started
    return best
