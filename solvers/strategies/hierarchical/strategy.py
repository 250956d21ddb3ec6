"""`solve_hierarchical`: a short driver over the strategy's phases, which share one `SolveState`.

The result is always a simulated schedule. The fast methods tagged `RACE` in the registry
(store_all, greedy, select, rotor's chain DP; sqrt_n when time is left) are raced first and
are the fallback; store-all is recomputed down to the budget in steps (`repair.recompute_down`).
The coarse graph's drop plans (`search.drop_search`) come from a small portfolio of cluster gaps
and chain models sharing the time; the best are polished by `search.keep_again`. Graphs small
enough get the exhaustive search (<= `EXACT_NODES` values) or Checkmate on the fine or coarse
graph (<= `CHECKMATE_NODES`). Plans over the budget that cost less than the best fitting one are
repaired by `repair.add_recomputations`; store-all is recomputed down again through other stops
with half the search time left (the greedy repair ends far apart from one set of stops to
another); `pin_search` spends the rest keeping values the best plan recomputes and repairing
elsewhere. When nothing fits the lowest peak found is returned (status ``over_budget``). A fitting
winner is polished by `polish.keep_recomputed` (recomputations the budget does not need are
undone).

With a host link each drop-search model runs without pagings, then with them; the paging runs
stop at the first whose plan is not faster than the best plan so far (plans made elsewhere,
``seeds``, count): on graphs where paging does not pay, the descents and `pin_search` get the time.

``lower_bound``: `solvers.methods.lower_bounds.lower_bound` when that module is present (valid
for every schedule), else the sum of all costs (`_bound` is the plug-in point), computed in a
child process on a second core while the search runs (`background`, limits of
`BACKGROUND_MIN_LIMIT` seconds or more), else in the last tenth of the limit. The search ends
early once its best plan is within `EARLY_GAP` (or `solvers.solve`'s ``gap``) of a bound proved
so far: a quick bound on graphs up to `EARLY_STOP_MAX_VALUES` values, or what the child has printed.

How the time limit is split: `settings.TimeShares`.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ...core.method import RACE, portfolio, stop_gap, within_gap
from ...core.problem import Problem
from ...core.schedule import Schedule, simulate
from ...core.solution import FEASIBLE, MethodFailed, Solution, finish
from ...methods.catalog import METHOD_INFOS
from ...methods.checkmate import solve_checkmate
from ...methods.exhaustive import solve_exhaustive
from ...methods.sqrt_n import solve_sqrt_n
from ...transforms.coarsen import Coarsening, coarsen
from ...transforms.pin_search import pin_search
from ...transforms.polish import keep_recomputed
from ...transforms.repair import DESCENT, add_recomputations, recompute_down
from ..background import BackgroundBound, usable_cores
from .planner import DropPlanner, Evaluation
from .search import SearchLog, drop_search, keep_again
from .settings import (
    BACKGROUND_MIN_LIMIT,
    BACKGROUND_MIN_VALUES,
    CHECKMATE_NODES,
    DEFAULT_TIME_LIMIT,
    EARLY_GAP,
    EARLY_STOP_MAX_VALUES,
    EXACT_NODES,
    KEEP_AGAIN_REACH,
    MORE_DESCENTS,
    POLISHED,
    SHARES,
    VARIANTS,
)

# A drop plan found by one model of the portfolio: its planner, its evaluation, the model's label.
Found = tuple[DropPlanner, Evaluation, str]


# --------------------------------------------------------------------------- #
# What the phases share
# --------------------------------------------------------------------------- #


@dataclass
class _Incumbent:
    """The fastest fitting plan found so far, and the fastest without host transfers (where
    `pin_search` starts: it moves recomputations, not copies)."""

    schedule: Optional[Schedule] = None
    time: float = math.inf
    label: Optional[str] = None
    remat: Optional[tuple[Schedule, float, str]] = None

    def offer(self, schedule: Schedule, step_time: float, label: str) -> bool:
        """Keep ``schedule`` (which fits) if it is faster; True when it is the best plan now."""
        if not schedule.has_transfers() and (self.remat is None or step_time < self.remat[1]):
            self.remat = (schedule, step_time, label)
        if step_time < self.time:
            self.schedule, self.time, self.label = schedule, step_time, label
            return True
        return False


@dataclass
class SolveState:
    """One solve: its clock and deadline, the best plan so far, the baselines, the drop
    searches' log, the quick bound, and ``info`` (returned in the solution)."""

    problem: Problem
    started: float  # `time.perf_counter` at the start
    limit: float  # seconds
    deadline: float  # the search ends by then (later when the bound runs in a child process)
    info: dict[str, Any] = field(default_factory=dict)
    clock: dict[str, float] = field(default_factory=dict)  # phase -> seconds since the start when it ended
    best: _Incumbent = field(default_factory=_Incumbent)
    quick: list[Solution] = field(default_factory=list)  # the baselines raced first
    store_all: Optional[Solution] = None  # store-all's baseline, where the descents start
    log: SearchLog = field(default_factory=SearchLog)  # the drop searches'
    quick_bound: Optional[float] = None  # computed once, when the first plan fits
    background: Optional[BackgroundBound] = None  # the lower bound in a child process
    exact_bound: float = -math.inf  # the exhaustive search's bound, when it ran

    @classmethod
    def begin(cls, problem: Problem, time_limit: Optional[float]) -> SolveState:
        started = time.perf_counter()
        limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
        # Leave room for the final simulation and the bound.
        return cls(problem=problem, started=started, limit=limit, deadline=started + SHARES.search_deadline * limit)

    def at(self, share: float) -> float:
        """The instant ``share`` of the time limit after the start."""
        return self.started + share * self.limit

    def lap(self, phase: str) -> None:
        """Record that ``phase`` ends now (``info["clock"]``: where the time went)."""
        self.clock[phase] = round(time.perf_counter() - self.started, 3)

    @property
    def gap(self) -> float:
        """How close to a proven bound the best plan must be for the search to stop
        (`solvers.solve`'s ``gap``, else `EARLY_GAP`)."""
        return stop_gap(EARLY_GAP)

    def proved_bound(self) -> Optional[float]:
        """The best lower bound proved so far, without waiting: the quick bound (computed here
        once, on graphs up to `EARLY_STOP_MAX_VALUES` values) and what the child has printed."""
        if self.quick_bound is None and self.problem.n <= EARLY_STOP_MAX_VALUES:
            self.quick_bound = _bound(self.problem, SHARES.quick_bound_share * self.limit, milp=False)[0]
            self.info["quick_bound"] = self.quick_bound
        child = None if self.background is None else self.background.proved()
        proved = [b for b in (self.quick_bound, child) if b is not None and math.isfinite(b)]
        return max(proved) if proved else None

    def certified(self) -> bool:
        """Whether the best plan is within `gap` of a proven lower bound: the search can stop."""
        if self.best.schedule is None or not within_gap(self.best.time, self.proved_bound(), self.gap):
            return False
        self.info.setdefault("certified_at", round(time.perf_counter() - self.started, 3))
        return True


