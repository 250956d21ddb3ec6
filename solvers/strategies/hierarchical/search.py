"""The drop search: the covering ILP with the simulator closing the loop.

`drop_search` alternates the two: the ILP (`CoverModel`) proposes a drop set
(and pagings); the simulator measures it. Stages still over budget get the
measured excess added to their requirement; a plan that fits feeds back what
each dropped group's recomputations really cost (chains included); when the
ILP repeats itself, the target is lowered; a plan still over budget is
repaired (`repair`) by dropping, most bytes per cost first, what is resident
at the peak (a near miss, within `NEAR_MISS`, at once).

A stage whose peak step holds nothing a drop could release (sources,
gradients, what the step reads) is a *floor* (`_floor_stages`): the model
aims at its peak there, and plans over budget only at floors are searched on
like fitting ones and kept in the `SearchLog`, for the caller to hand to
`repair.add_recomputations`, which can move a gradient past that step.
`keep_again` then undoes drops, costliest first, while the plan fits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ...core.schedule import Op
from ...core.uses import residencies, resident_at
from .model import Candidate, CoverModel, candidates, pagings
from .planner import DropPlanner, Evaluation

ROWS_PER_ROUND = 40  # violated stages added to the ILP per round of row generation
MAX_FEEDBACK_ROUNDS = 60
MAX_MARGIN_STEPS = 4  # times the model's target may be lowered when stuck over budget
NEAR_MISS = 0.01  # a plan this much over budget is repaired on the spot
PEAK_TIE = 0.001  # over-budget plans whose peaks differ by less than this share of the budget tie


@dataclass
class SearchLog:
    rounds: int = 0
    ilp_solves: int = 0
    simulations: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    closest: Optional[Evaluation] = None  # lowest peak seen among plans that do not fit
    floored: Optional[Evaluation] = None  # cheapest plan over the budget only at floors (`_floor_stages`)


def drop_search(planner: DropPlanner, budget: int, deadline: float, log: SearchLog,
                chains: bool = True, paging: bool = True, first_fit_by: Optional[float] = None
                ) -> Optional[Evaluation]:
    """Covering ILP with simulator feedback; the fastest fitting evaluation found. With a host
    link on the fine problem (and ``paging``) the ILP also chooses pagings (keep / recompute /
    offload). ``first_fit_by``: while no plan fits, the search may go on until then, past
    ``deadline`` (a search cut off before its first fit has spent its time for nothing)."""
    fine = planner.c.fine
    paging = paging and fine.has_host
    cands, penalties = candidates(planner, chains, pageable=paging)
    if not cands:
        return None
    pages = pagings(planner, cands, fine) if paging else []
    model = CoverModel(cands, penalties, planner.cp.n, planner.cp.cost, pages, fine.host_capacity)
    modelled = [cd.cost for cd in cands]
    keep_all = planner.evaluate(frozenset())
    log.simulations += 1
    if keep_all.fits(budget):
        return keep_all
    if pages:
        pages = planner.realizable(keep_all, pages)
        model = CoverModel(cands, penalties, planner.cp.n, planner.cp.cost, pages, fine.host_capacity)
    base = keep_all.stage_peak.astype(np.float64)
    extra = np.zeros(planner.cp.n, dtype=np.float64)  # measured error of the linear model, per stage
    rows: dict[int, float] = {}
    best: Optional[Evaluation] = None
    closest: Optional[Evaluation] = None  # lowest peak among plans that do not fit
    seen: set[tuple[frozenset[int], tuple[int, ...]]] = set()
    x: Optional[np.ndarray] = None
    y: Optional[np.ndarray] = None
    target = budget  # what the linear model aims at; lowered when the ILP is stuck over budget
    margin_steps = 0
    # Per stage, a peak no drop can lower (nothing droppable resident at it: sources, gradients,
    # the inputs of the step). The model aims at it there instead of the budget, and plans over
    # budget only there are searched on like fitting ones and left to the caller's repair
    # (`repair.add_recomputations` can reorder and recompute what a drop plan cannot).
    floor = np.zeros(planner.cp.n, dtype=np.float64)
    by_group = {cd.group: cd for cd in cands}
    floored = False
    patient = deadline if first_fit_by is None else max(deadline, first_fit_by)
    for _ in range(MAX_FEEDBACK_ROUNDS):
        end = deadline if best is not None else patient
        if time.perf_counter() >= end:
            break
        log.rounds += 1
        # Row generation against the linear model (rows changed by the feedback force a solve).
        dirty = x is not None
        while time.perf_counter() < end:
            need = base + extra - np.maximum(target, floor)
            have = model.released(x, y) if x is not None else np.zeros_like(need)
            short = need - have
            violated = np.array([t for t in np.flatnonzero(short > 0.5).tolist()
                                 if rows.get(t, -1.0) < need[t] - 0.5], dtype=np.int64)
            if violated.size == 0 and not dirty:
                break  # covered, or only rows the ILP already has (soft rows it cannot cover)
            dirty = False
            top = violated[np.argsort(-short[violated])][:ROWS_PER_ROUND]
            for t in top.tolist():
                rows[t] = max(rows.get(t, 0.0), float(need[t]))
            remaining = end - time.perf_counter()
            x_new = model.solve(rows, min(remaining, max(1.0, remaining / 4)))
            log.ilp_solves += 1
            if x_new is None:
                return best
            x, y = x_new
        if x is None:
            break
        dropped = frozenset(cands[i].group for i in np.flatnonzero(x))
        paged = tuple(pages[k] for k in np.flatnonzero(y))
        key = (dropped, tuple(np.flatnonzero(y).tolist()))
        if key in seen:
            # The ILP repeats itself: the stages over budget cannot be covered locally. Aim
            # lower everywhere by the last overshoot (a few times), then give up.
            if best is not None or closest is None or margin_steps >= MAX_MARGIN_STEPS or floored:
                break
            margin_steps += 1
            target -= closest.peak - budget + budget // 1000
            for t in list(rows):
                rows[t] = float(base[t] + extra[t] - max(target, floor[t]))
            continue
        seen.add(key)
        ev = planner.evaluate(dropped, paged, end)
        log.simulations += 1
        log.history.append({"dropped": len(dropped), "paged": len(paged), "peak": ev.peak, "time": ev.time})
        for t, level in _floor_stages(planner, ev, by_group, np.maximum(budget, floor)).items():
            # What was fed back at t so far was this floor, not an error of the model.
            floor[t] = max(floor[t], float(level))
            extra[t] = 0.0
            if t in rows:
                rows[t] = float(base[t] - max(target, floor[t]))
        limit = np.maximum(budget, floor)
        floored = bool(np.all(ev.stage_peak <= limit))  # fits, or over only where no drop helps
        if not ev.fits(budget):
            if _closer(ev, closest, budget):
                closest = ev
            if _closer(ev, log.closest, budget):
                log.closest = ev
        if floored:
            if ev.fits(budget) and (best is None or ev.time < best.time):
                best = ev
            if not ev.fits(budget) and (log.floored is None or ev.time < log.floored.time):
                log.floored = ev
            # Cost feedback: a dropped group costs what its recomputations cost in the simulation
            # (chains of dropped inputs included); solve again with those costs.
            for i, cd in enumerate(cands):
                cd.cost = max(modelled[i], ev.charge.get(cd.group, 0.0)) if cd.group in dropped else modelled[i]
            continue  # x is set: the next round solves again
        if ev.peak <= budget * (1 + NEAR_MISS):
            # A few more drops at the peak usually close a near miss; cheaper than more ILP rounds.
            now = time.perf_counter()
            fixed = repair(planner, ev, cands, budget, now + 0.1 * max(0.0, end - now), log)
            if fixed is not None and (best is None or fixed.time < best.time):
                best = fixed
        over = np.flatnonzero(ev.stage_peak > limit)
        for t in over.tolist():
            extra[t] += float(ev.stage_peak[t] - limit[t])
            rows[t] = max(rows.get(t, 0.0), float(base[t] + extra[t] - max(target, floor[t])))
    if best is None and closest is not None:
        best = repair(planner, closest, cands, budget, patient, log)
    return best


def _closer(ev: Evaluation, than: Optional[Evaluation], budget: int) -> bool:
    """Whether over-budget ``ev`` is a better plan to repair than ``than``: a lower peak, or a
    peak as low (within `PEAK_TIE`) at a lower cost. Plans often stall at one peak that no drop
    can lower (a step where only sources, gradients and the inputs of the step are resident);
    the cheapest of those is the one to hand to the repair."""
    if than is None:
        return True
    tie = PEAK_TIE * budget
    return ev.peak < than.peak - tie or (ev.peak <= than.peak + tie and ev.time < than.time)


def _droppable(planner: DropPlanner, resident: np.ndarray, dropped: frozenset[int],
               by_group: dict[int, Candidate], busy: frozenset[int] = frozenset()) -> list[int]:
    """Groups with a value in ``resident`` (a mask of fine values) that a drop could release:
    kept droppable candidates, less the ``busy`` ones."""
    groups = {int(g) for g in np.unique(planner.c.group_of[np.flatnonzero(resident)])} - dropped - busy
    return [g for g in groups if g in by_group and by_group[g].droppable]


def _droppable_at_peak(planner: DropPlanner, ev: Evaluation, by_group: dict[int, Candidate]) -> list[int]:
    """Groups resident at ``ev``'s peak step that a drop could release (kept droppable candidates)."""
    resident = resident_at(planner.c.fine, list(ev.schedule.steps), ev.peak_step).mask
    return _droppable(planner, resident, ev.dropped, by_group)


