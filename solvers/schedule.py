"""Schedules and their one simulator.

A `Schedule` is an ordered list of steps ``(op, node)``. ``compute`` makes a
value resident (all its predecessors must be resident, and the value itself
counts as resident while it is being computed); ``free`` drops it.
``offload``/``prefetch`` are reserved for host paging and rejected by the
simulator until it models them.

`simulate` replays a schedule step by step and reports its peak memory and
cost; `validate` is the same pass with the budget enforced. Both raise
`ScheduleError` at the first step that breaks the rules, so there is one
implementation of the semantics and (through `memory.Residency`) one place
where memory is added up.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Hashable, Iterable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from .memory import Residency
from .problem import Problem

JSON_FORMAT = "memplan.solvers.Schedule"
JSON_VERSION = 1


class Op(str, Enum):
    COMPUTE = "compute"
    FREE = "free"
    OFFLOAD = "offload"  # reserved: copy to host and drop from device
    PREFETCH = "prefetch"  # reserved: copy back from host


class Step(NamedTuple):
    """One schedule step; unpacks as ``op, node``."""

    op: Op
    node: Hashable


@dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]

    @classmethod
    def from_list(cls, pairs: Iterable[tuple[str | Op, Hashable]]) -> "Schedule":
        """Build from ``[("compute", "a"), ("free", "a"), ...]``."""
        return cls(tuple(Step(Op(op), node) for op, node in pairs))

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k: int) -> Step:
        return self.steps[k]

    def computes(self) -> list[Hashable]:
        return [node for op, node in self.steps if op is Op.COMPUTE]

    def to_list(self) -> list[list[Any]]:
        return [[op.value, node] for op, node in self.steps]

    def to_json(self) -> str:
        return json.dumps({"format": JSON_FORMAT, "version": JSON_VERSION, "steps": self.to_list()})

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        data = json.loads(text)
        if data.get("format") != JSON_FORMAT:
            raise ValueError(f"not a {JSON_FORMAT} document")
        return cls.from_list(data["steps"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        return cls.from_json(Path(path).read_text())

    def __str__(self) -> str:
        return "\n".join(f"{k:5d} {op.value:8s} {node!r}" for k, (op, node) in enumerate(self.steps))


class ScheduleError(Exception):
    """A schedule breaks the rules. ``kind`` names the rule, ``step`` is the
    index of the offending step (-1 before the first step, ``len(schedule)``
    for end-of-schedule checks) and ``node`` the value involved."""

    def __init__(self, message: str, *, kind: str, step: int, node: Hashable = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.step = step
        self.node = node


@dataclass(frozen=True)
class SimResult:
    peak: int  # max memory over every instant, computes included
    cost: float  # sum of compute costs
    timeline: np.ndarray  # memory after step k (for a compute: during it), int64
    initial: int  # memory before the first step (the sources)
    final: int  # memory after the last step
    peak_step: int  # first step that reaches the peak, -1 when the sources alone are the peak
    computes: np.ndarray  # how many times each value was computed, indexed like the problem
    recomputations: int  # computes beyond the first of each value
    over_budget_step: Optional[int]  # first step above the budget (-1: the sources), None if it fits

    @property
    def fits(self) -> bool:
        return self.over_budget_step is None


def _execute(problem: Problem, schedule: Schedule | Sequence[tuple[Any, Hashable]], enforce_budget: bool) -> SimResult:
    steps = schedule.steps if isinstance(schedule, Schedule) else tuple(schedule)
    names, preds, cost = problem.names, problem.preds, problem.cost
    is_source, recomputable = problem.is_source, problem.recomputable
    budget = problem.budget
    mem = Residency(problem)
    resident = mem.resident  # shared view: kept up to date by `mem`
    computes = np.zeros(problem.n, dtype=np.int64)
    timeline = np.empty(len(steps), dtype=np.int64)
    total_cost = 0.0
    over: Optional[int] = None

    def over_budget(k: int, what: str) -> None:
        nonlocal over
        if over is None:
            over = k
        if enforce_budget:
            raise ScheduleError(f"{what}: memory {mem.total} exceeds the budget {budget}", kind="over-budget", step=k)

    initial = mem.total
    if initial > budget:
        over_budget(-1, "before the first step the inputs alone")
    peak, peak_step = initial, -1
    for k, step in enumerate(steps):
        op, node = step
        v = problem.index.get(node)
        if v is None:
            raise ScheduleError(f"step {k}: unknown node {node!r}", kind="unknown-node", step=k, node=node)
        if op == Op.COMPUTE:
            if is_source[v]:
                raise ScheduleError(f"step {k}: {node!r} is a source and cannot be computed", kind="compute-source",
                                    step=k, node=node)
            if resident[v]:
                raise ScheduleError(f"step {k}: compute {node!r}, which is already resident", kind="already-resident",
                                    step=k, node=node)
            if computes[v] and not recomputable[v]:
                raise ScheduleError(f"step {k}: {node!r} is not recomputable and was already computed",
                                    kind="recompute-forbidden", step=k, node=node)
            for p in preds[v]:
                if not resident[p]:
                    raise ScheduleError(f"step {k}: compute {node!r} reads {names[p]!r}, which is not resident",
                                        kind="read-not-resident", step=k, node=node)
            mem.add(v)
            computes[v] += 1
            total_cost += float(cost[v])
        elif op == Op.FREE:
            if is_source[v]:
                raise ScheduleError(f"step {k}: {node!r} is a source and cannot be freed", kind="free-source",
                                    step=k, node=node)
            if not resident[v]:
                raise ScheduleError(f"step {k}: free {node!r}, which is not resident", kind="free-not-resident",
                                    step=k, node=node)
            mem.remove(v)
        elif op in (Op.OFFLOAD, Op.PREFETCH):
            raise ScheduleError(f"step {k}: {Op(op).value} is not supported by the simulator yet",
                                kind="unsupported-op", step=k, node=node)
        else:
            raise ScheduleError(f"step {k}: unknown op {op!r}", kind="unknown-op", step=k, node=node)
        # A free can raise memory too: dropping an alias base makes its views count.
        total = mem.total
        timeline[k] = total
        if total > peak:
            peak, peak_step = total, k
        if total > budget:
            over_budget(k, f"step {k} ({Op(op).value} {node!r})")

    end = len(steps)
    for v in problem.non_sources:
        if computes[v] == 0:
            raise ScheduleError(f"{names[v]!r} is never computed", kind="never-computed", step=end, node=names[v])
    for v in problem.sinks:
        if not resident[v]:
            raise ScheduleError(f"sink {names[v]!r} is not resident at the end", kind="sink-missing", step=end,
                                node=names[v])
    recomputations = int((computes[computes > 0] - 1).sum())
    return SimResult(peak=int(peak), cost=total_cost, timeline=timeline, initial=int(initial), final=int(mem.total),
                     peak_step=peak_step, computes=computes, recomputations=recomputations, over_budget_step=over)


def simulate(problem: Problem, schedule: Schedule | Sequence[tuple[Any, Hashable]]) -> SimResult:
    """Replay ``schedule``; report peak, cost and timeline. Raises `ScheduleError`
    for any broken rule except the budget (see `SimResult.over_budget_step`)."""
    return _execute(problem, schedule, enforce_budget=False)


def validate(problem: Problem, schedule: Schedule | Sequence[tuple[Any, Hashable]]) -> SimResult:
    """Like `simulate`, and also raise `ScheduleError` at the first step over ``problem.budget``."""
    return _execute(problem, schedule, enforce_budget=True)