# --------------------------------------------------------------------------- #
# The driver
# --------------------------------------------------------------------------- #


def solve_hierarchical(problem: Problem, time_limit: Optional[float] = None, *, exact: bool = True,
                       seeds: Sequence[tuple[Schedule, str]] = ()) -> Solution:
    """The search ends early once its best plan is within `EARLY_GAP` (`solvers.solve`'s ``gap``)
    of a bound proved so far (`SolveState.certified`).
    ``exact=False`` leaves out the exact phase for small graphs (to measure the drop search alone).
    ``seeds``: plans made elsewhere (`offload.solve_offload`'s paged descents), each with a label;
    those that fit join the baselines, so that the search is measured against them."""
    state = SolveState.begin(problem, time_limit)
    done = race_baselines(state)
    if done is not None:
        return done  # store-all fits
    start_background_bound(state)
    offer_baselines(state, seeds)
    descend_store_all(state)
    c = coarsen_graph(state)
    results = search_drop_plans(state, c)
    polish_drop_plans(state, results)
    run_exact(state, c, exact)
    repair_cheaper_plans(state)
    more_descents(state)
    pin_best(state)
    schedule, cost, chosen = state.best.schedule, state.best.time, state.best.label
    if schedule is None:
        schedule, chosen = fallback_plan(state)  # over budget when nothing fits: the caller sees it
    schedule = polish_winner(state, schedule, cost)
    state.info["chosen"] = chosen
    bound, source = compute_bound(state, cost)
    bound = checked_bound(state, schedule, bound, source)
    return finish(problem, schedule, "hierarchical", state.started, lower_bound=bound, status=FEASIBLE,
                  info=state.info)


