"""Benchmark the solvers on training-like graphs.

    .venv/bin/python -m benchmarks.studies.solvers_bench [--quick] [--time-limit 60]

For every method, on joint forward+backward graphs of 50, 100, 200 and 500
values (``solvers.core.generators.training_like``) at 70% and 50% of store_all's
peak, report solve time, cost, lower bound and gap. Writes a Markdown table
to benchmarks/results/solvers.md and prints it.
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from benchmarks.harness.paths import RESULTS_DIR
from solvers import (
    METHODS,
    Infeasible,
    MethodFailed,
    Problem,
    min_budget,
    solve,
    validate,
)
from solvers.core import generators as gen

SIZES = (50, 100, 200, 500)
FRACTIONS = (0.7, 0.5)
METHOD_NAMES = ("store_all", "recompute_all", "sqrt_n", "greedy", "checkmate_highs", "checkmate_cpsat")
BACKENDS = ("checkmate_highs", "checkmate_cpsat", "checkmate_scip")
RESULTS = RESULTS_DIR / "solvers.md"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def run(sizes, fractions, methods, time_limit: float, seed: int) -> list[str]:
    rows = []
    for n in sizes:
        p = Problem.from_networkx(gen.training_like(n, seed=seed), 2**62)
        peak = solve(p, "store_all").peak
        need, _ = min_budget(p)
        for frac in fractions:
            budget = int(peak * frac)
            q = p.with_budget(budget)
            print(f"-- {p.n} values ({p.n_compute} to compute), budget {budget} = {frac:.0%} of {peak}, "
                  f"min found {need}", flush=True)
            for method in methods:
                started = time.perf_counter()
                try:
                    sol = solve(q, method, time_limit=time_limit)
                except Infeasible as e:
                    rows.append(f"| {p.n} | {frac:.0%} | {method} | {time.perf_counter() - started:.2f} | infeasible "
                                f"(min {e.min_budget}) | - | - | - | - |")
                    continue
                except MethodFailed as e:
                    rows.append(f"| {p.n} | {frac:.0%} | {method} | {time.perf_counter() - started:.2f} | failed: {e} "
                                f"| - | - | - | - |")
                    continue
                if sol.fits:
                    validate(q, sol.schedule)
                note = sol.status
                if "fallback" in sol.info:
                    note += f" (MILP {sol.info['milp_status']}, schedule from {sol.info['fallback']})"
                gap = None if sol.gap is None else 100 * sol.gap
                row = (f"| {p.n} | {frac:.0%} | {method} | {sol.solve_time:.2f} | {note} | {_fmt(sol.cost)} | "
                       f"{_fmt(sol.lower_bound)} | {_fmt(gap)}% | {sol.peak} |")
                rows.append(row)
                print(row, flush=True)
    return rows


def backend_rows(time_limit: float, seed: int) -> list[str]:
    """The three MILP backends on the same small graphs: time to a proven optimum."""
    cases = [("training chain", lambda: gen.training_like(30, seed=seed)),
             ("training chain", lambda: gen.training_like(40, seed=seed + 1)),
             ("training layered", lambda: gen.training_like(40, seed=seed, base="layered")),
             ("unet", lambda: gen.unet(4, seed=seed)),
             ("transformer", lambda: gen.transformer(2, seed=seed))]
    rows = []
    for label, make in cases:
        p = Problem.from_networkx(make(), 2**62)
        peak = solve(p, "store_all").peak
        need, _ = min_budget(p)
        budget = (need + peak) // 2
        q = p.with_budget(budget)
        cells = []
        for method in BACKENDS:
            sol = solve(q, method, time_limit=time_limit)
            status = sol.info.get("milp_status", sol.status)
            cells.append(f"{sol.solve_time:.2f} s, {status}, cost {sol.cost:.2f}, bound {_fmt(sol.lower_bound, 2)}")
        row = f"| {label} | {p.n_compute} | {budget} (min {need}, peak {peak}) | " + " | ".join(cells) + " |"
        print(row, flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="50 and 100 values only, 10 s time limit")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per solve (default 60; quick: 10)")
    ap.add_argument("--methods", default=",".join(METHOD_NAMES), help="comma-separated method names")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--backend-time-limit", type=float, default=20.0,
                    help="seconds per solve in the MILP backend comparison (0: skip it)")
    args = ap.parse_args(argv)
    sizes = SIZES[:2] if args.quick else SIZES
    limit = args.time_limit if args.time_limit is not None else (10.0 if args.quick else 60.0)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m}")
    backend_limit = 0.0 if args.quick else args.backend_time_limit
    backends = backend_rows(backend_limit, args.seed) if backend_limit > 0 else []
    rows = run(sizes, FRACTIONS, methods, limit, args.seed)
    header = [
        "# solvers benchmark",
        "",
        f"Training-like graphs (`solvers.core.generators.training_like`, seed {args.seed}); budget = fraction of "
        f"store_all's peak; time limit {limit:g} s per solve (model building included); "
        f"machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}.",
        "Cost = total compute time of the schedule (store_all's cost is the minimum); lower bound = the method's "
        "proven bound (baselines: sum of costs); gap = (cost - bound) / cost.",
        "",
        "| values | budget | method | time (s) | status | cost | lower bound | gap | peak |",
        "|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    if backends:
        header_b = [
            "",
            "## MILP backends (Checkmate formulation, same graphs)",
            "",
            f"Budget halfway between the minimum found and store_all's peak; {backend_limit:g} s limit; "
            "threads = min(8, cores) for CP-SAT and SCIP (HiGHS runs its default).",
            "",
            "| graph | values to compute | budget | " + " | ".join(BACKENDS) + " |",
            "|---|---:|---|" + "---|" * len(BACKENDS),
        ]
        rows = rows + header_b + backends
    table = "\n".join(header + rows) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print()
    print(table)


if __name__ == "__main__":
    main()
