"""Same plans before and after a change that must not change them.

A restructuring of `solvers/` or `memplan/` promises identical plans: deterministic
methods give the same costs and peaks on the exported real-model graphs, on
small random training graphs and on every zoo model captured afresh (whose
analysis, eager peak, node count, FLOPs and predicted time must match too), and
"auto" (whose local search runs on the clock) gives costs within a tolerance.
This records them through the public API only (``memplan.analyze``,
``solvers``), so the same script runs on both sides of the change:

    python -m benchmarks.tools.same_plans --save before.json     # on the old tree
    python -m benchmarks.tools.same_plans --compare before.json  # on the new tree
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import solvers
from benchmarks.harness.exported import load
from solvers.core import generators

GRAPHS = ("gpt12", "resnet50", "unet", "gpt48")
FRACTIONS = (0.5, 0.3)
DETERMINISTIC = ("store_all", "recompute_all", "sqrt_n", "greedy", "select", "rotor", "revolve")
SMALL_EXACT = ("checkmate", "exhaustive")
AUTO_LIMIT = {"gpt12": 40.0, "resnet50": 40.0, "unet": 40.0, "gpt48": 90.0}
AUTO_TOLERANCE = 0.01


def _budget(problem: solvers.Problem, fraction: float) -> int:
    """``fraction`` of the way from the memory lower bound to store-all's peak."""
    peak = solvers.METHODS["store_all"](problem, None).peak
    base = solvers.memory_lower_bound(problem)
    return int(base + fraction * (peak - base))


def _small_problems() -> list[tuple[str, solvers.Problem]]:
    out = []
    for seed in range(6):
        G = generators.training_like(14, seed=seed, base=("chain", "layered")[seed % 2], view_prob=0.2)
        p = solvers.Problem.from_networkx(G, budget=0)
        peak = solvers.METHODS["store_all"](p, None).peak
        low = solvers.memory_lower_bound(p)
        out.append((f"random{seed}", p.with_budget(low + (peak - low) // 2)))
    return out


def _zoo_problems() -> list[tuple[str, dict, solvers.Problem]]:
    """Each zoo model at its tiny size, captured and analysed now: its analysis' figures, and its
    Problem at half the way from the memory lower bound to store-all's peak."""
    import memplan
    from memplan.models import zoo

    out = []
    for name in zoo.names():
        m = zoo.build(name, "tiny")
        analysis = memplan.analyze(m.model, m.example_inputs, m.example_kwargs)
        figures = {k: getattr(analysis, k) for k in ("num_nodes", "eager_peak", "graph_peak", "flops", "predicted_time",
                                                       "activation_bytes", "param_bytes")}
        problem = analysis.lowered.problem
        out.append((f"zoo:{name}", figures, problem.with_budget(_budget(problem, 0.5))))
    return out


def _run(problem: solvers.Problem, method: str, limit) -> dict:
    started = time.perf_counter()
    try:
        sol = solvers.METHODS[method](problem, limit)
    except solvers.MethodFailed as e:
        return {"failed": str(e)[:80]}
    return {"cost": sol.cost, "peak": sol.peak, "fits": sol.fits, "seconds": round(time.perf_counter() - started, 2)}


def record(with_auto: bool, graphs: tuple[str, ...] = GRAPHS, small: bool = True, zoo: bool = True) -> dict:
    rows: dict[str, dict] = {}
    for name in graphs:
        problem = load(name)
        for fraction in FRACTIONS:
            p = problem.with_budget(_budget(problem, fraction))
            key = f"{name}@{fraction}"
            rows[key] = {"budget": p.budget, **{m: _run(p, m, None) for m in DETERMINISTIC}}
            if with_auto and not (name == "gpt48" and fraction != 0.5):
                rows[key]["auto"] = _run(p, "auto", AUTO_LIMIT[name])
            print(key, json.dumps(rows[key]), flush=True)
    for key, p in (_small_problems() if small else ()):
        rows[key] = {"budget": p.budget, **{m: _run(p, m, 60.0) for m in DETERMINISTIC + SMALL_EXACT}}
        print(key, json.dumps(rows[key]), flush=True)
    for key, figures, p in (_zoo_problems() if zoo else ()):
        rows[key] = {"budget": p.budget, "analysis": figures, **{m: _run(p, m, None) for m in DETERMINISTIC}}
        print(key, json.dumps(rows[key]), flush=True)
    return rows


def compare(before: dict, after: dict) -> list[str]:
    """Differences: deterministic methods must match exactly, "auto" within `AUTO_TOLERANCE`."""
    problems = []
    for key, row in before.items():
        for method, old in row.items():
            if method in ("budget",):
                continue
            new = after.get(key, {}).get(method)
            if method == "auto":
                ratio = new["cost"] / old["cost"] if new and "cost" in new else float("inf")
                line = f"{key} auto: {old.get('cost')} -> {new and new.get('cost')} ({ratio:.4f})"
                print(line)
                if abs(ratio - 1) > AUTO_TOLERANCE:
                    problems.append(line)
            elif {k: v for k, v in (new or {}).items() if k != "seconds"} != {k: v for k, v in old.items() if k != "seconds"}:
                problems.append(f"{key} {method}: {old} -> {new}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path)
    parser.add_argument("--compare", type=Path)
    parser.add_argument("--no-auto", action="store_true")
    parser.add_argument("--only-zoo", action="store_true", help="the zoo models alone (what a memplan change can move)")
    args = parser.parse_args()
    rows = record(with_auto=not args.no_auto, graphs=() if args.only_zoo else GRAPHS, small=not args.only_zoo)
    if args.save:
        args.save.write_text(json.dumps(rows, indent=1))
    if args.compare:
        problems = compare(json.loads(args.compare.read_text()), rows)
        print("\n".join(problems) or "same plans")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