# --------------------------------------------------------------------------- #
# The phases, in order
# --------------------------------------------------------------------------- #


def race_baselines(state: SolveState) -> Optional[Solution]:
    """Fast baselines first: a schedule to return whatever happens next. When store-all fits,
    the solution (nothing else to do)."""
    problem, info = state.problem, state.info
    quick = state.quick
    for method in portfolio(METHOD_INFOS, RACE):
        name = method.name
        try:
            quick.append(method.solve(problem, max(0.5, SHARES.race * state.limit)))
        except MethodFailed:
            continue
        if name == "store_all" and quick[-1].fits:
            info["chosen"] = "store_all"
            return finish(problem, quick[-1].schedule, "hierarchical", state.started,
                          lower_bound=problem.total_cost(), info=info)
    state.lap("baselines")
    return None


def start_background_bound(state: SolveState) -> None:
    """The lower bound on a second core while the search goes on: then the search, not the bound,
    has the end of the time limit (`background`)."""
    problem = state.problem
    if (state.limit >= BACKGROUND_MIN_LIMIT and problem.n_compute > BACKGROUND_MIN_VALUES and not problem.has_host
            and usable_cores() >= 2):
        # The child's own start comes out of this (it is given a deadline).
        state.background = BackgroundBound.start(problem, state.at(SHARES.bound_end) - time.perf_counter())
        if state.background is not None:
            state.deadline = state.at(SHARES.background_search_deadline)
    state.info["bound_in_background"] = state.background is not None


def offer_baselines(state: SolveState, seeds: Sequence[tuple[Schedule, str]]) -> None:
    """The baselines that fit and the ``seeds`` that fit are the first plans, then each baseline
    polished (milliseconds): the ranking can change once their models' slack is used."""
    problem, info, best = state.problem, state.info, state.best
    fitting = [s for s in state.quick if s.fits]
    for s in fitting:
        best.offer(s.schedule, s.objective, s.method)
    for schedule, label in seeds:
        result = simulate(problem, schedule)
        if result.fits:
            best.offer(schedule, result.time, label)
    info["baseline_cost"] = best.time
    for s in fitting:
        polished = keep_recomputed(problem, s.schedule, state.at(SHARES.baseline_polish_end))
        if polished is not s.schedule:
            result = simulate(problem, polished)
            best.offer(polished, result.time, s.method + " (polished)")


def descend_store_all(state: SolveState) -> None:
    """Store-all recomputed down to the budget in steps (a second or so), then polished: often
    the best plan on CNNs and U-Nets."""
    info, best = state.info, state.best
    state.store_all = next((s for s in state.quick if s.method == "store_all"), None)
    if state.store_all is not None:
        found = _descent(state.problem, state.store_all.schedule, state.at(SHARES.descent_end))
        if found is not None:
            info["descent"] = found[1]
            best.offer(*found, "store_all (recomputed down)")
    info["baseline_polished"] = best.time
    state.lap("descent")


