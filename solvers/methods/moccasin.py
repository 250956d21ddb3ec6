"""Moccasin (Bartan et al., ICML 2023): rematerialization as a CP-SAT model of
retention intervals, O(n * C) integer variables instead of Checkmate's O(n^2)
Booleans.

The model. Time is a line of compute steps 0..H-1, one compute per step at
most. Each value v to compute has up to C_v instances (C_v = 1 when v is not
recomputable; ``copies``, e.g. 2, otherwise). Instance c of v has

* a presence literal (the first instance is always present; instance c only
  when c-1 is),
* a start s (the step that computes it) and an end e >= s (the last step at
  which it is still resident): the retention interval [s, e],
* consecutive instances do not overlap (s_{c} > e_{c-1}): a value is never
  computed while resident.

First computations follow a fixed topological order (the order in which the
warm start computes them, so that the warm start lies in the model's space);
recomputations go anywhere. Every compute reads each input from one of the
input's instances that started strictly earlier and is still retained at the
step (a Boolean choice per input instance). The last instance of a sink is
retained to the end. Memory is a cumulative constraint over the retention
intervals, in integer units (`checkmate.memory_scale`: sizes rounded up, the
budget down, the sources taken out). Objective: the cost of the instances
beyond the first.

Alias accounting never undercounts. A view whose alias chain reaches a
source counts 0 (exactly as simulated). Any other view instance is covered
while the instance of its alias parent that it read (its parent is one of
its inputs) is still retained, and counts its full size from the step after
that parent instance's end to its own end (not at all if the parent outlives
it). Whenever the model says "covered", an alias ancestor is resident and
the simulator counts the view as 0; so the simulator's memory of a resident
set is at most what the model counts for it.

Decoding: present instances sorted by start give a compute order. First
`plan.schedule_from_sequence` (frees after the last read, never later than
the model's end, because the instance a compute reads is the latest one of
its input: instances do not overlap); if that schedule does not fit (freeing
a parent early can uncover a view the model counted as covered), the
schedule that frees every instance exactly at the end of its interval
(views before their parents), which holds exactly what the model counted.
`finish` simulates the result. If it does not fit, or costs more than the
warm start, the warm start is returned.

Bounds. CP-SAT's bound holds only for the model's space (fixed order of
first computations, at most C_v instances, conservative views, rounding);
it goes to ``info["model_bound"]``. The reported ``lower_bound`` is
`lower_bounds.lower_bound`, which holds for every schedule.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Optional

from ortools.sat.python import cp_model

from ..core.problem import Problem
from ..core.schedule import Op, Schedule, Step, simulate
from ..core.sequence import schedule_from_sequence
from ..core.solution import FEASIBLE, Solution, finish
from .baselines import best_baseline
from .checkmate import cost_scale, memory_scale
from .lower_bounds import lower_bound as global_lower_bound
from .milp_backends import default_threads

COPIES = 2  # instances per recomputable value (more when the warm start needs them)
MAX_COPIES = 8  # never more than this, even for a warm start that recomputes more often
THREADS: Optional[int] = None  # None: default_threads()
MEMORY_UNITS_LIMIT = 2**30
BOUND_TIME_SHARE = 0.2  # at most this share of the time limit for the global lower bound


@dataclass
class _Instance:
    value: int
    copy: int
    present: cp_model.IntVar | int  # literal, or 1 for the first instance
    start: cp_model.IntVar
    end: cp_model.IntVar


def _instances_of_hint(problem: Problem, schedule: Schedule) -> tuple[list[int], dict[int, list[tuple[int, int]]]]:
    """First-computation order and, per value, its (start, end) compute-step
    intervals in ``schedule`` (end = -1 while never freed)."""
    index = problem.index
    order: list[int] = []
    seen: set[int] = set()
    spans: dict[int, list[tuple[int, int]]] = {}
    k = -1
    for op, node in schedule:
        v = index[node]
        if op == Op.COMPUTE:
            k += 1
            if v not in seen:
                seen.add(v)
                order.append(v)
            spans.setdefault(v, []).append((k, -1))
        elif op == Op.FREE:
            s, _ = spans[v][-1]
            spans[v][-1] = (s, k)
    return order, spans


class _Model:
    def __init__(self, problem: Problem, order: list[int], copies: dict[int, int], size: dict[int, int],
                 capacity: int, cost_factor: float, free_order: bool = False) -> None:
        self.p = problem
        m = cp_model.CpModel()
        self.model = m
        H = sum(copies.values())
        self.H = H
        self.inst: dict[int, list[_Instance]] = {}
        position = {v: k for k, v in enumerate(order)}
        intervals, demands, units = [], [], []
        n_first = len(order)
        for v in order:
            k = position[v]
            row = []
            for c in range(copies[v]):
                # The first compute of the k-th value comes after k others and before n_first-1-k others.
                if free_order:
                    lo, hi = (0, H - 1)
                else:
                    lo, hi = (k, H - (n_first - k)) if c == 0 else (k + 1, H - 1)
                start = m.new_int_var(lo, hi, "")
                end = m.new_int_var(lo, H - 1, "")
                present = 1 if c == 0 else m.new_bool_var("")
                row.append(_Instance(v, c, present, start, end))
                lit = [] if c == 0 else [present]
                units.append(m.new_optional_fixed_size_interval_var(start, 1, True if c == 0 else present, ""))
                m.add(end >= start)
                if c > 0:
                    prev = row[c - 1]
                    if c > 1:
                        m.add_implication(present, prev.present)
                    m.add(start >= prev.end + 1).only_enforce_if(lit)
                    # Absent instances are pinned, so they leave no freedom to explore.
                    m.add(start == H - 1).only_enforce_if(~present)
                    m.add(end == H - 1).only_enforce_if(~present)
            self.inst[v] = row
        if not free_order:
            for a, b in zip(order, order[1:]):
                m.add(self.inst[b][0].start >= self.inst[a][0].start + 1)
        m.add_no_overlap(units)
        # Inputs retained across every compute.
        self.reads: dict[tuple[int, int, int], list[tuple[int, cp_model.IntVar | int]]] = {}
        for v in order:
            for inst in self.inst[v]:
                lit = [] if inst.copy == 0 else [inst.present]
                for u in problem.preds[v]:
                    if problem.is_source[u]:
                        continue
                    sources = self.inst[u]
                    if len(sources) == 1:
                        m.add(sources[0].end >= inst.start).only_enforce_if(lit)
                        if free_order:  # with a fixed order, u's only compute precedes v's first
                            m.add(sources[0].start + 1 <= inst.start)
                        self.reads[v, inst.copy, u] = [(0, 1)]
                        continue
                    choices = []
                    for src in sources:
                        z = m.new_bool_var("")
                        if src.copy > 0:
                            m.add_implication(z, src.present)
                        if free_order or not (src.copy == 0 and inst.copy == 0):  # else implied by the order
                            m.add(src.start + 1 <= inst.start).only_enforce_if(z)
                        m.add(src.end >= inst.start).only_enforce_if(z)
                        choices.append((src.copy, z))
                    if inst.copy == 0:
                        m.add_bool_or([z for _, z in choices])
                    else:
                        m.add_bool_or([z for _, z in choices]).only_enforce_if(inst.present)
                    self.reads[v, inst.copy, u] = choices
        # Memory. A view is covered while the instance of its alias parent that it
        # read is retained: it counts from the step after that instance's end
        # (``count_from``), or not at all when the parent outlives it.
        self.count_from: dict[tuple[int, int], tuple[cp_model.IntVar, cp_model.IntVar]] = {}
        self.lengths: list[tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar, Optional[cp_model.IntVar]]] = []
        for v in order:
            if size[v] <= 0:
                continue
            a = int(problem.alias_of[v])
            for inst in self.inst[v]:
                lit = [] if inst.copy == 0 else [inst.present]
                if a < 0 or a not in self.inst:
                    length = m.new_int_var(1, H, "")
                    self.lengths.append((length, inst.start, inst.end, None))
                    intervals.append(m.new_optional_interval_var(inst.start, length, inst.end + 1,
                                                                 True if inst.copy == 0 else inst.present, ""))
                    demands.append(size[v])
                    continue
                count_from = m.new_int_var(0, H, "")
                counted = m.new_bool_var("")
                m.add(count_from >= inst.start)
                for copy, z in self.reads[v, inst.copy, a]:
                    parent_end = self.inst[a][copy].end
                    m.add(count_from <= parent_end + 1).only_enforce_if(lit if isinstance(z, int) else [z])
                if inst.copy > 0:
                    m.add_implication(counted, inst.present)
                m.add(count_from >= inst.end + 1).only_enforce_if(~counted)
                length = m.new_int_var(0, H, "")
                self.lengths.append((length, count_from, inst.end, counted))
                intervals.append(m.new_optional_interval_var(count_from, length, inst.end + 1, counted, ""))
                demands.append(size[v])
                self.count_from[v, inst.copy] = (count_from, counted)
        if intervals:
            m.add_cumulative(intervals, demands, capacity)
        # Sinks: the last present instance is retained to the end.
        for v in problem.sinks:
            row = self.inst[v]
            for c, inst in enumerate(row):
                cond = [] if c == 0 else [inst.present]
                if c + 1 < len(row):
                    cond.append(~row[c + 1].present)
                m.add(inst.end == H - 1).only_enforce_if(cond)
        terms, coefs = [], []
        for v in order:
            c_int = int(math.floor(float(problem.cost[v]) * cost_factor + 1e-9 * max(1.0, problem.cost[v] * cost_factor)))
            for inst in self.inst[v][1:]:
                if c_int:
                    terms.append(inst.present)
                    coefs.append(c_int)
        m.minimize(cp_model.LinearExpr.weighted_sum(terms, coefs) if terms else 0)
        self.cost_factor = cost_factor

    def hint(self, spans: dict[int, list[tuple[int, int]]]) -> None:
        """Hint every variable from the warm start's intervals."""
        m, H = self.model, self.H
        current: dict[int, int] = {}  # value -> copy live at a step, filled in start order
        events = sorted((s, v, c) for v, row in spans.items() for c, (s, _) in enumerate(row))
        for v, row in self.inst.items():
            for c, inst in enumerate(row):
                if c < len(spans[v]):
                    s, e = spans[v][c]
                    e = H - 1 if e < 0 else e
                    if c > 0:
                        m.add_hint(inst.present, True)
                else:
                    s = e = H - 1
                    m.add_hint(inst.present, False)
                m.add_hint(inst.start, s)
                m.add_hint(inst.end, e)
        for s, v, c in events:
            for u in self.p.preds[v]:
                choices = self.reads.get((v, c, u))
                if choices is None:
                    continue
                live = current.get(u, 0)
                for copy, z in choices:
                    if not isinstance(z, int):
                        m.add_hint(z, copy == live)
            current[v] = c
        # Views count from the step after the end of the parent instance they read.
        self._cf_hint: dict[tuple[int, int], int] = {}
        for (v, c), (count_from, counted) in self.count_from.items():
            if c >= len(spans[v]):
                self._cf_hint[v, c] = H
                m.add_hint(count_from, H)
                m.add_hint(counted, False)
                continue
            sv, ev = spans[v][c]
            ev = H - 1 if ev < 0 else ev
            a = int(self.p.alias_of[v])
            live = max(k for k, (sa, _) in enumerate(spans[a]) if sa < sv)
            ea = spans[a][live][1]
            ea = H - 1 if ea < 0 else ea
            cf = max(sv, ea + 1)
            self._cf_hint[v, c] = cf
            m.add_hint(count_from, cf)
            m.add_hint(counted, cf <= ev)
        # Interval lengths, so that the hint is complete (CP-SAT then checks it up front).
        hinted = {}
        for v, row in self.inst.items():
            for c, inst in enumerate(row):
                if c < len(spans[v]):
                    st, en = spans[v][c]
                    hinted[inst.start.index], hinted[inst.end.index] = st, (H - 1 if en < 0 else en)
                else:
                    hinted[inst.start.index], hinted[inst.end.index] = H - 1, H - 1
        for (v, c), (count_from, counted) in self.count_from.items():
            hinted[count_from.index] = self._cf_hint[v, c]
        for length, start, end, counted in self.lengths:
            m.add_hint(length, max(0, hinted[end.index] + 1 - hinted[start.index]))
        # Instances of a value the hint never computes a second time read nothing: hint them "no".
        for (v, c, u), choices in self.reads.items():
            if c >= len(spans[v]):
                for _, z in choices:
                    if not isinstance(z, int):
                        m.add_hint(z, False)

    def decode(self, solver: cp_model.CpSolver) -> tuple[list[int], Schedule]:
        """The compute order, and the schedule that frees each instance right
        after the last compute within its retention interval (views before
        their bases), which holds exactly what the model counted."""
        starts, ends = [], []
        for v, row in self.inst.items():
            for inst in row:
                if inst.copy == 0 or solver.boolean_value(inst.present):
                    starts.append((solver.value(inst.start), v))
                    ends.append((solver.value(inst.end), v))
        starts.sort()
        order = [v for _, v in starts]
        names = self.p.names
        frees: dict[int, list[int]] = {}  # position in order -> values freed after it
        positions = [t for t, _ in starts]
        for e, v in ends:
            if e >= self.H - 1:
                continue  # retained to the end
            k = bisect.bisect_right(positions, e) - 1
            frees.setdefault(k, []).append(v)
        steps: list[Step] = []
        for k, v in enumerate(order):
            steps.append(Step(Op.COMPUTE, names[v]))
            for u in sorted(frees.get(k, ()), reverse=True):
                steps.append(Step(Op.FREE, names[u]))
        return order, Schedule(tuple(steps))


