"""Paging as the budget asks (``parameters="auto"``): in host memory, the parameters a step that
does not fit otherwise needs there, the largest first.

The step is solved with its parameters on the device first, its optimizer state moving to the
host as `memplan.pipeline.plan.whole_step_plan` moves it (a step whose parameters, buffers and
inputs alone exceed the budget skips that). Where no plan fits, every parameter paged (ZeRO-
Infinity's fixed rule) is solved first, then fewer, the largest first (`memplan.passes.paging`):
as many bytes as the closest plan was over the budget and a quarter more (a fetched copy is
device memory while its readers run), then at least as many again as are paged already at each
attempt that does not fit. Each attempt is the captured step's graph copied and paged
(`memplan.pipeline.stages.analyze_paged`), its costs reused.

A paged step keeps every parameter's optimizer state in host memory: a paged parameter's update
runs there, and the state of one left on the device would take back what the paging freed
(state moves to the host before any parameter is paged).
"""
from __future__ import annotations

import math
from typing import Callable, Protocol

from memplan.passes.paging import is_paged
from memplan.planning.analysis import Analysis
from memplan.core.config import TUNABLES
from memplan.pipeline.clock import Attempts
from memplan.pipeline.errors import InfeasibleBudgetError, none_where_unfit


class SolvedStep(Protocol):
    """What this module reads of a solved plan (`memplan.pipeline.plan.Plan`, whose module calls this one)."""

    analysis: Analysis
    predicted_time: float
    store_all_time: float  # (the step's time with nothing recomputed or moved: no plan of it is faster)


# A paged parameter's fetched copy is device memory while its readers run: page this much more
# than the closest plan was over the budget.
PAGING_MARGIN = 1.25
# The share of what is left of the limit that the attempt with every parameter on the device gets,
# where every parameter paged may be solved after it for comparison.
DEVICE_SHARE = 0.5


def sources_over(analysis: Analysis, budget: int) -> int:
    """Bytes by which the step's parameters, buffers and inputs alone (resident all step on the
    device while nothing is paged) exceed ``budget``; 0 or less where they fit."""
    return analysis.param_bytes + analysis.buffer_bytes + analysis.input_bytes - budget


def paging_candidates(analysis: Analysis) -> list[tuple[str, int]]:
    """(name, bytes) of the step's parameters not paged yet, the largest first (graph order between equals)."""
    cap = analysis.capture
    found = [(info.name, analysis.costs.values[node.name].nbytes)
             for node, info in zip(cap.placeholders(), cap.primals) if info.kind == "param" and not is_paged(node)]
    return sorted(found, key=lambda item: -item[1])


def plan_paging_as_needed(analysis: Analysis, budget: int, solve: Callable[[Analysis, bool, float | None], SolvedStep],
                          page: Callable[[frozenset[str]], Analysis], paged_already: frozenset[str] = frozenset(),
                          time_left: Callable[[], float] = lambda: math.inf,
                          probe_seconds: float = 1.0) -> SolvedStep:
    """The plan of ``analysis``'s step under ``budget``, paging parameters where it does not fit
    otherwise (`page_until_fits`, whose arguments these are).

    ``solve(analysis, last, seconds)`` solves one step; ``page(names)`` is the step with the
    parameters ``names`` paged, every state in host memory. A paged step probed and then solved
    in full is paged once (a graph copy and its lowering: seconds on a billion parameters); the
    steps kept are every parameter paged and the last other one."""
    kept: dict[frozenset[str], Analysis] = {frozenset(): analysis}

    def paged(names: frozenset[str]) -> Analysis:
        if names not in kept:
            for old in [k for k in kept if k and k != every]:
                del kept[old]
            kept[names] = page(names)
        return kept[names]

    candidates = paging_candidates(analysis)
    every = frozenset(name for name, _ in candidates)
    return page_until_fits(candidates, sources_over(analysis, budget), budget,
                           lambda names, last, seconds: solve(paged(names), last, seconds),
                           paged_already, time_left, probe_seconds)