def coarsen_graph(state: SolveState) -> Coarsening:
    """The coarse graph the drop searches plan on (`coarsen`)."""
    t0 = time.perf_counter()
    c = coarsen(state.problem)
    state.info["coarse_nodes"] = c.coarse.n_compute
    state.info["coarsen_time"] = round(time.perf_counter() - t0, 3)
    return c


def search_drop_plans(state: SolveState, c: Coarsening) -> list[Found]:
    """A small portfolio of models (`VARIANTS`: cluster gaps and the two readings of
    recomputation chains), each a `drop_search` over ``c``; each run is cheap. The plans found.

    A second pass (the first two variants again, from scratch, until `unfit_search_end`) runs
    only when nothing fits yet: polishing is worth nothing without a plan. With a host link
    every model is run without pagings (the remat-only search, quicker per round) and then with
    them. The paging runs stop at the first whose plan is not faster than the best plan so far:
    each takes several times a remat-only run, time the descents and `pin_search` turn into
    faster plans where paging does not pay. Models that round to the same cluster gap on a small
    graph are run once."""
    problem, best, log = state.problem, state.best, state.log
    t0 = time.perf_counter()
    results: list[Found] = []
    planners: dict[int, DropPlanner] = {}
    tried = []
    search_end = state.started + SHARES.search_share * (state.deadline - state.started)
    variants = list(dict.fromkeys(
        (max(1, int(c.coarse.n * f)), ch, paging)
        for f, ch in VARIANTS for paging in ((False, True) if problem.has_host else (False,))))
    paging_pays = True  # until a paging run finds a plan, but none faster than the best so far
    for k, (gap, chains, paging) in enumerate(variants + variants[:2]):
        now = time.perf_counter()
        second_pass = k >= len(variants)
        if (second_pass and results) or state.certified():
            break
        if paging and not paging_pays:
            continue
        # Nothing fits yet: search on, but leave the repairs their share.
        if (second_pass or not results) and now >= search_end:
            end = state.at(SHARES.unfit_search_end)
        else:
            end = search_end
        if now >= end:
            if second_pass or results:
                break
            continue
        if gap not in planners:
            planners[gap] = DropPlanner(c, gap)
        planner = planners[gap]
        # Most of the window to the first variant (it ends early once its ILP repeats itself),
        # then a share of what is left to each next one (later ones get what the earlier ones leave).
        share = max(0.5, (end - now) * (SHARES.first_share if k == 0 else SHARES.next_share))
        so_far = min([best.time] + [r[1].time for r in results])
        # Until some drop plan fits, a run cut off at its share would have searched for nothing:
        # it may go on to the end of the window.
        found = drop_search(planner, problem.budget, min(end, now + share), log, chains=chains, paging=paging,
                            first_fit_by=None if results else end)
        label = f"gap={gap},chains={int(chains)}" + (",paging" if paging else "") + (",again" if second_pass else "")
        tried.append({"variant": label, "step_time": None if found is None else found.time,
                      "time": round(time.perf_counter() - now, 2)})
        if found is not None:
            results.append((planner, found, label))
        if paging and found is not None:  # no plan at all says little: the next model may find one
            paging_pays = found.time < so_far
    state.info["variants"] = tried
    state.lap("drop_search")
    state.info["ilp_time"] = round(time.perf_counter() - t0, 3)
    return results


def polish_drop_plans(state: SolveState, results: list[Found]) -> None:
    """The fastest drop plans (up to `POLISHED`, within `KEEP_AGAIN_REACH` of the best plan)
    polished by `keep_again`; they then compete with the plans so far."""
    info, best, log = state.info, state.best, state.log
    if results:
        results.sort(key=lambda r: r[1].time)
        info["ilp_time_found"] = results[0][1].time
        t0 = time.perf_counter()
        for planner, found, label in results[:POLISHED]:
            if time.perf_counter() >= state.deadline or found.time > KEEP_AGAIN_REACH * best.time or state.certified():
                break
            found = keep_again(planner, found, state.problem.budget, state.deadline, log)
            if best.offer(found.schedule, found.time, "drop_ilp"):
                info["variant"] = label
                info["keep_again_step_time"] = found.time
        info["keep_again_time"] = round(time.perf_counter() - t0, 3)
        state.lap("keep_again")
    info.update(rounds=log.rounds, ilp_solves=log.ilp_solves, simulations=log.simulations)


