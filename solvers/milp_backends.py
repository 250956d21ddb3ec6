"""Thin adapters that let one formulation be solved by CP-SAT or by a MIP
solver through MathOpt (HiGHS, SCIP).

A formulation talks to a `Builder`: it asks for Boolean and numeric
variables (returned as integer handles), adds ``lb <= sum(coef * var) <= ub``
rows and sets a linear objective to minimise. `Builder.solve` returns a
`RawResult` in the formulation's own units. CP-SAT needs integer
coefficients; the formulation is responsible for scaling (see
`checkmate.py`).
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from ortools.math_opt.python import mathopt
from ortools.sat.python import cp_model

# Statuses of a raw solve.
RAW_OPTIMAL = "optimal"
RAW_FEASIBLE = "feasible"
RAW_INFEASIBLE = "infeasible"
RAW_UNKNOWN = "unknown"  # stopped (time limit) without a solution

Terms = Sequence[tuple[int, float]]

# CP-SAT linearization level.
LINEARIZATION_LEVEL = 1  # CP-SAT default; 2 (full LP) did not help on Checkmate models


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class RawResult:
    status: str
    values: Optional[list[float]]  # one per variable handle, None without a solution
    objective: Optional[float]
    bound: float  # proven lower bound on the objective (-inf when none)


class Builder:
    """Interface implemented by the backends below."""

    integer_objective: bool = False

    def bool_var(self) -> int: ...
    def num_var(self, lb: float, ub: float) -> int: ...
    def add(self, terms: Terms, lb: float, ub: float) -> None: ...
    def minimize(self, terms: Terms, offset: float) -> None: ...
    def solve(self, time_limit: Optional[float], threads: Optional[int]) -> RawResult: ...


class CpSatBuilder(Builder):
    integer_objective = True

    def __init__(self) -> None:
        self.model = cp_model.CpModel()
        self.vars: list[cp_model.IntVar] = []

    def bool_var(self) -> int:
        self.vars.append(self.model.new_bool_var(""))
        return len(self.vars) - 1

    def num_var(self, lb: float, ub: float) -> int:
        self.vars.append(self.model.new_int_var(math.ceil(lb), math.floor(ub), ""))
        return len(self.vars) - 1

    def add(self, terms: Terms, lb: float, ub: float) -> None:
        v = self.vars
        expr = cp_model.LinearExpr.weighted_sum([v[i] for i, _ in terms], [int(c) for _, c in terms])
        lo = math.ceil(lb) if lb > -math.inf else -(2**62)
        hi = math.floor(ub) if ub < math.inf else 2**62
        self.model.add_linear_constraint(expr, lo, hi)

    def minimize(self, terms: Terms, offset: float) -> None:
        v = self.vars
        self.offset = offset
        self.model.minimize(cp_model.LinearExpr.weighted_sum([v[i] for i, _ in terms], [int(c) for _, c in terms]))

    def solve(self, time_limit: Optional[float], threads: Optional[int]) -> RawResult:
        solver = cp_model.CpSolver()
        if time_limit is not None:
            solver.parameters.max_time_in_seconds = max(0.01, float(time_limit))
        solver.parameters.num_workers = threads or default_threads()
        solver.parameters.linearization_level = LINEARIZATION_LEVEL
        code = solver.solve(self.model)
        has_solution = code in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        status = {cp_model.OPTIMAL: RAW_OPTIMAL, cp_model.FEASIBLE: RAW_FEASIBLE,
                  cp_model.INFEASIBLE: RAW_INFEASIBLE}.get(code, RAW_UNKNOWN)
        if code == cp_model.MODEL_INVALID:
            raise RuntimeError("CP-SAT rejected the model: " + self.model.validate())
        values = [float(solver.value(x)) for x in self.vars] if has_solution else None
        objective = solver.objective_value + self.offset if has_solution else None
        # The bound is on the integer objective; the offset is exact.
        bound = solver.best_objective_bound + self.offset if status != RAW_INFEASIBLE else math.inf
        return RawResult(status, values, objective, bound)


class MathOptBuilder(Builder):
    def __init__(self, solver_type: mathopt.SolverType) -> None:
        self.solver_type = solver_type
        self.model = mathopt.Model(name="checkmate")
        self.vars: list[mathopt.Variable] = []

    def bool_var(self) -> int:
        self.vars.append(self.model.add_binary_variable())
        return len(self.vars) - 1

    def num_var(self, lb: float, ub: float) -> int:
        self.vars.append(self.model.add_variable(lb=lb, ub=ub))
        return len(self.vars) - 1

    def add(self, terms: Terms, lb: float, ub: float) -> None:
        row = self.model.add_linear_constraint(lb=lb, ub=ub)
        v = self.vars
        for i, c in terms:
            row.set_coefficient(v[i], c)

    def minimize(self, terms: Terms, offset: float) -> None:
        obj = self.model.objective
        obj.is_maximize = False
        obj.offset = offset
        v = self.vars
        for i, c in terms:
            obj.set_linear_coefficient(v[i], c)

    def solve(self, time_limit: Optional[float], threads: Optional[int]) -> RawResult:
        params = mathopt.SolveParameters(relative_gap_tolerance=1e-7, absolute_gap_tolerance=1e-9)
        if self.solver_type != mathopt.SolverType.HIGHS:  # HiGHS takes threads only as a global setting
            params.threads = threads or default_threads()
        if time_limit is not None:
            params.time_limit = datetime.timedelta(seconds=max(0.01, float(time_limit)))
        result = mathopt.solve(self.model, self.solver_type, params=params)
        reason = result.termination.reason
        TR = mathopt.TerminationReason
        if reason in (TR.NUMERICAL_ERROR, TR.OTHER_ERROR, TR.IMPRECISE):
            raise RuntimeError(f"{self.solver_type.name} failed: {result.termination}")
        if reason == TR.INFEASIBLE:
            return RawResult(RAW_INFEASIBLE, None, None, math.inf)
        bound = result.termination.objective_bounds.dual_bound
        if not result.has_primal_feasible_solution():
            return RawResult(RAW_UNKNOWN, None, None, bound)
        values_by_var = result.variable_values()
        values = [float(values_by_var[x]) for x in self.vars]
        status = RAW_OPTIMAL if reason == TR.OPTIMAL else RAW_FEASIBLE
        return RawResult(status, values, float(result.objective_value()), bound)


BACKENDS = {
    "cpsat": CpSatBuilder,
    "highs": lambda: MathOptBuilder(mathopt.SolverType.HIGHS),
    "scip": lambda: MathOptBuilder(mathopt.SolverType.GSCIP),
}