def _floor_stages(planner: DropPlanner, ev: Evaluation, by_group: dict[int, Candidate],
                  limit: np.ndarray) -> dict[int, int]:
    """Stages over ``limit`` whose peak step holds nothing a drop could release (sources,
    gradients, values that cannot be recomputed, the groups the step computes and reads),
    with their peaks: no drop set lowers them. One pass over the schedule."""
    over = set(np.flatnonzero(ev.stage_peak > limit).tolist())
    if not over or ev.step_stage is None:
        return {}
    fine, group_of = planner.c.fine, planner.c.group_of
    steps = ev.schedule.steps
    found: dict[int, int] = {}
    for k, mem in enumerate(residencies(fine, steps)):
        t = int(ev.step_stage[k])
        if t not in over or mem.total != ev.stage_peak[t]:
            continue
        over.discard(t)
        op, node = steps[k]
        busy: frozenset[int] = frozenset()
        if op is Op.COMPUTE:
            v = fine.index[node]
            busy = frozenset(int(group_of[u]) for u in (v, *fine.preds[v]))
        if not _droppable(planner, mem.mask, ev.dropped, by_group, busy):
            found[t] = int(ev.stage_peak[t])
        if not over:
            break
    return found


def repair(planner: DropPlanner, ev: Evaluation, cands: list[Candidate], budget: int, deadline: float,
           log: SearchLog) -> Optional[Evaluation]:
    """Drop more, guided by the simulator: groups resident at the peak, most bytes per cost first."""
    by_group = {cd.group: cd for cd in cands}
    while not ev.fits(budget) and time.perf_counter() < deadline:
        scored = sorted(_droppable_at_peak(planner, ev, by_group),
                        key=lambda g: -max(s for _, _, s in by_group[g].gaps) / (by_group[g].cost + 1e-12))
        if not scored:
            return None
        excess, freed, extra = ev.peak - budget, 0, set()
        for g in scored:
            extra.add(g)
            freed += max(s for _, _, s in by_group[g].gaps)
            if freed >= excess:
                break
        ev = planner.evaluate(ev.dropped | extra, tuple(p for p in ev.paged if p.group not in extra), deadline)
        log.simulations += 1
        log.history.append({"repair": len(extra), "peak": ev.peak, "time": ev.time})
    return ev if ev.fits(budget) else None


def keep_again(planner: DropPlanner, best: Evaluation, budget: int, deadline: float, log: SearchLog) -> Evaluation:
    """Undo drops, costliest first, while the simulator still fits and the step is no slower."""
    cp = planner.cp
    order = sorted(best.dropped, key=lambda g: -float(cp.cost[g]))
    for g in order:
        if time.perf_counter() >= deadline:
            break
        ev = planner.evaluate(best.dropped - {g}, best.paged, deadline)
        log.simulations += 1
        if ev.fits(budget) and ev.time <= best.time:
            best = ev
    return best