def run_exact(state: SolveState, c: Coarsening, exact: bool) -> None:
    """Small graphs: the exact search, or Checkmate on the fine or coarse graph, with the search
    time left (not when ``exact`` is False or the best plan is certified)."""
    problem, info, best = state.problem, state.info, state.best
    remaining = state.deadline - time.perf_counter()
    if not exact or state.certified():
        return
    if problem.n_compute <= EXACT_NODES:
        try:
            sol = solve_exhaustive(problem, remaining)
            info["exact"] = sol.status
            if sol.fits:
                best.offer(sol.schedule, sol.objective, "exhaustive")
            if sol.fits and sol.lower_bound is not None:
                state.exact_bound = sol.lower_bound
        except MethodFailed:
            pass
    elif remaining > 0.5 and min(problem.n_compute, c.coarse.n_compute) <= CHECKMATE_NODES:
        on_fine = problem.n_compute <= CHECKMATE_NODES
        target = problem if on_fine else c.coarse
        sol = solve_checkmate(target, remaining)
        schedule = sol.schedule if on_fine else c.fine_schedule_of(sol.schedule)
        result = simulate(problem, schedule)
        info["checkmate"] = {"graph": "fine" if on_fine else "coarse", "status": sol.status, "cost": result.cost}
        if result.fits:
            best.offer(schedule, result.time, "checkmate_" + ("fine" if on_fine else "coarse"))


def repair_cheaper_plans(state: SolveState) -> None:
    """Plans over the budget that cost less than the best fitting one (rotor's chain model and the
    drop ILP miss tight budgets, often by little): repaired by recomputation, nearest the budget
    first, by `repair_end`. The clock's lap counts the exact phase too."""
    problem, info, best, log = state.problem, state.info, state.best, state.log
    over = [(s.peak, s.objective, s.schedule, s.method) for s in state.quick if not s.fits]
    if log.closest is not None:
        over.append((log.closest.peak, log.closest.time, log.closest.schedule, "drop_ilp (closest)"))
    if log.floored is not None and log.floored is not log.closest:
        over.append((log.floored.peak, log.floored.time, log.floored.schedule, "drop_ilp (floored)"))
    over = [e for e in sorted(over, key=lambda e: e[:2]) if e[1] < best.time]  # nearest the budget first
    repairs = []
    repair_end = state.at(SHARES.repair_end)
    for i, (_, cost, schedule, label) in enumerate(over):
        now = time.perf_counter()
        if cost >= best.time or now >= repair_end or state.certified():
            continue
        fixed = add_recomputations(problem, schedule, now + (repair_end - now) / (len(over) - i))
        result = simulate(problem, fixed)
        repairs.append({"from": label, "fits": result.fits, "time": result.time})
        if result.fits:
            best.offer(fixed, result.time, label + " (repaired)")
    if repairs:
        info["repairs"] = repairs
    state.lap("exact_and_repairs")


def more_descents(state: SolveState) -> None:
    """Time left: store-all recomputed down through other stops. The stepwise repair is greedy
    and where it ends depends much on the stops, so more descents are a cheap search; seeded, so
    a run is reproducible. They take at most as long again as the solve so far: a quick answer
    stays quick."""
    info, best = state.info, state.best
    if state.store_all is None or best.schedule is None:
        return
    rng = random.Random(0)
    fitting_descents = 0
    now = time.perf_counter()
    descents_end = min(now + SHARES.more_descents_share * (state.deadline - now), now + (now - state.started))
    for _ in range(MORE_DESCENTS):
        if time.perf_counter() >= descents_end or state.certified():
            break
        stops = _random_stops(rng)
        found = _descent(state.problem, state.store_all.schedule, descents_end, stops)
        if found is None:
            continue
        fitting_descents += 1
        if best.offer(*found, "store_all (recomputed down, other stops)"):
            info["descent_stops"] = stops
    info["more_descents"] = fitting_descents
    state.lap("more_descents")


