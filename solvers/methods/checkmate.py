"""Checkmate (Jain et al., MLSys 2020): optimal rematerialization as a MILP.

Values to compute are taken in the problem's fixed topological order;
stage ``t`` computes value ``t`` for the first time, after recomputing any
earlier values it chooses (each at most once per stage, in order). Binary
variables, for stages ``t`` and values ``i``:

* ``R[t,i]`` (i <= t): value i is computed in stage t; ``R[t,t] = 1``;
* ``S[t,i]`` (i < t): value i is resident when stage t starts;
* ``FREE[t,i,k]``: value i is freed in stage t right after computing k
  (k = i or a consumer of i): only when k is computed, i is not kept into
  stage t+1 and no later consumer of i is computed in stage t.

Constraints: inputs resident for every compute (``R[t,j] <= R[t,i] + S[t,i]``),
only computed values kept (``S[t+1,i] <= R[t,i] + S[t,i]``), non-recomputable
values computed only in their own stage, and the memory ``U[t,k]`` after
computing k in stage t (before its frees) within the budget. Minimise the
sum of compute costs. One extension to the paper: a virtual end node (size
0, cost 0) reads every sink, so its stage may recompute sinks that were
freed earlier, and all sinks are resident when it runs.

Memory accounting is never optimistic compared to the simulator:

* sizes are scaled to integer units, rounding sizes up and the budget down;
* a view whose alias chain reaches a source counts 0 (exactly as simulated);
* any other view counts its full size, except that for a stage where both the
  view and its direct alias parent are kept from the stage before and into the
  stage after (a variable ``W[t,v] <= S[t,v], S[t+1,v], S[t,a], S[t+1,a]``), its
  size is subtracted for the whole stage; decoding then holds both through the
  stage, so the view is covered at every instant of it;
* the decoded schedule frees each value after its last use, which never keeps
  more than the MILP counts.

The schedule is decoded through `plan.schedule_from_plan` and checked by the
simulator. The solver's proven objective bound holds for every schedule in
Checkmate's space only (fixed order of first computations, stage structure
above, memory rounded as described): it goes to ``info["model_bound"]``, and
status ``optimal`` means optimal in that space. ``lower_bound`` is the sum of
all costs, which holds for every schedule.
The solver is warm-started ("hinted") with the cheapest fitting schedule of
the fast baselines that lies in Checkmate's space. When the solver returns
no schedule in time, that schedule (or else the best constructive baseline)
is returned instead, with ``model_bound = min(bound, its cost)`` (still a
valid bound for Checkmate's space) and status ``feasible``; when the MILP is
proven infeasible, ``model_bound`` is None.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..core.memory import memory_of
from ..core.method import HINTS, portfolio
from ..core.problem import Problem
from ..core.schedule import Schedule, simulate
from ..core.sequence import StagePlan, schedule_from_plan
from ..core.solution import FEASIBLE, OPTIMAL, MethodFailed, Solution, finish
from .baselines import BASELINE_METHODS, best_baseline
from .milp_backends import (
    BACKENDS,
    ONE,
    RAW_FEASIBLE,
    RAW_INFEASIBLE,
    RAW_OPTIMAL,
    ZERO,
    Builder,
)

# Largest budget, in memory units, handed to each backend (sizes are coarsened beyond it).
MEMORY_UNITS_LIMIT = {"cpsat": 2**30, "highs": 2**20, "scip": 2**20}
DEFAULT_BACKEND = "highs"  # faster than CP-SAT on these models (see benchmarks/results/solvers.md)
THREADS: Optional[int] = None  # None: backends pick (min(8, cpu count))
# Models larger than this are not handed to the backend: HiGHS overran a 60 s limit
# by 5-8x on a 415k-variable model (490-value training graph), CP-SAT stops on time.
MAX_VARIABLES = {"cpsat": 3_000_000, "highs": 150_000, "scip": 150_000}



@dataclass(frozen=True)
class MemoryScale:
    unit: int  # bytes per unit
    budget: int  # units available to the values to compute (sources taken out)
    size: list[int]  # units per value to compute, rounded up; 0 for views of sources


def memory_scale(problem: Problem, limit: int) -> Optional[MemoryScale]:
    """Integer memory units for the MILP, or None when the sources alone exceed the budget."""
    nodes = problem.non_sources
    available = problem.budget - memory_of(problem, ())
    if available < 0:
        return None
    # A view whose alias chain reaches a source never adds memory.
    covered = np.zeros(problem.n, dtype=bool)
    for v in nodes:
        a = problem.alias_of[v]
        covered[v] = a >= 0 and (problem.is_source[a] or covered[a])
    raw = [0 if covered[v] else int(problem.mem[v]) for v in nodes]
    unit = 0
    for s in raw:
        unit = math.gcd(unit, s)
    unit = max(unit, 1)
    if available // unit > limit:
        unit = max(unit, -(-available // limit))
    return MemoryScale(unit=unit, budget=available // unit, size=[-(-s // unit) for s in raw])


def estimate_variables(problem: Problem) -> int:
    """Variables of the formulation, give or take the alias terms (R, S, FREE, U)."""
    m = problem.n_compute + 1
    local_preds = [sum(1 for q in problem.preds[v] if not problem.is_source[q]) for v in problem.non_sources]
    free = sum((deg + 1) * (m - k) for k, deg in enumerate(local_preds))
    return m * m + m * (m + 1) // 2 + free


def cost_scale(costs: list[float], n_terms: int) -> float:
    """Factor turning costs into integers for CP-SAT. Coefficients are floored,
    so ``bound / factor`` stays a valid lower bound. A small power of ten that
    makes every cost integral is preferred (exact, and small coefficients
    keep CP-SAT fast); otherwise the largest safe factor."""
    top = max(costs, default=0.0)
    if top <= 0:
        return 1.0
    n_terms = max(n_terms, 1)
    for digits in range(7):
        factor = 10.0 ** digits
        if top * factor * n_terms > 2**50:
            break
        if all(abs(c * factor - round(c * factor)) <= 1e-9 * max(1.0, c * factor) for c in costs):
            return factor
    return min(2**30 / top, 2**50 / (top * n_terms))


def add_stage_memory(b: Builder, t: int, size: list[int], budget: int, held: list[tuple[int, float]],
                     r: Callable[[int, int], int], frees: Callable[[int], list[tuple[int, float]]],
                     U: dict[tuple[int, int], int]) -> None:
    """Memory rows of stage ``t`` in Checkmate's formulation (shared with `joint`).

    ``U[t, k]`` is the memory while value k is computed in stage t: at k = 0 the
    stage's start (``held``: terms for what it holds, as ``(handle, -bytes)``,
    plus any discounts) plus value 0 if computed; then the previous U, less what
    the FREE variables ``frees(k - 1)`` drop after the previous compute, plus k."""
    prev_u: Optional[int] = None
    prev_free: list[tuple[int, float]] = []
    for k in range(t + 1):
        u = b.num_var(-float(sum(size)), float(budget))
        U[t, k] = u
        terms: list[tuple[int, float]] = [(u, 1.0)]
        const = 0.0
        if prev_u is None:
            terms.extend(held)
        else:
            terms.append((prev_u, -1.0))
            terms.extend((f, +sz) for f, sz in prev_free)
        rk = r(t, k)
        if rk == ONE:
            const += size[k]
        elif rk != ZERO and size[k]:
            terms.append((rk, -float(size[k])))
        b.add(terms, const, const)  # u - (previous memory) = +size[k] * R[t,k]
        prev_u = u
        prev_free = frees(k) if rk != ZERO else []


class Formulation:
    """Checkmate's MILP over stages built on a backend: variables, memory rows, decoding (also read by `lower_bounds`)."""

    def __init__(self, problem: Problem, builder: Builder, scale: MemoryScale, cost_factor: float) -> None:
        self.p, self.b = problem, builder
        real = problem.non_sources
        local = {v: i for i, v in enumerate(real)}
        # A virtual end node (size 0, cost 0, computed once) reads every sink: its
        # stage may recompute sinks freed earlier, and its compute is the instant
        # at which all sinks must be resident.
        end = len(real)
        self.nodes: list[Optional[int]] = list(real) + [None]
        m = end + 1
        self.m = m
        self.preds = [[local[q] for q in problem.preds[v] if q in local] for v in real] + [[local[v] for v in problem.sinks]]
        self.succs = [[local[q] for q in problem.succs[v]] + ([end] if problem.is_sink[v] else []) for v in real] + [[]]
        self.recomputable = [bool(problem.recomputable[v]) for v in real] + [False]
        size = list(scale.size) + [0]
        self.size, self.budget_units = size, scale.budget
        self.R: dict[tuple[int, int], int] = {}
        self.S: dict[tuple[int, int], int] = {}
        self.F: dict[tuple[int, int, int], int] = {}
        self.U: dict[tuple[int, int], int] = {}
        self.W: dict[tuple[int, int], int] = {}
        b = builder
        for t in range(m):
            for i in range(t):
                if self.recomputable[i]:
                    self.R[t, i] = b.bool_var()
                self.S[t, i] = b.bool_var()
        # Inputs resident for every compute.
        for t in range(m):
            for j in range(t + 1):
                if self.r(t, j) == ZERO:
                    continue
                for i in self.preds[j]:
                    self._row([self.r(t, j)], [self.r(t, i), self.s(t, i)], -math.inf, 0)
        # Only values resident during a stage can be kept into the next.
        for t in range(m):
            for i in range(t + 1):
                self._row([self.s(t + 1, i)], [self.r(t, i), self.s(t, i)], -math.inf, 0)
        # Alias discounts (see module docstring).
        alias_pairs = []
        for v_local, v in enumerate(real):
            a = int(problem.alias_of[v])
            if a >= 0 and a in local and size[v_local] > 0:
                alias_pairs.append((v_local, local[a]))
        for v, a in alias_pairs:
            for t in range(max(v, a) + 1, m):
                conds = [self.s(t, v), self.s(t + 1, v), self.s(t, a), self.s(t + 1, a)]
                if ZERO in conds:
                    continue
                w = b.bool_var()
                self.W[t, v] = w
                for c in conds:
                    if c != ONE:
                        self._row([w], [c], -math.inf, 0)
        self.alias_parent = dict(alias_pairs)
        # Memory, stage by stage, with FREE variables created on the way.
        for t in range(m):
            held = [(self.S[t, i], -float(size[i])) for i in range(t) if size[i]]
            held += [(self.W[t, v], float(size[v])) for v, _ in alias_pairs if (t, v) in self.W]
            add_stage_memory(b, t, size, scale.budget, held, self.r, lambda k: self._frees(t, k, size), self.U)
        # Objective.
        costs = [float(problem.cost[v]) for v in real] + [0.0]
        obj: list[tuple[int, float]] = []
        for (t, i), h in self.R.items():
            c = costs[i] * cost_factor
            if builder.integer_objective:
                c = math.floor(c + 1e-9 * max(1.0, c))  # 1233.9999999 is 1234, not 1233
            if c:
                obj.append((h, c))
        builder.minimize(obj, sum(costs) * cost_factor)

    # -- operands: a variable handle, ONE or ZERO
    def r(self, t: int, i: int) -> int:
        if i == t:
            return ONE
        return self.R.get((t, i), ZERO) if i < t else ZERO

    def s(self, t: int, i: int) -> int:
        if t >= self.m:
            return ZERO  # nothing needs keeping after the end node
        return self.S[t, i] if i < t else ZERO

    def _row(self, pos: list[int], neg: list[int], lb: float, ub: float) -> None:
        """lb <= sum(pos) - sum(neg) <= ub, with constant operands folded."""
        if lb == -math.inf and ub >= 0 and all(x == ZERO for x in pos):
            return  # -(non-negative terms) <= ub holds trivially
        self.b.add_folded(pos, neg, lb, ub)

    def _frees(self, t: int, k: int, size: list[int]) -> list[tuple[int, float]]:
        """FREE[t,i,k] variables for the values that may be freed after computing k."""
        out = []
        for i in self.preds[k] + [k]:
            if not size[i]:
                continue  # freeing a zero-size value changes nothing
            keep = self.s(t + 1, i)
            if keep == ONE:
                continue
            hazards = [self.r(t, j) for j in self.succs[i] if k < j <= t]
            if ONE in hazards:
                continue
            f = self.b.bool_var()
            self.F[t, i, k] = f
            rk = self.r(t, k)
            if rk != ONE:
                self._row([f], [rk], -math.inf, 0)
            if keep != ZERO:
                self._row([f, keep], [], -math.inf, 1)
            for h in hazards:
                if h != ZERO:
                    self._row([f, h], [], -math.inf, 1)
            out.append((f, float(size[i])))
        return out

    def hint_from(self, schedule: Schedule) -> Optional[dict[int, float]]:
        """Variable values reproducing ``schedule``, or None when the schedule is
        outside Checkmate's space (first computations out of order, a value
        recomputed twice in a stage or out of index order). Frees the MILP
        cannot express are left unhinted; U is left to the solver."""
        index = {self.p.names[v]: i for i, v in enumerate(self.nodes) if v is not None}
        end = self.m - 1
        values: dict[int, float] = {h: 0.0 for h in self.R.values()}
        for group in (self.S, self.F, self.W):
            values.update({h: 0.0 for h in group.values()})
        resident: set[int] = set()
        firsts = 0  # first computations so far = the stage being filled
        stage, last_in_stage, last_compute = -1, -1, -1
        for op, node in schedule:
            i = index[node]
            if op == "compute":
                t = firsts if firsts < end else end
                if t != stage:  # a new stage starts: record what it keeps
                    stage, last_in_stage = t, -1
                    for j in resident:
                        if j < t:
                            values[self.S[t, j]] = 1.0
                if i <= last_in_stage or i > t:
                    return None
                if i == t:
                    firsts += 1
                elif (t, i) in self.R:
                    values[self.R[t, i]] = 1.0
                else:
                    return None  # a non-recomputable value computed again
                last_in_stage, last_compute = i, i
                resident.add(i)
            else:
                resident.discard(i)
                h = self.F.get((stage, i, last_compute))
                if h is not None:
                    values[h] = 1.0
        if stage != end:  # the end stage has no recomputation: it starts with what is left
            for j in resident:
                values[self.S[end, j]] = 1.0
        return values if self._fits(values) else None

    def _fits(self, values: dict[int, float]) -> bool:
        """Whether the hinted R/S/FREE keep the MILP's memory (U, without alias
        discounts) within the budget: the MILP counts more than the simulator
        for views, so a schedule that fits may still lie outside the MILP's space.
        Also fills in the U values, so that the hint is complete (a partial hint
        makes a MIP solver search for the missing values first)."""
        on = lambda x: x == ONE or (x >= 0 and values.get(x, 0.0) > 0.5)  # noqa: E731
        size = self.size
        for t in range(self.m):
            used = sum(size[i] for i in range(t) if on(self.S[t, i]))
            for k in range(t + 1):
                if on(self.r(t, k)):
                    used += size[k]
                if used > self.budget_units:
                    return False
                values[self.U[t, k]] = float(used)
                for i in self.preds[k] + [k]:
                    if values.get(self.F.get((t, i, k), -1), 0.0) > 0.5:
                        used -= size[i]
        return True

    def decode(self, values: list[float]) -> StagePlan:
        on = lambda x: x == ONE or (x >= 0 and values[x] > 0.5)  # noqa: E731
        held_by_stage: dict[int, set] = {}
        for (t, v), w in self.W.items():
            if values[w] > 0.5:
                held_by_stage.setdefault(t, set()).update((self.nodes[v], self.nodes[self.alias_parent[v]]))
        stages, keep = [], []
        for t in range(self.m):
            # Skip a recompute of a value that is already resident (never better, never needed).
            stages.append(tuple(self.nodes[i] for i in range(t + 1)  # type: ignore[misc]
                                if self.nodes[i] is not None and on(self.r(t, i)) and not (i < t and on(self.s(t, i)))))
            keep.append(frozenset(held_by_stage.get(t, ())))
        return StagePlan(tuple(stages), tuple(keep))


