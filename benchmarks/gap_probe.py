"""Where the optimum of one scale_bench instance lies: the bound side and the plan side, given time.

    .venv/bin/python -m benchmarks.gap_probe [--graph unet] [--fraction 0.3]
        [--moments 57,142,160,191,216,247,278,353,381] [--milp-time 300]
        [--plan-time 20] [--pin-time 400] [--seed 7]

`scale_bench` asks "auto" for a plan and a bound within the graph's time target. When the gap stays
above the target (unet at 30%), this probe says which side is short, with no time limit that matters:

* bound side: the interval model of `solvers.methods.lower_bounds` over the given moments (values of the
  problem's order; default: the moments auto's bound picks), as a MILP run to closure or
  ``--milp-time``; a closed MILP is that model's integer optimum, so more time cannot raise it, only
  other moments can;
* plan side: "auto" with ``--plan-time``, then `solvers.transforms.pin_search` from its plan for
  ``--pin-time`` seconds with ``--seed``.

It prints both, as multiples of the sum of costs, and the interval the optimum lies in.
"""
from __future__ import annotations

import argparse
import time
from typing import Optional

from benchmarks.scale_bench import load, with_fraction
from solvers.core.schedule import simulate
from solvers.methods import lower_bounds
from solvers.strategies.auto import solve_auto
from solvers.transforms.pin_search import pin_search


def default_moments(problem, ctx) -> list[int]:
    """The moments auto's interval run starts from (`lower_bounds.interval_moments`), before pruning."""
    by_node = {m.node: m for m in lower_bounds.moments(problem, ctx=ctx)}
    return lower_bounds.interval_moments(lower_bounds.main_chain(problem, ctx), by_node,
                                         lower_bounds.INTERVAL_MOMENTS)


def main(argv: Optional[list[str]] = None) -> tuple[float, float]:
    """Run the probe; returns the interval (lowest bound, cheapest plan) as multiples of the sum of costs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", default="unet")
    ap.add_argument("--fraction", type=float, default=0.3)
    ap.add_argument("--moments", default=None, help="comma-separated value indices (default: auto's)")
    ap.add_argument("--milp-time", type=float, default=300.0)
    ap.add_argument("--plan-time", type=float, default=20.0)
    ap.add_argument("--pin-time", type=float, default=400.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    problem = with_fraction(load(args.graph), args.fraction)
    total = problem.total_cost()
    ctx = lower_bounds.BoundContext(problem)  # reachability bit sets: built once, shared by every call below
    ws = [int(w) for w in args.moments.split(",")] if args.moments else default_moments(problem, ctx)

    started = time.perf_counter()
    lp = total + lower_bounds.interval_bound(problem, ctx, ws, None, integer=False)
    print(f"interval model, {len(ws)} moments {ws}", flush=True)
    print(f"  LP {lp / total:.4f} ({time.perf_counter() - started:.1f} s)", flush=True)
    started = time.perf_counter()
    milp = total + lower_bounds.interval_bound(problem, ctx, ws, args.milp_time)
    took = time.perf_counter() - started
    print(f"  MILP dual bound {milp / total:.4f} ({took:.1f} s{', closed' if took < args.milp_time * 0.98 else ''})",
          flush=True)

    started = time.perf_counter()
    sol = solve_auto(problem, args.plan_time)
    print(f"auto, {args.plan_time:g} s: {sol.cost / total:.4f} ({sol.info.get('chosen')}), "
          f"its bound {sol.lower_bound / total:.4f}", flush=True)
    pinned = pin_search(problem, sol.schedule, time.perf_counter() + args.pin_time, seed=args.seed)
    result = simulate(problem, pinned)
    assert result.fits
    print(f"pin_search, {args.pin_time:g} s more, seed {args.seed}: {result.cost / total:.4f}", flush=True)
    low, high = max(milp, sol.lower_bound), result.cost
    print(f"optimum in [{low / total:.4f}, {high / total:.4f}]: a plan at the top needs a bound of "
          f"{0.97 * high / total:.4f} for a 3% gap; a bound at the bottom needs a plan of {low / 0.97 / total:.4f}")
    return low / total, high / total


if __name__ == "__main__":
    main()