def pin_best(state: SolveState) -> None:
    """The rest of the search time: pin what the best plan recomputes, repairing elsewhere
    (`pin_search`). It stops once it has gone `pin_patience` times as long as the solve so far
    without finding a faster plan: a quick answer stays quick, and a long time limit buys more
    search where it keeps paying. With a host link it starts from the fastest plan without
    copies, which may then win."""
    best = state.best
    if best.remat is not None and time.perf_counter() < state.deadline and not state.certified():
        t0 = time.perf_counter()
        start, start_time, start_label = best.remat
        pinned = pin_search(state.problem, start, state.deadline, patience=SHARES.pin_patience * (t0 - state.started))
        if pinned is not start:
            after = simulate(state.problem, pinned).time
            state.info["pin_search"] = {"before": start_time, "after": after,
                                        "time": round(time.perf_counter() - t0, 3)}
            best.offer(pinned, after, f"{start_label} (pinned)")
        state.lap("pin_search")


def fallback_plan(state: SolveState) -> tuple[Schedule, str]:
    """Nothing fits: the other constructive baselines if time allows, then the cheapest plan that
    fits, else the lowest peak; with its label."""
    problem, log = state.problem, state.log
    pool: list[tuple[int, float, Schedule, str]] = [(s.peak, s.cost, s.schedule, s.method) for s in state.quick]
    if log.closest is not None:
        pool.append((log.closest.peak, log.closest.cost, log.closest.schedule, "drop_ilp (closest)"))
    for name, solve in (("sqrt_n", solve_sqrt_n),):  # recompute_all: far slower, never better
        if time.perf_counter() >= state.at(SHARES.sqrt_n_end):
            break  # seconds on large graphs
        try:
            s = solve(problem, None)
        except MethodFailed:
            continue
        pool.append((s.peak, s.cost, s.schedule, name))
    fitting = [e for e in pool if e[0] <= problem.budget]
    pick = min(fitting, key=lambda e: e[1]) if fitting else min(pool, key=lambda e: (e[0], e[1]))
    return pick[2], pick[3]


def polish_winner(state: SolveState, schedule: Schedule, cost: float) -> Schedule:
    """The winner was planned in some model (rotor's chain, the stages); undo the
    recomputations the real budget does not need (a fitting winner only: ``cost`` finite)."""
    if schedule is not None and cost < math.inf:
        t0 = time.perf_counter()
        polished = keep_recomputed(state.problem, schedule, state.at(SHARES.final_polish_end))
        if polished is not schedule:
            state.info["polished"] = {"before": cost, "time": round(time.perf_counter() - t0, 3)}
            schedule = polished
    return schedule


def compute_bound(state: SolveState, cost: float) -> tuple[float, str]:
    """The lower bound and where it comes from: a bound already proved (the quick one, or the
    child's so far) when it certifies ``cost``, else the child's (`background`) or one computed
    here, whichever is higher."""
    problem, background = state.problem, state.background
    t0 = time.perf_counter()
    certifying = _certifying_bound(state, cost)
    if certifying is not None:
        bound, bound_source = certifying  # certified: done
        if background is not None:
            background.close()
    else:
        # A search that used its time waits for the child, which has had all of it. One that ended
        # early takes what the child has proved so far and computes the bound here as before, so
        # that it still answers early (a child starved by other work would make it wait).
        waited = background is not None and time.perf_counter() >= state.deadline
        until = state.at(SHARES.bound_end) if waited else time.perf_counter()
        value = None if background is None else background.result(until)
        proved = value if value is not None and math.isfinite(value) else None
        if proved is not None and waited:
            bound, bound_source = max(proved, problem.total_cost()), "lower_bounds.lower_bound (background)"
        else:
            left = state.at(SHARES.bound_end) - time.perf_counter()
            bound, bound_source = _bound(problem, max(0.1, min(SHARES.bound_share * state.limit, left)))
            if proved is not None and proved > bound:
                bound, bound_source = proved, "lower_bounds.lower_bound (background)"
        if state.quick_bound is not None and state.quick_bound > bound:
            bound, bound_source = state.quick_bound, "lower_bounds.lower_bound (quick)"
    state.info["bound_time"] = round(time.perf_counter() - t0, 3)
    state.lap("bound")
    state.info["clock"] = state.clock
    return bound, bound_source