def page_until_fits(candidates: list[tuple[str, int]], over: int, budget: int,
                    solve: Callable[[frozenset[str], bool, float | None], SolvedStep],
                    paged_already: frozenset[str] = frozenset(), time_left: Callable[[], float] = lambda: math.inf,
                    probe_seconds: float = 1.0) -> SolvedStep:
    """The plan of a step under ``budget``, ``candidates`` ((name, bytes) of its parameters, the
    largest first) paged as the attempts of the module's docstring find: never slower (predicted)
    than every parameter paged, where a plan updating on the host was found.

    ``over``: bytes by which the parameters, buffers and inputs alone exceed the budget (`sources_over`;
    over 0, no attempt leaves every parameter on the device). ``solve(names, last, seconds)``: the
    step with the parameters ``names`` paged (none: as captured), solved in at most ``seconds``
    (None: what is left of the limit), raising `InfeasibleBudgetError`; ``last``: no attempt follows,
    so its error may search for the minimum budget (minutes on a billion parameters: the attempts
    before it only say how far over they are). ``time_left()``: seconds left of the planning call's
    limit.

    How the limit is shared: the attempt with every parameter on the device (which moves state to
    the host by itself) gets `DEVICE_SHARE` of what is left, and where it fits updating on the host,
    every parameter paged gets the rest, each solved in full. Where it does not fit, every parameter
    paged (the fixed rule, which fits where any paging does) is probed first (``probe_seconds``),
    then, while time is left, fewer parameters paged, the largest first; the first of those that
    fits is taken where its probe is faster, and the plan taken is solved again in what is left.
    ``paged_already``: names of parameters an earlier plan of the model put in host memory (for
    other inputs, or for the same before it learned how its outputs are used), paged from the
    first attempt on: their storage is host memory now. An attempt made while a plan is in hand is
    started only where the time left covers what the last attempt took (`Attempts`)."""
    attempts = Attempts(time_left)

    def solve_timed(names: frozenset[str], last: bool, seconds: float | None) -> SolvedStep:
        return attempts.run(lambda: solve(names, last, seconds))

    every = frozenset(name for name, _ in candidates)
    paged = [name for name, _ in candidates if name in paged_already]
    paged_bytes = sum(nbytes for name, nbytes in candidates if name in paged_already)
    candidates = [(name, nbytes) for name, nbytes in candidates if name not in paged_already]
    over -= paged_bytes
    if over <= 0 or not candidates:
        try:
            plan = solve_timed(frozenset(paged), not candidates, time_left() * DEVICE_SHARE if candidates else None)
        except InfeasibleBudgetError as exc:
            if not candidates:
                raise
            over = exc.min_budget - budget
        else:
            if (not candidates or not plan.analysis.lowered.host_states or time_left() <= 0
                    or plan.predicted_time <= plan.store_all_time * (1 + TUNABLES.default_gap)):
                # (nothing to page, nothing updated on the host, no time left for the comparison, which
                # the time is shared for, or within the solver's own stopping gap of the step's time with
                # nothing recomputed or moved, which paging, adding fetches, does not beat: llama-7b's
                # plan is 1.0003x)
                return plan
            # A device parameter updated on the host goes out and back over the link each step, with
            # its gradient; a paged one is stepped where it is, its gradient out and its fetches in.
            other = none_where_unfit(lambda: solve_timed(every, False, None))
            return other if other is not None and other.predicted_time < plan.predicted_time else plan
    best, taken, probed = none_where_unfit(lambda: solve_timed(every, False, probe_seconds)), every, True
    if best is None:  # (not within a probe: in full, its error the call's, with the minimum searched for)
        best, probed = solve_timed(every, True, None), False
    failed = False  # (at least as many again as are paged only after an attempt has fallen short)
    while candidates and attempts.affordable():
        wanted = max(over * PAGING_MARGIN, paged_bytes) if failed else over * PAGING_MARGIN
        failed = True
        added = 0
        while candidates and (added < wanted or added == 0):
            name, nbytes = candidates.pop(0)
            paged.append(name)
            added += nbytes
        paged_bytes += added
        if not candidates:
            break  # (every parameter: solved already)
        try:
            plan = solve_timed(frozenset(paged), False, probe_seconds)
        except InfeasibleBudgetError as exc:
            over = exc.min_budget - budget
            continue
        if plan.predicted_time < best.predicted_time:
            best, taken, probed = plan, frozenset(paged), True
        break  # (the fewest paged that fit: paging more only adds fetches)
    if probed and attempts.affordable():
        refined = none_where_unfit(lambda: solve_timed(taken, False, None))
        if refined is not None and refined.predicted_time < best.predicted_time:
            best = refined
    return best

