"""Paging as the budget asks (``parameters="auto"``): in host memory, the parameters a step that
does not fit otherwise needs there, the largest first.

The step is solved with its parameters on the device first, its optimizer state moving to the
host as `memplan.pipeline.plan.whole_step_plan` moves it (a step whose parameters, buffers and
inputs alone exceed the budget skips that). Where no plan fits, parameters are paged
(`memplan.passes.paging`), the largest first: as many bytes as the closest plan was over the
budget and a quarter more (a fetched copy is device memory while its readers run), then at
least as many again as are paged already at each attempt that still does not fit, so a billion
parameters take a handful of attempts, the last with every parameter paged. Each attempt is the
captured step's graph copied and paged (`memplan.pipeline.stages.analyze_paged`), its costs reused.

A paged step keeps every parameter's optimizer state in host memory: a paged parameter's update
runs there, and the state of one left on the device would take back what the paging freed
(state moves to the host before any parameter is paged).
"""
from __future__ import annotations

from typing import Callable, Protocol

from memplan.passes.paging import is_paged
from memplan.planning.analysis import Analysis
from memplan.pipeline.errors import InfeasibleBudgetError


class SolvedStep(Protocol):
    """What this module reads of a solved plan (`memplan.pipeline.plan.Plan`, whose module calls this one)."""

    analysis: Analysis
    predicted_time: float


# A paged parameter's fetched copy is device memory while its readers run: page this much more
# than the closest plan was over the budget.
PAGING_MARGIN = 1.25


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


def plan_paging_as_needed(analysis: Analysis, budget: int, solve: Callable[[Analysis, bool, bool], SolvedStep],
                          page: Callable[[frozenset[str]], Analysis], paged_already: frozenset[str] = frozenset(),
                          out_of_time: Callable[[], bool] = lambda: False) -> SolvedStep:
    """The plan of ``analysis``'s step under ``budget``, paging parameters where it does not fit
    otherwise (`page_until_fits`).

    ``solve(analysis, last, probe)`` solves one step (raising `InfeasibleBudgetError`); ``last``: no
    attempt follows, so its error may search for the minimum budget (minutes on a billion
    parameters: the attempts before it only say how far over they are); ``probe``: briefly, to
    compare it with another. ``page(names)`` is the step with the parameters ``names`` paged,
    every state in host memory."""
    return page_until_fits(paging_candidates(analysis), sources_over(analysis, budget), budget,
                           lambda names, last, probe: solve(page(names) if names else analysis, last, probe),
                           paged_already, out_of_time)


def page_until_fits(candidates: list[tuple[str, int]], over: int, budget: int,
                    solve: Callable[[frozenset[str], bool, bool], SolvedStep],
                    paged_already: frozenset[str] = frozenset(),
                    out_of_time: Callable[[], bool] = lambda: False) -> SolvedStep:
    """The plan of a step under ``budget`` with the fewest of ``candidates`` ((name, bytes) of its
    parameters, the largest first) paged that the attempts of the module's docstring find; a plan
    that updates any parameter on the host is set against every parameter paged, and the faster
    predicted is taken.

    ``over``: bytes by which the parameters, buffers and inputs alone exceed the budget (`sources_over`;
    over 0, no attempt leaves every parameter on the device). ``solve(names, last, probe)``: the step
    with the parameters ``names`` paged (none: as captured), solved (raising `InfeasibleBudgetError`);
    ``last``: no attempt follows; ``probe``: briefly. An attempt with parameters paged is probed,
    and the plan taken is solved in full once it is chosen, in what is left of the limit (the
    attempt with every parameter on the device, which moves state by itself, is solved in full).
    ``paged_already``: names of parameters an earlier plan put in host memory, paged from the first
    attempt on (another input signature of the same model). ``out_of_time()``: the planning call's
    limit has passed; the next attempt pages every parameter (the attempt that fits where any does),
    and no comparison or full solve follows."""
    every = frozenset(name for name, _ in candidates)
    paged = [name for name, _ in candidates if name in paged_already]
    paged_bytes = sum(nbytes for name, nbytes in candidates if name in paged_already)
    candidates = [(name, nbytes) for name, nbytes in candidates if name not in paged_already]
    plan, chosen, probed = None, frozenset(paged), False
    over -= paged_bytes
    if over <= 0 or not candidates:
        try:
            plan = solve(chosen, not candidates, False)
        except InfeasibleBudgetError as exc:
            if not candidates:
                raise
            over = exc.min_budget - budget
    while plan is None:
        wanted = max(over * PAGING_MARGIN, paged_bytes) if not out_of_time() else float("inf")
        added = 0
        while candidates and (added < wanted or added == 0):
            name, nbytes = candidates.pop(0)
            paged.append(name)
            added += nbytes
        paged_bytes += added
        chosen, probed = frozenset(paged), bool(candidates)  # (the last attempt is solved in full)
        try:
            plan = solve(chosen, not candidates, probed)
        except InfeasibleBudgetError as exc:
            if not candidates:
                raise
            over = exc.min_budget - budget
    if candidates and plan.analysis.lowered.host_states and not out_of_time():
        # A device parameter updated on the host goes out and back over the link each step, with
        # its gradient; a paged one is stepped where it is, its gradient out and its fetches in.
        other = _plan_or_none(solve, every, probe=True)
        if other is not None and other.predicted_time < plan.predicted_time:
            plan, chosen, probed = other, every, True
    if probed and not out_of_time():
        refined = _plan_or_none(solve, chosen, probe=False)
        if refined is not None and refined.predicted_time < plan.predicted_time:
            plan = refined
    return plan


def _plan_or_none(solve: Callable[[frozenset[str], bool, bool], SolvedStep], names: frozenset[str],
                  probe: bool) -> SolvedStep | None:
    """The step with ``names`` paged, solved, or None where it does not fit (another plan is in hand)."""
    try:
        return solve(names, False, probe)
    except InfeasibleBudgetError:
        return None
