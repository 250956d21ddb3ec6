"""``make demo``: plan the built-in default model well under its eager peak, run it, measure it.

Run as ``python -m memplan.tools.demo [--model gpt] [--size small] [--fraction 0.5]``.
"""
from __future__ import annotations

import argparse
import copy
import gc
import time

import torch
from rich.console import Console
from rich.table import Table

import memplan
from memplan.measure.tracker import measure_peak
from memplan.models import zoo
from memplan.core.units import format_bytes


def _step(module, args, kwargs):
    def run():
        module(*args, **kwargs).backward()

    return run


def _clear(module):
    for p in module.parameters():
        p.grad = None
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt", choices=zoo.names())
    parser.add_argument("--size", default="small")
    parser.add_argument("--fraction", type=float, default=0.6, help="budget as a fraction of the eager peak")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--time-limit", type=float, default=30.0)
    args = parser.parse_args(argv)
    console = Console()

    zm = zoo.build(args.model, size=args.size)
    step_module = memplan.WithLoss(zm.model, zm.loss_fn)
    inputs, kwargs = tuple(zm.example_inputs), dict(zm.example_kwargs)
    reference = copy.deepcopy(step_module)

    with console.status(f"capturing {args.model}/{args.size} on fake tensors"):
        analysis = memplan.analyze(step_module, inputs, kwargs)
    budget = int(analysis.eager_peak * args.fraction)
    console.print(
        f"[bold]{zm.description}[/]: {analysis.num_nodes} ATen ops, parameters {format_bytes(analysis.param_bytes)}, "
        f"eager peak {format_bytes(analysis.eager_peak)} (predicted) -> budget {format_bytes(budget)}"
    )
    def plan(b: int):
        with console.status(f"solving for {format_bytes(b)} with {args.solver}"):
            return memplan.optimize(
                step_module, b, example_inputs=inputs, example_kwargs=kwargs, solver=args.solver, time_limit=args.time_limit
            )

    try:
        opt = plan(budget)
    except memplan.InfeasibleBudgetError as err:
        console.print(f"[yellow]{err}[/]; planning at that minimum instead")
        budget = err.min_budget
        opt = plan(budget)
    console.print(opt.plan.report())

    torch.manual_seed(0)
    _clear(step_module)
    t0 = time.perf_counter()
    planned_peak = measure_peak(_step(opt, inputs, kwargs))
    planned_time = time.perf_counter() - t0
    planned_grads = {n: p.grad.clone() for n, p in step_module.named_parameters() if p.grad is not None}
    _clear(step_module)
    torch.manual_seed(0)
    _clear(reference)
    t0 = time.perf_counter()
    eager_peak = measure_peak(_step(reference, inputs, kwargs))
    eager_time = time.perf_counter() - t0
    max_err = max(
        (planned_grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters() if p.grad is not None
    )

    table = Table(title="measured, one training step")
    for col in ("", "peak", "vs budget", "step time (with tracker)"):
        table.add_column(col, justify="right")
    table.add_row("eager", format_bytes(eager_peak), f"{eager_peak / budget:.0%}", f"{eager_time * 1e3:.0f} ms")
    table.add_row("memplan", format_bytes(planned_peak), f"{planned_peak / budget:.0%}", f"{planned_time * 1e3:.0f} ms")
    console.print(table)
    ok = planned_peak <= budget
    console.print(
        f"budget {format_bytes(budget)}: measured planned peak {format_bytes(planned_peak)} "
        f"({'[green]within budget[/]' if ok else '[red]OVER BUDGET[/]'}), "
        f"predicted {format_bytes(opt.plan.predicted_peak)}; max |grad - eager grad| = {max_err:.2e}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
