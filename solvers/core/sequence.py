"""Turn a stage plan or a compute sequence (what to compute, in order) into a Schedule.

Every solver that decides *what to compute when* but not *when to free*
goes through here, so frees are placed in one way everywhere: each computed
instance of a value is freed right after its last read before the value is
computed again; the last instance of a sink is never freed; an instance that
nobody reads is freed right after it is computed.

A plan may also ask to keep values through the end of a stage (``keep``):
Checkmate's alias accounting relies on a value and its view both being
resident for a whole stage, so their lifetimes are stretched to cover it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .problem import Problem
from .schedule import Op, Schedule, ScheduleError, Step, simulate


class PlanError(ValueError):
    """The plan reads a value before it has been computed."""


@dataclass(frozen=True)
class StagePlan:
    """What to compute, stage by stage (Checkmate's R matrix), and what to hold through each stage."""

    stages: tuple[tuple[int, ...], ...]  # node indices computed in each stage, in order
    keep: Optional[tuple[frozenset[int], ...]] = None  # per stage: hold these through the end of the stage

    @classmethod
    def sequence(cls, computes: Iterable[int]) -> "StagePlan":
        return cls((tuple(computes),))


def schedule_from_plan(problem: Problem, plan: StagePlan) -> Schedule:
    seq: list[int] = []
    stage_end: list[int] = []  # position of the last compute of each stage (-1 if the stage is empty so far)
    for stage in plan.stages:
        seq.extend(stage)
        stage_end.append(len(seq) - 1)

    preds, names = problem.preds, problem.names
    is_source = problem.lists().is_source
    current: dict[int, int] = {}  # value -> position of its live instance
    end = [0] * len(seq)  # position after which each instance is freed
    for pos, v in enumerate(seq):
        if is_source[v]:
            raise PlanError(f"plan computes source {names[v]!r}")
        for p in preds[v]:
            if is_source[p]:
                continue
            inst = current.get(p)
            if inst is None:
                raise PlanError(f"plan computes {names[v]!r} before its input {names[p]!r}")
            end[inst] = pos
        current[v] = pos
        end[pos] = pos
    if plan.keep is not None:
        if len(plan.keep) != len(plan.stages):
            raise PlanError("keep must have one entry per stage")
        # Replay the instances stage by stage to know which one is live at each stage end.
        live: dict[int, int] = {}
        start = 0
        for t, stop in enumerate(stage_end):
            for pos in range(start, stop + 1):
                live[seq[pos]] = pos
            start = stop + 1
            for v in plan.keep[t]:
                if is_source[v]:
                    continue
                inst = live.get(v)
                if inst is None:
                    raise PlanError(f"plan keeps {names[v]!r} before computing it")
                end[inst] = max(end[inst], stop)
    never = len(seq)  # sinks' last instances stay resident
    for v in problem.sinks:
        inst = current.get(v)
        if inst is not None:
            end[inst] = never

    frees_after: dict[int, list[int]] = {}
    for pos, e in enumerate(end):
        if e < never:
            frees_after.setdefault(e, []).append(seq[pos])
    steps: list[Step] = []
    compute, free = Op.COMPUTE, Op.FREE
    for pos, v in enumerate(seq):
        steps.append(Step(compute, names[v]))
        dead = frees_after.get(pos)
        if dead:
            # Views before their bases (higher index first): dropping a base
            # while its view lives would make the view count on its own.
            for u in sorted(dead, reverse=True):
                steps.append(Step(free, names[u]))
    return Schedule(tuple(steps))


def schedule_from_sequence(problem: Problem, computes: Sequence[int]) -> Schedule:
    """A single-stage plan: compute in this order, free after last use."""
    return schedule_from_plan(problem, StagePlan.sequence(computes))


def tighten_frees(problem: Problem, schedule: Schedule) -> Schedule:
    """``schedule`` with its frees placed as `schedule_from_plan` places them (each instance
    freed right after its last read), when that raises neither its peak nor its cost; else
    ``schedule`` itself.

    The runtime drops a value as soon as nothing later reads it, whatever the schedule says, so
    a free placed later than that is memory the prediction counts and the step never holds
    (a polished schedule held a 1 MiB activation idle through the peak: predicted 6.4% above
    the measured peak). Schedules with host copies keep their own frees (a free there also
    waits for a copy)."""
    if schedule.has_transfers():
        return schedule
    index = problem.index
    try:
        tight = schedule_from_sequence(problem, [index[node] for node in schedule.computes()])
        if tight == schedule:
            return schedule
        before, after = simulate(problem, schedule), simulate(problem, tight)
    except (PlanError, ScheduleError, KeyError):  # not a valid schedule: the caller's validation says why
        return schedule
    return tight if after.peak <= before.peak and after.cost <= before.cost else schedule
