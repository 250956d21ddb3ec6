"""Predicted step-time overhead against measured, with the roofline and with ``profile=True``.

A plan's ``predicted_overhead`` is its step time over the store-all plan's, as the cost model
sees them: the roofline of `memplan.costs` by default, or every op timed on the device with
``profile=True``. Here, for zoo models at a share of eager's measured peak, the two plans (one
per cost model) and the store-all plan run side by side with eager in one process (interleaved
rounds, one thread), and each plan's predicted overhead is set against its measured time over
store-all's and over eager's (median of the per-round ratios). Writes
``benchmarks/results/time_prediction.md``.

    python -m benchmarks.studies.time_prediction [--models gpt,vit,resnet50] [--size small] [--fraction 0.5]
                                         [--rounds 7] [--time-limit 15]
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch

import memplan
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.report import markdown_table, spread
from benchmarks.harness.zoo_options import zoo_arguments
from memplan.measure.tracker import measure_peak
from memplan.models import zoo

RESULTS = RESULTS_DIR / "time_prediction.md"


def compare(name: str, size: str, fraction: float, rounds: int, time_limit: float) -> list[dict]:
    torch.manual_seed(0)
    zm = zoo.build(name, size=size)
    model = memplan.WithLoss(zm.model, zm.loss_fn)
    args, kwargs = tuple(zm.example_inputs), dict(zm.example_kwargs)

    def run(step) -> float:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        start = time.perf_counter()
        step(*args, **kwargs).backward()
        return time.perf_counter() - start

    eager_peak = measure_peak(lambda: run(model), resident=[*model.parameters(), *args])
    budget = int(fraction * eager_peak)
    plans = {}
    for label, profile in (("roofline", False), ("profile=True", True)):
        started = time.perf_counter()
        opt = memplan.optimize(model, budget, example_inputs=args, example_kwargs=kwargs, profile=profile,
                               time_limit=time_limit)
        plans[label] = (opt, time.perf_counter() - started)
    store_all = memplan.optimize(model, 10**15, example_inputs=args, example_kwargs=kwargs, solver="store_all")
    steps = {"eager": model, "store-all": store_all, **{k: v[0] for k, v in plans.items()}}
    for step in steps.values():  # warm up
        run(step)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            times[key].append(run(step))
    rows = []
    for label, (opt, plan_s) in plans.items():
        over_store = [t / s for t, s in zip(times[label], times["store-all"])]
        over_eager = [t / e for t, e in zip(times[label], times["eager"])]
        rows.append({
            "model": name, "cost model": label, "budget": budget, "predicted_peak": opt.plan.predicted_peak,
            "predicted": opt.plan.predicted_overhead,
            "over_store_all": statistics.median(over_store), "store_spread": (min(over_store), max(over_store)),
            "over_eager": statistics.median(over_eager), "eager_spread": (min(over_eager), max(over_eager)),
            "plan_s": plan_s,
            "store_all_over_eager": statistics.median(s / e for s, e in zip(times["store-all"], times["eager"])),
            "eager_ms": statistics.median(times["eager"]) * 1e3,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ns = zoo_arguments(__doc__, "gpt,vit,resnet50", 0.5, 7, RESULTS).parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = []
    for name in ns.models.split(","):
        for row in compare(name, ns.size, ns.fraction, ns.rounds, ns.time_limit):
            rows.append(row)
            print(row, flush=True)
    lines = [
        f"# Predicted step-time overhead against measured, at {ns.fraction:.0%} of eager's peak",
        "",
        f"Zoo models at size {ns.size}; {ns.rounds} interleaved rounds (eager, store-all plan, the two plans), "
        "one thread; ratios are medians of per-round ratios, spreads min-max. `predicted` is the plan's "
        "`predicted_overhead` (its time over the store-all plan's, in the cost model); it is made to match "
        "the measured time over store-all's, and the time over eager's adds the runtime's own overhead "
        "(store-all over eager).",
        "",
    ]
    header = ("model", "cost model", "budget", "predicted", "measured / store-all", "off by", "measured / eager",
              "off by", "store-all / eager", "eager step", "plan s")
    lines.append(markdown_table(header, [[
        r["model"], r["cost model"], str(r["budget"]), f"{r['predicted']:.3f}x",
        f"{r['over_store_all']:.3f}x ({spread(r['store_spread'])})", f"{r['over_store_all'] - r['predicted']:+.3f}",
        f"{r['over_eager']:.3f}x ({spread(r['eager_spread'])})", f"{r['over_eager'] - r['predicted']:+.3f}",
        f"{r['store_all_over_eager']:.3f}x", f"{r['eager_ms']:.0f} ms", f"{r['plan_s']:.1f}"] for r in rows]))
    ns.out.parent.mkdir(exist_ok=True)
    ns.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