def _certifying_bound(state: SolveState, cost: float) -> Optional[tuple[float, str]]:
    """The highest bound proved so far (quick, or the child's), with its source, when it puts
    ``cost`` within the stop gap; None otherwise. Nothing new is computed or waited for."""
    child = None if state.background is None else state.background.proved()
    proved = [(b, f"lower_bounds.lower_bound ({source})")
              for b, source in ((state.quick_bound, "quick"), (child, "background"))
              if b is not None and math.isfinite(b)]
    if not proved:
        return None
    bound, source = max(proved)
    return (max(bound, state.problem.total_cost()), source) if within_gap(cost, bound, state.gap) else None


def checked_bound(state: SolveState, schedule: Schedule, bound: float, bound_source: str) -> float:
    """``bound``, raised to the exhaustive search's; a bound above the simulated schedule is wrong
    and is not passed on (the sum of all costs instead). Records where it comes from."""
    problem, info = state.problem, state.info
    if state.exact_bound > bound:
        bound, bound_source = state.exact_bound, "exhaustive"
    cost = simulate(problem, schedule).cost
    if bound > cost * (1 + 1e-6):  # a bound above a simulated schedule is wrong: do not pass it on
        info["bound_rejected"] = bound
        bound, bound_source = problem.total_cost(), "total_cost"
    info["bound_from"] = bound_source
    return bound


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _descent(problem: Problem, schedule: Schedule, end: float, stops: tuple[float, ...] = DESCENT
             ) -> Optional[tuple[Schedule, float]]:
    """``schedule`` recomputed down to the budget through ``stops`` (`repair.recompute_down`),
    then polished, with its simulated step time; None when it does not fit by ``end``.

    Where views share one storage (`Problem.same_storage`), the descent is also run with each
    view counted on its own (`Problem.with_views_apart`): its plans fit the problem too, and
    the greedy steps it takes differ. Neither is better everywhere, so the faster plan is kept."""
    found = None
    for guide in dict.fromkeys((problem.with_views_apart(), problem)):
        down = recompute_down(guide, schedule, end, stops)
        if not simulate(guide, down).fits:
            continue
        polished = keep_recomputed(problem, down, end)
        step_time = simulate(problem, polished).time
        if found is None or step_time < found[1]:
            found = polished, step_time
    return found


def _random_stops(rng: random.Random) -> tuple[float, ...]:
    """Stops for `repair.recompute_down`: one to eight shares of the way, decreasing, then 0."""
    return tuple(sorted({round(rng.random(), 2) for _ in range(rng.randint(1, 8))}, reverse=True)) + (0.0,)


def _bound(problem: Problem, time_limit: float, milp: bool = True) -> tuple[float, str]:
    """Best available lower bound valid for every schedule: the plug-in point for tighter bounds.
    ``milp=False``: only the quick relaxations (no MILP)."""
    try:
        from ...methods.lower_bounds import lower_bound  # another module; may be absent
    except ImportError:
        return problem.total_cost(), "total_cost"
    try:
        value = float(lower_bound(problem, time_limit, milp=milp))
    except Exception:  # another module's failure must not sink a valid schedule
        return problem.total_cost(), "total_cost"
    if not math.isfinite(value):
        return problem.total_cost(), "total_cost"
    return max(value, problem.total_cost()), "lower_bounds.lower_bound"
