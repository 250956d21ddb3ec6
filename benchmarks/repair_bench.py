"""Repair over-budget schedules by recomputation (`solvers.transforms.repair`) on the real graphs.

For each graph at each budget fraction, rotor's schedule and the hierarchical
solver's are repaired when they do not fit; prints peak/budget and
cost/total (sum of all costs) before and after, and the repair's time.

    PYTHONPATH=. python benchmarks/repair_bench.py [--graphs gpt12 unet] [--fraction 0.3]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Optional

from benchmarks.scale_bench import load, with_fraction
from solvers import METHODS, Problem, Schedule, simulate, validate
from solvers.strategies.hierarchical import solve_hierarchical
from solvers.transforms.repair import add_recomputations

PLANNERS: dict[str, Callable[[Problem], Schedule]] = {
    "rotor": lambda p: METHODS["rotor"](p, 20).schedule,
    "hierarchical": lambda p: solve_hierarchical(p, 30).schedule,
}


def _describe(p: Problem, schedule: Schedule) -> str:
    r = simulate(p, schedule)
    return f"peak/budget {r.peak / p.budget:.5f}  cost/total {r.cost / p.total_cost():.4f}  fits {r.fits}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", default=["gpt12", "unet"])
    parser.add_argument("--fraction", type=float, default=0.3)
    args = parser.parse_args(argv)
    for name in args.graphs:
        p = with_fraction(load(name), args.fraction)
        for planner, plan in PLANNERS.items():
            base = plan(p)
            print(f"{name} {args.fraction:.0%} {planner:12s} planned:  {_describe(p, base)}", flush=True)
            if simulate(p, base).fits:
                continue
            started = time.perf_counter()
            repaired = add_recomputations(p, base)
            took = time.perf_counter() - started
            if simulate(p, repaired).fits:
                validate(p, repaired)
            print(f"{name} {args.fraction:.0%} {planner:12s} repaired: {_describe(p, repaired)}  ({took:.2f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
