"""Step time of memplan's runtime against eager, and against its own prediction.

For one zoo model: plan at the store-all peak (the runtime's own overhead:
it should cost nothing) and at fractions of it (does the measured slowdown
match ``plan.predicted_overhead``?). Every timing is the median over
interleaved repetitions in one process, reported as a ratio to eager.

    python -m benchmarks.studies.optimize_speed --model gpt --size small --fractions 1.0,0.5
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

import memplan
from benchmarks.harness.paths import RESULTS_DIR
from memplan.measure.tracker import measure_peak
from memplan.models import zoo


def _timed_step(module, args, kwargs) -> float:
    for p in module.parameters():
        p.grad = None
    start = time.perf_counter()
    module(*args, **kwargs).backward()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(model: str, size: str, fractions: list[float], repeats: int, solver: str, time_limit: float, profile: bool) -> str:
    zm = zoo.build(model, size=size)
    step = memplan.WithLoss(zm.model, zm.loss_fn)
    args, kwargs = tuple(zm.example_inputs), dict(zm.example_kwargs)
    eager = copy.deepcopy(step)
    store_all_peak = memplan.analyze(step, args, kwargs).graph_peak
    rows = []
    for fraction in fractions:
        budget = int(store_all_peak * fraction)
        planned = copy.deepcopy(step)
        t0 = time.perf_counter()
        try:
            opt = memplan.optimize(
                planned, budget, example_inputs=args, example_kwargs=kwargs, solver=solver, time_limit=time_limit, profile=profile
            )
        except memplan.InfeasibleBudgetError as exc:
            rows.append(f"| {fraction:.0%} | {budget} | infeasible (min {exc.min_budget}) | | | | |")
            continue
        plan_time = time.perf_counter() - t0
        peak = measure_peak(lambda: opt(*args, **kwargs).backward())
        for _ in range(2):  # warm-up both
            _timed_step(opt, args, kwargs)
            _timed_step(eager, args, kwargs)
        ratios = []
        for _ in range(repeats):
            t_opt = _timed_step(opt, args, kwargs)
            t_eager = _timed_step(eager, args, kwargs)
            ratios.append(t_opt / t_eager)
        measured = statistics.median(ratios)
        predicted = opt.plan.predicted_overhead
        rows.append(
            f"| {fraction:.0%} | {budget} | {peak} | {opt.plan.method} | {plan_time:.1f} s | {measured:.3f} | {predicted:.3f} |"
        )
    header = (
        f"## {model}/{size}: step time vs eager ({repeats} interleaved repetitions, median ratio)\n\n"
        "| budget (of store-all peak) | budget B | measured peak B | method | plan time | measured time / eager | predicted overhead |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--fractions", default="1.0,0.7,0.5")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--no-profile", action="store_true", help="use the roofline instead of timing every op")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable ratios on a shared machine)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "optimize_speed.md")
    a = parser.parse_args(argv)
    torch.set_num_threads(a.threads)
    table = run(a.model, a.size, [float(f) for f in a.fractions.split(",")], a.repeats, a.solver, a.time_limit, not a.no_profile)
    print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)


if __name__ == "__main__":
    main()