def solve_checkmate(problem: Problem, time_limit: Optional[float] = None, backend: str = DEFAULT_BACKEND,
                    method: Optional[str] = None) -> Solution:
    started = time.perf_counter()
    method = method or f"checkmate_{backend}"
    info: dict = {"backend": backend}
    if problem.n_compute == 0:
        return finish(problem, Schedule(()), method, started, lower_bound=0.0, info=info)
    scale = memory_scale(problem, MEMORY_UNITS_LIMIT[backend])
    raw = None
    start: Optional[tuple[Solution, dict[int, float]]] = None
    size = estimate_variables(problem)
    if scale is not None and size > MAX_VARIABLES[backend]:
        # Too large to solve within a time limit: the best baseline, with the sum of costs as bound.
        info.update(milp_status=f"skipped (about {size} variables)")
        fallback = best_baseline(problem)
        info["fallback"] = fallback.method
        return finish(problem, fallback.schedule, method, started, lower_bound=problem.total_cost(),
                      status=FEASIBLE, info=info)
    if scale is not None:
        builder = BACKENDS[backend]()
        n_terms = problem.n_compute * (problem.n_compute + 1) // 2
        factor = cost_scale([float(problem.cost[v]) for v in problem.non_sources], n_terms) \
            if builder.integer_objective else 1.0
        form = Formulation(problem, builder, scale, factor)
        info.update(memory_unit=scale.unit, cost_factor=factor, variables=len(builder.vars))
        # Warm start from the cheapest fitting constructive schedule that lies in Checkmate's space.
        start = _warm_start(problem, form)
        if start is not None:
            builder.hint(start[1])
            info["hint"] = start[0].method
        build_time = time.perf_counter() - started
        info["build_time"] = build_time
        remaining = None if time_limit is None else max(0.1, time_limit - build_time)
        raw = builder.solve(remaining, THREADS)
        info["milp_status"] = raw.status
        # Every schedule computes each value once: the sum of costs is a bound too
        # (and the only one when the solver stops before its root relaxation).
        bound = max(raw.bound / factor, problem.total_cost())
        if raw.status in (RAW_OPTIMAL, RAW_FEASIBLE):
            assert raw.values is not None
            schedule = schedule_from_plan(problem, form.decode(raw.values))
            if start is not None and raw.status != RAW_OPTIMAL and start[0].cost < simulate(problem, schedule).cost:
                schedule = start[0].schedule  # the solver did not improve on (or keep) its hint
                info["schedule_from"] = "hint"
            info["model_bound"] = min(bound, simulate(problem, schedule).cost)
            sol = finish(problem, schedule, method, started, lower_bound=problem.total_cost(),
                         status=OPTIMAL if raw.status == RAW_OPTIMAL else FEASIBLE, info=info)
            if not sol.fits:
                raise RuntimeError(f"{method}: decoded schedule exceeds the budget (peak {sol.peak} > "
                                   f"{problem.budget}); the MILP's memory model is optimistic")
            return sol
    else:
        info["milp_status"] = RAW_INFEASIBLE
        bound = math.inf
    # No MILP schedule: hand back the hint (it lies in Checkmate's space) or the best constructive one.
    fallback = start[0] if scale is not None and start is not None else best_baseline(problem)
    info["fallback"] = fallback.method
    info["model_bound"] = None
    if raw is not None and raw.status != RAW_INFEASIBLE:
        info["model_bound"] = min(bound, fallback.cost)
    return finish(problem, fallback.schedule, method, started, lower_bound=problem.total_cost(), status=FEASIBLE,
                  info=info)


def _warm_start(problem: Problem, form: Formulation) -> Optional[tuple[Solution, dict[int, float]]]:
    candidates = []
    for method in portfolio(BASELINE_METHODS, HINTS):  # fast baselines tried as MILP hints
        try:
            sol = method.solve(problem, None)
        except MethodFailed:
            continue
        if sol.fits:
            candidates.append(sol)
    for sol in sorted(candidates, key=lambda s: s.cost):
        values = form.hint_from(sol.schedule)
        if values is not None:
            return sol, values
    return None


def solve_checkmate_cpsat(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    return solve_checkmate(problem, time_limit, backend="cpsat")


def solve_checkmate_highs(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    return solve_checkmate(problem, time_limit, backend="highs")


def solve_checkmate_scip(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    return solve_checkmate(problem, time_limit, backend="scip")


def solve_checkmate_default(problem: Problem, time_limit: Optional[float] = None) -> Solution:
    return solve_checkmate(problem, time_limit, backend=DEFAULT_BACKEND, method="checkmate")
