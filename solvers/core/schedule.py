"""Schedules and their one simulator.

A `Schedule` is an ordered list of steps ``(op, node)``:

* ``compute`` makes a value resident on the device (all its predecessors must
  be resident, and the value itself counts as resident while it is being
  computed); ``free`` drops it;
* ``offload`` starts copying a resident value to host memory; the value stays
  on the device (and counts) until a later ``free``, which waits for the copy
  to finish if it has not;
* ``prefetch`` starts copying an offloaded value back; it counts on the
  device from this step on, and a compute that reads it waits until the copy
  has arrived.

Time runs on three streams: compute (the schedule's computes, one after the
other), and one copy stream per direction (device-to-host, host-to-device),
each running one copy at a time, concurrently with compute. A copy starts
when it is issued or when its stream is free, whichever is later (a prefetch
also not before its offload has finished) and takes ``mem / host_bandwidth``.
Memory is allocated and released in step order, so the device memory of any
instant is the memory after some step, transfers included.

Only values that own their storage (``alias_of == -1``), are not sources and
are not marked otherwise (``Problem.offloadable``) can be offloaded; a view of an offloaded value is recomputed from the
prefetched base (views cost next to nothing). A host copy lives until the
end of the step; ``host_capacity`` bounds their total.

`simulate` replays a schedule step by step and reports its peak memory, its
compute cost and its step time; `validate` is the same pass with the budget
enforced. Both raise `ScheduleError` at the first step that breaks the rules,
so there is one implementation of the semantics and (through
`memory.Residency`) one place where memory is added up.
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
    OFFLOAD = "offload"  # start a copy to host; a later free drops the device copy
    PREFETCH = "prefetch"  # start a copy back from host


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

    def offloads(self) -> list[Hashable]:
        return [node for op, node in self.steps if op is Op.OFFLOAD]

    def has_transfers(self) -> bool:
        return any(op is Op.OFFLOAD or op is Op.PREFETCH for op, _ in self.steps)

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
    time: float = 0.0  # step time: compute cost plus waits for copies and the host's work (== cost without either)
    wait: float = 0.0  # time the compute stream spent waiting for copies
    transferred: int = 0  # bytes copied over the host link, both directions
    host_peak: int = 0  # most bytes held in host memory at once
    clock: Optional[np.ndarray] = None  # compute-stream time after each step, float64

    @property
    def fits(self) -> bool:
        return self.over_budget_step is None


_COMPUTE, _FREE, _OFFLOAD, _PREFETCH = Op.COMPUTE, Op.FREE, Op.OFFLOAD, Op.PREFETCH


def _execute(problem: Problem, schedule: Schedule | Sequence[tuple[Any, Hashable]], enforce_budget: bool) -> SimResult:
    steps = schedule.steps if isinstance(schedule, Schedule) else tuple(schedule)
    names, preds, index = problem.names, problem.preds, problem.index
    lists = problem.lists()
    cost, is_source, recomputable, mem_of = lists.cost, lists.is_source, lists.recomputable, lists.mem
    offloadable = lists.offloadable
    host_work = problem.host_work.tolist() if problem.host_work.any() else None
    budget = problem.budget
    bandwidth, host_capacity = problem.host_bandwidth, problem.host_capacity
    mem = Residency(problem)
    resident = mem.resident  # shared: kept up to date by `mem`
    add, remove = mem.add, mem.remove
    computes = [0] * problem.n
    timeline: list[int] = []
    clocks: list[float] = []
    total_cost = 0.0
    over: Optional[int] = None
    # Time: the compute stream's clock and when each copy stream is next free.
    clock = wait = 0.0
    d2h_free = h2d_free = 0.0
    host_free = 0.0  # when the host stream (host_work) is next free
    offloaded_at: dict[int, float] = {}  # value -> when its host copy is complete
    arriving: dict[int, float] = {}  # value -> when its prefetch lands (while it may still be in flight)
    host_total = host_peak = transferred = 0

    def fail(k: int, kind: str, message: str, node: Hashable = None) -> ScheduleError:
        return ScheduleError(f"step {k}: {message}", kind=kind, step=k, node=node)

    initial = mem.total
    if initial > budget:
        over = -1
        if enforce_budget:
            raise ScheduleError(f"before the first step the inputs alone: memory {initial} exceeds the budget "
                                f"{budget}", kind="over-budget", step=-1)
    peak, peak_step = initial, -1
    for k, (op, node) in enumerate(steps):
        v = index.get(node)
        if v is None:
            raise fail(k, "unknown-node", f"unknown node {node!r}", node)
        if op == _COMPUTE:
            if is_source[v]:
                raise fail(k, "compute-source", f"{node!r} is a source and cannot be computed", node)
            if resident[v]:
                raise fail(k, "already-resident", f"compute {node!r}, which is already resident", node)
            if computes[v] and not recomputable[v]:
                raise fail(k, "recompute-forbidden", f"{node!r} is not recomputable and was already computed", node)
            for p in preds[v]:
                if not resident[p]:
                    raise fail(k, "read-not-resident", f"compute {node!r} reads {names[p]!r}, which is not resident",
                               node)
            if arriving:
                for p in preds[v]:
                    landed = arriving.get(p)
                    if landed is not None and landed > clock:
                        wait += landed - clock
                        clock = landed
            add(v)
            computes[v] += 1
            total_cost += cost[v]
            clock += cost[v]
            if host_work is not None and host_work[v] > 0:
                host_free = max(clock, host_free) + host_work[v]
        elif op == _FREE:
            if is_source[v]:
                raise fail(k, "free-source", f"{node!r} is a source and cannot be freed", node)
            if not resident[v]:
                raise fail(k, "free-not-resident", f"free {node!r}, which is not resident", node)
            # A buffer is released only once no copy reads or writes it.
            busy_until = max(offloaded_at.get(v, 0.0), arriving.pop(v, 0.0))
            if busy_until > clock:
                wait += busy_until - clock
                clock = busy_until
            remove(v)
        elif op == _OFFLOAD:
            if bandwidth <= 0:
                raise fail(k, "no-host-link", f"offload {node!r}, but the problem has no host link", node)
            if not offloadable[v]:
                raise fail(k, "offload-forbidden", f"{node!r} cannot be offloaded (only non-source values that own "
                           "their storage and are not marked otherwise can)", node)
            if not resident[v]:
                raise fail(k, "offload-not-resident", f"offload {node!r}, which is not resident", node)
            if v in offloaded_at:
                raise fail(k, "already-offloaded", f"offload {node!r}, which already has a host copy", node)
            start = max(clock, d2h_free, arriving.get(v, 0.0))
            d2h_free = offloaded_at[v] = start + mem_of[v] / bandwidth
            transferred += mem_of[v]
            host_total += mem_of[v]
            host_peak = max(host_peak, host_total)
            if host_capacity is not None and host_total > host_capacity:
                raise fail(k, "host-full", f"offload {node!r}: host memory {host_total} exceeds the host capacity "
                           f"{host_capacity}", node)
        elif op == _PREFETCH:
            if v not in offloaded_at:
                raise fail(k, "prefetch-no-copy", f"prefetch {node!r}, which was never offloaded", node)
            if resident[v]:
                raise fail(k, "already-resident", f"prefetch {node!r}, which is already resident", node)
            start = max(clock, h2d_free, offloaded_at[v])
            h2d_free = arriving[v] = start + mem_of[v] / bandwidth
            transferred += mem_of[v]
            add(v)
        else:
            raise fail(k, "unknown-op", f"unknown op {op!r}", node)
        # A free can raise memory too: dropping an alias base makes its views count.
        total = mem.total
        timeline.append(total)
        clocks.append(clock)
        if total > peak:
            peak, peak_step = total, k
        if total > budget and over is None:
            over = k
            if enforce_budget:
                raise fail(k, "over-budget", f"({Op(op).value} {node!r}) memory {total} exceeds the budget {budget}",
                           node)

    end = len(steps)
    for v in problem.non_sources:
        if computes[v] == 0:
            raise ScheduleError(f"{names[v]!r} is never computed", kind="never-computed", step=end, node=names[v])
    for v in problem.sinks:
        if not resident[v]:
            raise ScheduleError(f"sink {names[v]!r} is not resident at the end", kind="sink-missing", step=end,
                                node=names[v])
    # The step ends when compute, every copy still in flight and the host's work are done.
    step_time = max(clock, d2h_free, h2d_free, host_free)
    counts = np.array(computes, dtype=np.int64)
    recomputations = int((counts[counts > 0] - 1).sum())
    return SimResult(peak=int(peak), cost=total_cost, timeline=np.array(timeline, dtype=np.int64),
                     initial=int(initial), final=int(mem.total), peak_step=peak_step, computes=counts,
                     recomputations=recomputations, over_budget_step=over, time=step_time, wait=wait,
                     transferred=int(transferred), host_peak=int(host_peak),
                     clock=np.array(clocks, dtype=np.float64))


def simulate(problem: Problem, schedule: Schedule | Sequence[tuple[Any, Hashable]]) -> SimResult:
    """Replay ``schedule``; report peak, cost, time and timeline. Raises `ScheduleError`
    for any broken rule except the budget (see `SimResult.over_budget_step`)."""
    return _execute(problem, schedule, enforce_budget=False)


def validate(problem: Problem, schedule: Schedule | Sequence[tuple[Any, Hashable]]) -> SimResult:
    """Like `simulate`, and also raise `ScheduleError` at the first step over ``problem.budget``."""
    return _execute(problem, schedule, enforce_budget=True)
