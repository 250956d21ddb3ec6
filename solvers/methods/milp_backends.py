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

import contextlib
import ctypes
import datetime
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
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


# A debugging print left in HiGHS 1.12 (bundled with OR-Tools 9.15): it goes to the process's
# standard output whatever the solver's output settings (ERGO-Code/HiGHS#2783), a dozen times in
# a solve that repairs its incumbents. `_without_stray_prints` drops it and passes the rest on.
STRAY_PRINTS = (b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n",)
NATIVE_STDOUT = 1  # the descriptor native code prints to, whatever ``sys.stdout`` is
_FILTERING = threading.Lock()  # one solve at a time swaps the descriptor


def _flush_native_stdout() -> None:
    """Flush the C library's stdout buffer (a native print sits there until flushed)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to load by that name (not POSIX)
        pass


@contextlib.contextmanager
def _without_stray_prints() -> Iterator[None]:
    """While the block runs, the process's standard output (`NATIVE_STDOUT`) is a pipe whose
    reader passes everything on except `STRAY_PRINTS`; Python's own writes (a progress bar
    redrawn by another thread) go through the same pipe, in order. Does nothing when there is no
    standard output, or while a solve in another thread filters."""
    try:
        os.fstat(NATIVE_STDOUT)
    except OSError:
        yield
        return
    if not _FILTERING.acquire(blocking=False):
        yield
        return
    try:
        with _filtered(NATIVE_STDOUT):
            yield
    finally:
        _FILTERING.release()


@contextlib.contextmanager
def _filtered(fd: int) -> Iterator[None]:
    """Descriptor ``fd`` through a pipe and a reader thread that drops `STRAY_PRINTS`."""
    with contextlib.suppress(AttributeError, ValueError, OSError):  # sys.stdout may be None or closed
        sys.stdout.flush()
    _flush_native_stdout()
    saved = os.dup(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)

    def forward() -> None:
        held = b""  # the start of what may be a stray print that the next read completes
        while chunk := os.read(read_end, 1 << 16):
            chunk = held + chunk
            for stray in STRAY_PRINTS:
                chunk = chunk.replace(stray, b"")
            cut = len(chunk) - _stray_start(chunk)
            chunk, held = chunk[:cut], chunk[cut:]
            if chunk:
                os.write(saved, chunk)
        if held:
            os.write(saved, held)

    reader = threading.Thread(target=forward, name="stray-print-filter", daemon=True)
    reader.start()
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            sys.stdout.flush()
        _flush_native_stdout()
        os.dup2(saved, fd)  # closes the pipe's last write end: the reader sees its end
        reader.join()
        os.close(read_end)
        os.close(saved)


def _stray_start(data: bytes) -> int:
    """Length of the longest tail of ``data`` that a stray print begins with. The C library
    writes a full buffer at a time, which can end in the middle of a line."""
    for k in range(min(len(data), max(map(len, STRAY_PRINTS)) - 1), 0, -1):
        if any(stray.startswith(data[-k:]) for stray in STRAY_PRINTS):
            return k
    return 0


ONE, ZERO = -1, -2  # constant operands of `Builder.add_folded` rows (variable handles are >= 0)


@dataclass
class RawResult:
    status: str
    values: Optional[list[float]]  # one per variable handle, None without a solution
    objective: Optional[float]
    bound: float  # proven lower bound on the objective (-inf when none)


# The relative gap at which a solve stops by default: proven optimal, up to rounding.
EXACT_GAP = 1e-7


class Builder:
    """Interface implemented by the backends below."""

    integer_objective: bool = False

    def bool_var(self) -> int: ...
    def num_var(self, lb: float, ub: float) -> int: ...
    def add(self, terms: Terms, lb: float, ub: float) -> None: ...
    def minimize(self, terms: Terms, offset: float) -> None: ...
    def hint(self, values: dict[int, float]) -> None: ...
    def solve(self, time_limit: Optional[float], threads: Optional[int], gap: float = EXACT_GAP) -> RawResult:
        """Solve within ``time_limit`` seconds; ``gap``: stop once the incumbent is proven within
        this share of the optimum."""
        ...

    def add_folded(self, pos: list[int], neg: list[int], lb: float, ub: float) -> None:
        """``lb <= sum(pos) - sum(neg) <= ub`` where operands may be the constants `ONE`
        and `ZERO` (folded into the bounds). A row left with no variable must hold."""
        terms: dict[int, float] = {}
        const = 0.0
        for h, sign in [(h, 1.0) for h in pos] + [(h, -1.0) for h in neg]:
            if h == ONE:
                const += sign
            elif h != ZERO:
                terms[h] = terms.get(h, 0.0) + sign
        terms = {h: c for h, c in terms.items() if c}
        lo, hi = lb - const, ub - const
        if not terms:
            if lo > 1e-9 or hi < -1e-9:
                raise AssertionError("a row of constants is violated")
            return
        self.add(list(terms.items()), lo, hi)


class CpSatBuilder(Builder):
    integer_objective = True

    def __init__(self) -> None:
        self.model = cp_model.CpModel()
        self.proto = self.model.proto
        self.vars: list[cp_model.IntVar] = []
        self.indices: list[int] = []  # proto index of each handle

    def _new(self, var: cp_model.IntVar) -> int:
        self.vars.append(var)
        self.indices.append(var.index)
        return len(self.vars) - 1

    def bool_var(self) -> int:
        return self._new(self.model.new_bool_var(""))

    def num_var(self, lb: float, ub: float) -> int:
        return self._new(self.model.new_int_var(math.ceil(lb), math.floor(ub), ""))

    def add(self, terms: Terms, lb: float, ub: float) -> None:
        # Straight into the proto: the expression API costs ~10x more per row.
        row = self.proto.constraints.add().linear
        row.vars.extend([self.indices[i] for i, _ in terms])
        row.coeffs.extend([int(c) for _, c in terms])
        row.domain.extend([math.ceil(lb) if lb > -math.inf else -(2**62),
                           math.floor(ub) if ub < math.inf else 2**62])

    def minimize(self, terms: Terms, offset: float) -> None:
        v = self.vars
        self.offset = offset
        self.model.minimize(cp_model.LinearExpr.weighted_sum([v[i] for i, _ in terms], [int(c) for _, c in terms]))

    def hint(self, values: dict[int, float]) -> None:
        for i, value in values.items():
            self.model.add_hint(self.vars[i], int(round(value)))

    def solve(self, time_limit: Optional[float], threads: Optional[int], gap: float = EXACT_GAP) -> RawResult:
        solver = cp_model.CpSolver()
        if gap > EXACT_GAP:  # CP-SAT's own default proves optimality outright
            solver.parameters.relative_gap_limit = gap
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
    """Buffers the model in plain lists and hands it to MathOpt in bulk when
    solving: MathOpt's per-coefficient Python calls cost microseconds each,
    which dominated model building on graphs of a few hundred values."""

    def __init__(self, solver_type: mathopt.SolverType) -> None:
        self.solver_type = solver_type
        self.vars: list[tuple[float, float, bool]] = []  # (lb, ub, integer) per handle
        self.row_bounds: list[tuple[float, float]] = []
        self.coef_rows: list[int] = []
        self.coef_vars: list[int] = []
        self.coef_values: list[float] = []
        self.objective: list[tuple[int, float]] = []
        self.offset = 0.0
        self.hints: list[dict[int, float]] = []

    def bool_var(self) -> int:
        self.vars.append((0.0, 1.0, True))
        return len(self.vars) - 1

    def num_var(self, lb: float, ub: float) -> int:
        self.vars.append((lb, ub, False))
        return len(self.vars) - 1

    def add(self, terms: Terms, lb: float, ub: float) -> None:
        row = len(self.row_bounds)
        self.row_bounds.append((lb, ub))
        for i, c in terms:
            self.coef_rows.append(row)
            self.coef_vars.append(i)
            self.coef_values.append(c)

    def minimize(self, terms: Terms, offset: float) -> None:
        self.objective = list(terms)
        self.offset = offset

    def hint(self, values: dict[int, float]) -> None:
        self.hints.append(dict(values))

    def _model(self) -> tuple[mathopt.Model, list[mathopt.Variable]]:
        model = mathopt.Model(name="checkmate")
        try:
            return model, self._bulk_load(model)
        except (AttributeError, ImportError, TypeError):  # pragma: no cover - older ortools without Elemental
            return self._slow_load(model)

    def _bulk_load(self, model: mathopt.Model) -> list[mathopt.Variable]:
        # Elemental is MathOpt's storage layer; its batched setters take numpy arrays.
        from ortools.math_opt.elemental.python import enums

        e = model._elemental
        n = len(self.vars)
        bounds = np.array([(lb, ub) for lb, ub, _ in self.vars], dtype=np.float64).reshape(n, 2)
        var_ids = e.add_elements(enums.ElementType.VARIABLE, n)
        keys = var_ids.reshape(-1, 1)
        e.set_attrs(enums.DoubleAttr1.VARIABLE_LOWER_BOUND, keys, bounds[:, 0].copy())
        e.set_attrs(enums.DoubleAttr1.VARIABLE_UPPER_BOUND, keys, bounds[:, 1].copy())
        e.set_attrs(enums.BoolAttr1.VARIABLE_INTEGER, keys, np.array([v[2] for v in self.vars], dtype=bool))
        m = len(self.row_bounds)
        rows = np.array(self.row_bounds, dtype=np.float64).reshape(m, 2)
        row_ids = e.add_elements(enums.ElementType.LINEAR_CONSTRAINT, m)
        e.set_attrs(enums.DoubleAttr1.LINEAR_CONSTRAINT_LOWER_BOUND, row_ids.reshape(-1, 1), rows[:, 0].copy())
        e.set_attrs(enums.DoubleAttr1.LINEAR_CONSTRAINT_UPPER_BOUND, row_ids.reshape(-1, 1), rows[:, 1].copy())
        pairs = np.stack([row_ids[np.array(self.coef_rows, dtype=np.int64)],
                          var_ids[np.array(self.coef_vars, dtype=np.int64)]], axis=1)
        e.set_attrs(enums.DoubleAttr2.LINEAR_CONSTRAINT_COEFFICIENT, pairs,
                    np.array(self.coef_values, dtype=np.float64))
        if self.objective:
            obj_vars = var_ids[np.array([i for i, _ in self.objective], dtype=np.int64)].reshape(-1, 1)
            e.set_attrs(enums.DoubleAttr1.OBJECTIVE_LINEAR_COEFFICIENT, obj_vars,
                        np.array([c for _, c in self.objective], dtype=np.float64))
        model.objective.is_maximize = False
        model.objective.offset = self.offset
        return [model.get_variable(int(i), validate=False) for i in var_ids]

    def _slow_load(self, model: mathopt.Model) -> tuple[mathopt.Model, list[mathopt.Variable]]:
        variables = [model.add_variable(lb=lb, ub=ub, is_integer=integer) for lb, ub, integer in self.vars]
        rows = [model.add_linear_constraint(lb=lb, ub=ub) for lb, ub in self.row_bounds]
        for r, i, c in zip(self.coef_rows, self.coef_vars, self.coef_values):
            rows[r].set_coefficient(variables[i], c)
        for i, c in self.objective:
            model.objective.set_linear_coefficient(variables[i], c)
        model.objective.is_maximize = False
        model.objective.offset = self.offset
        return model, variables

    def solve(self, time_limit: Optional[float], threads: Optional[int], gap: float = EXACT_GAP) -> RawResult:
        params = mathopt.SolveParameters(relative_gap_tolerance=gap, absolute_gap_tolerance=1e-9)
        if self.solver_type != mathopt.SolverType.HIGHS:  # HiGHS takes threads only as a global setting
            params.threads = threads or default_threads()
        if time_limit is not None:
            params.time_limit = datetime.timedelta(seconds=max(0.01, float(time_limit)))
        model, variables = self._model()
        hints = [mathopt.SolutionHint(variable_values={variables[i]: float(x) for i, x in h.items()})
                 for h in self.hints]
        model_params = mathopt.ModelSolveParameters(solution_hints=hints) if hints else None
        with _without_stray_prints():
            result = mathopt.solve(model, self.solver_type, params=params, model_params=model_params)
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
        values = [float(values_by_var[x]) for x in variables]
        status = RAW_OPTIMAL if reason == TR.OPTIMAL else RAW_FEASIBLE
        return RawResult(status, values, float(result.objective_value()), bound)


BACKENDS = {
    "cpsat": CpSatBuilder,
    "highs": lambda: MathOptBuilder(mathopt.SolverType.HIGHS),
    "scip": lambda: MathOptBuilder(mathopt.SolverType.GSCIP),
}
