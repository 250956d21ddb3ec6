"""The keep / recompute / offload MILP: one MILP chooses keep / recompute / offload for every value
and minimises step time (compute plus waits for host copies) under the budget.

The model extends Checkmate's stage formulation (see `checkmate.py`) with a
host link. Values to compute are taken in a fixed topological order (the
problem's, or another one, see below); stage ``t`` recomputes some earlier
values (each at most once, in that order) and then computes the order's
value ``t`` for the first time; a virtual end stage reads every sink.
Binary variables, for stages ``t`` and values ``i``:

* ``R[t,i]``: i is computed in stage t (``R[t,t] = 1``);
* ``S[t,i]``: i is on the device when stage t starts;
* ``O[t,i]``: an offload of i is issued when stage t starts (i must be in
  ``S[t,i]``); the device copy is held through stage t, so the copy can
  overlap the stage's compute, and dropped at the stage's end (i is not
  kept into stage t+1). A value is offloaded at most once (the simulator
  keeps one host copy per value);
* ``P[t,i]``: a prefetch of i is issued when stage t starts; i needs a host
  copy from an earlier stage, counts on the device for the whole of stage t
  and can be read from stage t+1 on;
* ``FREE[t,i,k]``: i is dropped right after computing k in stage t, as in
  Checkmate (never for a value offloaded in that stage).

Memory after every compute of every stage (``U[t,k]``, device values held at
the stage start plus prefetches issued at it, plus computes, minus frees) is
within the budget, exactly as in Checkmate; host memory (the sum of offloaded
sizes) is within ``host_capacity`` when that is set. Only the values the
problem allows (``Problem.offloadable``: non-sources that own their storage
and are not marked otherwise) can be offloaded.

Time: every stage lasts its compute time ``C_t`` (the sum of the costs of its
computes) plus a wait ``w_t >= 0`` with ``w_t >= (seconds of offloads issued
in stage t) - C_t`` and the same for prefetches (one copy stream per
direction). The objective is the sum of ``C_t + w_t``.

Approximations (the simulator is the judge; `finish` simulates the decoded
schedule):

* each copy must hide behind the compute of the one stage in which it is
  issued: a copy longer than that stage is charged its excess as waiting
  even if it would have overlapped later stages, and a prefetch is readable
  only from the next stage, so it holds memory for one stage longer than
  strictly needed. Both make the model pessimistic;
* the copy streams are assumed idle at every stage start (the decoded
  schedule drops an offloaded value at the end of its stage, which waits for
  the copy, so this holds for offloads; a prefetch nobody reads in the next
  stage may still be in flight, which the model does not see);
* views count their full size unless they alias a source (no discount for a
  view whose base is resident), so the model is pessimistic about memory on
  graphs with views; sizes are rounded up and the budget down as in
  Checkmate;
* the order of first computations is fixed, so the model's space is
  Checkmate's space plus transfers, not every schedule.

The decoded schedule issues each stage's offloads and prefetches at its
start, computes in order, frees every value instance right after its last
use (an offloaded one not before its stage ends), never frees the last
instance of a sink, and drops prefetches that nobody reads.

How it is run (a heuristic first, then the MILP in two orders) is the
strategy "offload_milp" (`strategies/joint.py`).

Size limit: graphs with more than `MAX_COMPUTE` values to compute raise
`MethodFailed`: the model has O(m^2) variables per family (about 4 m^2 in
all), and past that size the MILP stops at its time limit with unproven
schedules.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..core.problem import Problem
from ..core.schedule import Op, Schedule, Step
from .checkmate import MemoryScale, add_stage_memory, memory_scale
from .milp_backends import BACKENDS, ONE, RAW_FEASIBLE, RAW_OPTIMAL, ZERO, Builder

MAX_COMPUTE = 60  # values to compute; larger graphs raise MethodFailed
BACKEND = "highs"
MEMORY_UNITS_LIMIT = 2**20  # as for Checkmate with HiGHS: coarser units beyond
THREADS: Optional[int] = None



@dataclass(frozen=True)
class JointStage:
    """What one stage does, as problem node indices, in execution order."""

    offload: tuple[int, ...]
    prefetch: tuple[int, ...]
    compute: tuple[int, ...]


@dataclass(frozen=True)
class JointPlan:
    stages: tuple[JointStage, ...]


@dataclass
class _Vars:
    R: dict[tuple[int, int], int] = field(default_factory=dict)
    S: dict[tuple[int, int], int] = field(default_factory=dict)
    O: dict[tuple[int, int], int] = field(default_factory=dict)
    P: dict[tuple[int, int], int] = field(default_factory=dict)
    F: dict[tuple[int, int, int], int] = field(default_factory=dict)
    U: dict[tuple[int, int], int] = field(default_factory=dict)
    W: dict[int, int] = field(default_factory=dict)


class _JointModel:
    """The MILP over local indices 0..m-1 (the values to compute, then the end node)."""

    def __init__(self, problem: Problem, builder: Builder, scale: MemoryScale, order: list[int]) -> None:
        # ``order``: the values to compute in a topological order (stage t computes order[t] first).
        self.p, self.b = problem, builder
        real = list(order)
        local = {v: i for i, v in enumerate(real)}
        position = {v: i for i, v in enumerate(problem.non_sources)}
        scale = MemoryScale(scale.unit, scale.budget, [scale.size[position[v]] for v in real])
        end = len(real)
        m = end + 1
        self.m = m
        self.nodes: list[Optional[int]] = list(real) + [None]
        self.preds = [[local[q] for q in problem.preds[v] if q in local] for v in real] + \
            [[local[v] for v in problem.sinks]]
        self.succs = [[local[q] for q in problem.succs[v]] + ([end] if problem.is_sink[v] else []) for v in real] + [[]]
        recomputable = [bool(problem.recomputable[v]) for v in real] + [False]
        size = list(scale.size) + [0]
        self.size, self.budget_units = size, scale.budget
        has_host = problem.has_host
        # A zero-size value never needs to leave the device.
        offloadable = [has_host and bool(problem.offloadable[v]) and size[i] > 0 for i, v in enumerate(real)] + [False]
        transfer = [problem.transfer_time(v) if offloadable[i] else 0.0 for i, v in enumerate(real)] + [0.0]
        cost = [float(problem.cost[v]) for v in real] + [0.0]
        x = self.x = _Vars()
        b = builder
        for t in range(m):
            for i in range(t):
                if recomputable[i]:
                    x.R[t, i] = b.bool_var()
                x.S[t, i] = b.bool_var()
                # Offloading in the end stage, or prefetching in it or for it, is useless.
                if offloadable[i] and t <= m - 2:
                    x.O[t, i] = b.bool_var()
                    if t >= i + 2:
                        x.P[t, i] = b.bool_var()
        # Inputs resident for every compute (a prefetch of this stage is not yet readable).
        for t in range(m):
            for j in range(t + 1):
                if self.r(t, j) == ZERO:
                    continue
                for i in self.preds[j]:
                    self._row([self.r(t, j)], [self.r(t, i), self.s(t, i)], -math.inf, 0)
        # Kept into the next stage only if on the device in this one.
        for t in range(m - 1):
            for i in range(t + 1):
                self._row([self.s(t + 1, i)], [self.r(t, i), self.s(t, i), self.pf(t, i)], -math.inf, 0)
        # At most one way of being on the device in a stage (a resident value is never
        # recomputed or prefetched: the simulator forbids both).
        for t in range(m):
            for i in range(t):
                ops = [h for h in (self.r(t, i), self.s(t, i), self.pf(t, i)) if h >= 0]
                if len(ops) > 1:
                    self._row(ops, [], -math.inf, 1)
        # Offloads: from a value held at the stage start, dropped at its end, once per value.
        offloads_of: dict[int, list[int]] = {}
        for (t, i), o in x.O.items():
            self._row([o], [self.s(t, i)], -math.inf, 0)
            self._row([o, self.s(t + 1, i)], [], -math.inf, 1)
            offloads_of.setdefault(i, []).append(o)
        for i, os_ in offloads_of.items():
            if len(os_) > 1:
                b.add([(o, 1.0) for o in os_], -math.inf, 1.0)
        # Prefetches need a host copy made in an earlier stage.
        for (t, i), h in x.P.items():
            earlier = [x.O[u, i] for u in range(i + 1, t) if (u, i) in x.O]
            b.add([(h, 1.0)] + [(o, -1.0) for o in earlier], -math.inf, 0.0)
        if has_host and problem.host_capacity is not None and x.O:
            cap = float(problem.host_capacity)
            b.add([(o, float(problem.mem[real[i]])) for (t, i), o in x.O.items()], -math.inf, cap)
        # Memory, stage by stage, as in Checkmate, with prefetches counted from the stage start.
        for t in range(m):
            held = [(x.S[t, i], -float(size[i])) for i in range(t) if size[i]]
            held += [(x.P[t, i], -float(size[i])) for i in range(t) if size[i] and (t, i) in x.P]
            add_stage_memory(b, t, size, scale.budget, held, self.r, lambda k: self._frees(t, k), x.U)
        # Time: compute of each stage plus the copy time it cannot hide, per direction.
        objective: list[tuple[int, float]] = []
        for (t, i), h in x.R.items():
            if cost[i]:
                objective.append((h, cost[i]))
        for t in range(m):
            outs = [(o, transfer[i]) for (u, i), o in x.O.items() if u == t]
            ins = [(h, transfer[i]) for (u, i), h in x.P.items() if u == t]
            if not outs and not ins:
                continue
            w = b.num_var(0.0, math.inf)
            x.W[t] = w
            compute = [(x.R[t, i], cost[i]) for i in range(t) if (t, i) in x.R and cost[i]]
            for copies in (outs, ins):
                if copies:
                    # w + C_t - copies >= 0, with C_t = cost[t] + sum cost[i] R[t,i]
                    b.add([(w, 1.0)] + compute + [(h, -c) for h, c in copies], -cost[t], math.inf)
            objective.append((w, 1.0))
        b.minimize(objective, sum(cost))

    # -- operands: a variable handle, ONE or ZERO
    def r(self, t: int, i: int) -> int:
        if i == t:
            return ONE
        return self.x.R.get((t, i), ZERO) if i < t else ZERO

    def s(self, t: int, i: int) -> int:
        if t >= self.m:
            return ZERO
        return self.x.S[t, i] if i < t else ZERO

    def pf(self, t: int, i: int) -> int:
        return self.x.P.get((t, i), ZERO)

    def _row(self, pos: list[int], neg: list[int], lb: float, ub: float) -> None:
        """lb <= sum(pos) - sum(neg) <= ub, constants folded."""
        self.b.add_folded(pos, neg, lb, ub)

    def _frees(self, t: int, k: int) -> list[tuple[int, float]]:
        """FREE[t,i,k] for the values that may be dropped right after computing k."""
        out = []
        for i in self.preds[k] + [k]:
            if not self.size[i]:
                continue
            keep = self.s(t + 1, i)
            if keep == ONE:
                continue
            hazards = [self.r(t, j) for j in self.succs[i] if k < j <= t]
            if ONE in hazards:
                continue
            f = self.b.bool_var()
            self.x.F[t, i, k] = f
            self._row([f], [self.r(t, k)], -math.inf, 0)
            self._row([f, keep], [], -math.inf, 1)
            for h in hazards:
                self._row([f, h], [], -math.inf, 1)
            o = self.x.O.get((t, i))
            if o is not None:
                self._row([f, o], [], -math.inf, 1)  # an offloaded value is held to the stage end
            out.append((f, float(self.size[i])))
        return out

    def decode(self, values: list[float]) -> JointPlan:
        on = lambda h: h == ONE or (h >= 0 and values[h] > 0.5)  # noqa: E731
        x, nodes = self.x, self.nodes
        stages = []
        for t in range(self.m):
            offs = tuple(nodes[i] for i in range(t) if (t, i) in x.O and on(x.O[t, i]))
            pres = tuple(nodes[i] for i in range(t) if (t, i) in x.P and on(x.P[t, i]))
            comps = tuple(nodes[i] for i in range(t + 1)
                          if nodes[i] is not None and on(self.r(t, i)) and not (i < t and on(self.s(t, i))))
            stages.append(JointStage(offs, pres, comps))  # type: ignore[arg-type]
        return JointPlan(tuple(stages))

    def hint_from(self, schedule: Schedule) -> Optional[dict[int, float]]:
        """Values of every variable that reproduce a remat-only ``schedule``, or None
        when it lies outside the model (first computations in another order, a
        value recomputed twice in a stage or out of order, transfers, or frees
        the model cannot express that leave its memory above the budget)."""
        if schedule.has_transfers():
            return None
        x, end = self.x, self.m - 1
        local = {self.p.names[v]: i for i, v in enumerate(self.nodes) if v is not None}
        values: dict[int, float] = {}
        for group in (x.R, x.S, x.O, x.P, x.F, x.W):
            values.update({h: 0.0 for h in group.values()})
        resident: set[int] = set()
        firsts, stage, last_in_stage, last_compute = 0, -1, -1, -1
        for op, node in schedule:
            i = local.get(node)
            if i is None:
                return None
            if op is Op.COMPUTE:
                t = min(firsts, end)
                if t != stage:  # a new stage: it starts with what is resident now
                    stage, last_in_stage = t, -1
                    for j in resident:
                        values[x.S[t, j]] = 1.0
                if i <= last_in_stage or i > t:
                    return None
                if i == t:
                    firsts += 1
                elif (t, i) in x.R:
                    values[x.R[t, i]] = 1.0
                else:
                    return None
                last_in_stage = last_compute = i
                resident.add(i)
            else:
                resident.discard(i)
                f = x.F.get((stage, i, last_compute))
                if f is not None:
                    values[f] = 1.0
        if stage != end:
            for j in resident:
                values[x.S[end, j]] = 1.0
        # Memory as the model counts it (frees it cannot express keep a value to the stage end).
        on = lambda h: h == ONE or (h >= 0 and values.get(h, 0.0) > 0.5)  # noqa: E731
        size = self.size
        budget = self.budget_units
        for t in range(self.m):
            used = sum(size[i] for i in range(t) if on(x.S[t, i]))
            for k in range(t + 1):
                if on(self.r(t, k)):
                    used += size[k]
                if used > budget + 1e-9:
                    return None
                values[x.U[t, k]] = float(used)
                for i in self.preds[k] + [k]:
                    if values.get(x.F.get((t, i, k), -1), 0.0) > 0.5:
                        used -= size[i]
        return values

    def model_time(self, values: list[float]) -> float:
        """The model's step time of a solution (objective without the solver's tolerances)."""
        cost = [float(self.p.cost[v]) if v is not None else 0.0 for v in self.nodes]
        total = sum(cost) + sum(cost[i] for (t, i), h in self.x.R.items() if values[h] > 0.5)
        return total + sum(values[w] for w in self.x.W.values())


def schedule_from_joint_plan(problem: Problem, plan: JointPlan) -> Schedule:
    """Steps of a joint plan, with frees placed after each instance's last use.

    An instance starts at a compute or a prefetch; reads by computes and its
    offload are its uses; an instance offloaded in a stage is kept until that
    stage's last compute (the free then waits for the copy, which the model
    counts). The last instance of a sink is never freed. A prefetched
    instance that nobody reads is not issued at all."""
    names, preds = problem.names, problem.preds
    is_source = problem.lists().is_source
    # Events: (op, node), with the stage each belongs to.
    events: list[tuple[Op, int]] = []
    stage_of: list[int] = []
    for t, st in enumerate(plan.stages):
        for v in st.offload:
            events.append((Op.OFFLOAD, v))
            stage_of.append(t)
        for v in st.prefetch:
            events.append((Op.PREFETCH, v))
            stage_of.append(t)
        for v in st.compute:
            events.append((Op.COMPUTE, v))
            stage_of.append(t)
    stage_last = {}  # stage -> position of its last event
    for pos, t in enumerate(stage_of):
        stage_last[t] = pos
    current: dict[int, int] = {}  # value -> position of the event that made its live instance
    free_after: dict[int, int] = {}  # instance start -> position after which it is freed
    used: set[int] = set()  # instance starts that were read (or offloaded)
    for pos, (op, v) in enumerate(events):
        if op is Op.COMPUTE:
            for p in preds[v]:
                if is_source[p]:
                    continue
                inst = current[p]
                free_after[inst] = max(free_after[inst], pos)
                used.add(inst)
            current[v] = pos
            free_after[pos] = pos
        elif op is Op.PREFETCH:
            current[v] = pos
            free_after[pos] = pos
        elif op is Op.OFFLOAD:
            inst = current[v]
            free_after[inst] = max(free_after[inst], stage_last[stage_of[pos]])
            used.add(inst)
    never = len(events)
    for v in problem.sinks:
        inst = current.get(v)
        if inst is not None:
            free_after[inst] = never
            used.add(inst)
    skipped = {pos for pos, (op, _) in enumerate(events) if op is Op.PREFETCH and pos not in used}
    frees: dict[int, list[int]] = {}
    for inst, after in free_after.items():
        if inst in skipped or after >= never:
            continue
        frees.setdefault(after, []).append(events[inst][1])
    steps: list[Step] = []
    for pos, (op, v) in enumerate(events):
        if pos not in skipped:
            steps.append(Step(op, names[v]))
        for u in sorted(frees.get(pos, ()), reverse=True):  # views before their bases
            steps.append(Step(Op.FREE, names[u]))
    return Schedule(tuple(steps))


def first_compute_order(problem: Problem, schedule: Schedule) -> list[int]:
    """The values to compute in the order ``schedule`` first computes them (a
    topological order, since a compute needs its inputs resident); values it
    never computes follow in the problem's order."""
    seen: dict[int, None] = {}
    for op, node in schedule:
        if op is Op.COMPUTE:
            seen.setdefault(problem.index[node], None)
    for v in problem.non_sources:
        seen.setdefault(v, None)
    return list(seen)