def solve_moccasin(problem: Problem, time_limit: Optional[float] = None, copies: int = COPIES,
                   free_order: bool = False) -> Solution:
    """``free_order=True`` drops the fixed order of first computations (a larger
    space, a harder model): then the model's bound holds for every schedule that
    computes each value at most C_v times (views still counted conservatively)."""
    started = time.perf_counter()
    method = "moccasin_free" if free_order else "moccasin"
    info: dict = {}
    if problem.n_compute == 0:
        return finish(problem, Schedule(()), method, started, lower_bound=0.0, info=info)
    warm = best_baseline(problem)
    info["hint"] = warm.method
    if warm.fits and warm.cost <= problem.total_cost() * (1 + 1e-12):
        return finish(problem, warm.schedule, method, started, lower_bound=problem.total_cost(), info=info)
    scale = memory_scale(problem, MEMORY_UNITS_LIMIT)
    if scale is None:  # the sources alone exceed the budget
        info["model_status"] = "infeasible"
        return finish(problem, warm.schedule, method, started, lower_bound=None, status=FEASIBLE, info=info)
    bound_limit = None if time_limit is None else BOUND_TIME_SHARE * time_limit
    bound = global_lower_bound(problem, bound_limit)
    info["bound_time"] = time.perf_counter() - started
    order, spans = _instances_of_hint(problem, warm.schedule)
    n_copies = {}
    for v in order:
        need = len(spans[v])
        n_copies[v] = 1 if not problem.recomputable[v] else min(MAX_COPIES, max(copies, need))
    hintable = all(len(spans[v]) <= n_copies[v] for v in order)
    size = dict(zip(problem.non_sources, scale.size))
    n_terms = sum(n_copies.values())
    factor = cost_scale([float(problem.cost[v]) for v in problem.non_sources], n_terms)
    model = _Model(problem, order, n_copies, size, scale.budget, factor, free_order)
    if hintable:
        model.hint(spans)
    info.update(free_order=free_order, memory_unit=scale.unit, cost_factor=factor, horizon=model.H, hinted=hintable,
                variables=len(model.model.proto.variables), build_time=time.perf_counter() - started)
    solver = cp_model.CpSolver()
    if time_limit is not None:
        solver.parameters.max_time_in_seconds = max(0.1, time_limit - (time.perf_counter() - started))
    solver.parameters.num_workers = THREADS or default_threads()
    # Probing in presolve took 8 s of a 15 s limit on ResNet-50 and then stopped
    # without even reporting the (complete, feasible) hint; without it the hint
    # is the first solution within a second.
    solver.parameters.cp_model_probing_level = 0
    code = solver.solve(model.model)
    info["model_status"] = solver.status_name(code)
    lower = bound if math.isfinite(bound) else None
    schedule = warm.schedule
    info["schedule_from"] = "hint"
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        info["model_bound"] = problem.total_cost() + solver.best_objective_bound / factor
        order, by_interval = model.decode(solver)
        decoded = schedule_from_sequence(problem, order)
        result = simulate(problem, decoded)
        if not result.fits:  # frees after last use can uncover a view the model counted as covered
            decoded, result = by_interval, simulate(problem, by_interval)
            info["decoded_by"] = "intervals"
        if result.fits and (not warm.fits or result.cost < warm.cost):
            schedule = decoded
            info["schedule_from"] = "model"
        elif not result.fits:
            info["decoded_over_budget"] = result.peak
    elif code == cp_model.INFEASIBLE:
        info["model_bound"] = math.inf
    final = simulate(problem, schedule)
    if not final.fits:
        lower = None  # a bound for fitting schedules says nothing about this one
    elif lower is not None and lower > final.cost * (1 + 1e-9):
        # Cannot happen if lower_bounds is right (its tests check it against exact
        # optima); never let it turn a good schedule into a crash.
        info["bound_error"] = lower
        lower = problem.total_cost()
    return finish(problem, schedule, method, started, lower_bound=lower, info=info)


def solve_moccasin_free(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    """Moccasin without the fixed order of first computations."""
    return solve_moccasin(problem, time_limit, free_order=True)