@dataclass
class MilpRun:
    """One solve of the joint model for one order of first computations."""

    status: str
    schedule: Optional[Schedule]
    model_time: Optional[float]
    variables: int
    seconds: float
    hinted: bool = False


def solve_milp(problem: Problem, order: Optional[list[int]] = None, time_limit: Optional[float] = None,
               hints: Sequence[Schedule] = ()) -> MilpRun:
    """Build and solve the joint model for ``order`` (default: the problem's
    order) and decode its answer. The first of ``hints`` (remat-only
    schedules) that lies in the model warm-starts the solver. No fallback:
    ``schedule`` is None when the solver found nothing (or the sources alone
    exceed the budget)."""
    started = time.perf_counter()
    scale = memory_scale(problem, MEMORY_UNITS_LIMIT)
    if scale is None:
        return MilpRun("infeasible", None, None, 0, time.perf_counter() - started)
    builder = BACKENDS[BACKEND]()
    model = _JointModel(problem, builder, scale, list(problem.non_sources) if order is None else order)
    hinted = False
    for schedule in hints:
        values = model.hint_from(schedule)
        if values is not None:
            builder.hint(values)
            hinted = True
            break
    remaining = None if time_limit is None else max(0.1, time_limit - (time.perf_counter() - started))
    raw = builder.solve(remaining, THREADS)
    schedule = model_time = None
    if raw.status in (RAW_OPTIMAL, RAW_FEASIBLE):
        assert raw.values is not None
        schedule = schedule_from_joint_plan(problem, model.decode(raw.values))
        model_time = model.model_time(raw.values)
    return MilpRun(raw.status, schedule, model_time, len(builder.vars), time.perf_counter() - started, hinted)
