"""The whole training step with AdamW: the lowest budget each way of training meets, and its time.

A step here is forward, backward and the optimizer's update; its peak is
measured from the start of forward to the end of the last update
(`memplan.measure_peak`), the optimizer's state included. Side by side, in
one process, on one zoo model:

* eager: ``loss.backward(); opt.step()``;
* checkpoint per block, then ``opt.step()``;
* memplan planning the activations only (``optimize(model, budget)``), then
  ``opt.step()`` outside the plan;
* memplan with ``optimizer=``, every update after backward;
* memplan with ``optimizer=``, each update in backward as soon as its
  gradient is final (the default);
* the same with the optimizer state in host memory (``optimizer_state="host"``),
  each update computed there.

For the memplan rows the budget is the smallest the planner finds
(`memplan.min_budget`); every row reports the measured whole-step peak
at it, and the step time over eager's (median of interleaved repetitions,
with the spread). Writes ``benchmarks/results/whole_step.md``.

    python -m benchmarks.studies.whole_step [--model gpt] [--size tiny] [--repeats 7] [--batches 16 1]
"""
from __future__ import annotations

import argparse
import copy
import statistics
from typing import Callable

import torch

import memplan
from benchmarks.harness.checkpointing import checkpoint_blocks
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.steps import peaks_and_interleaved_times, training_step
from benchmarks.models.layouts import layout_for
from memplan.models import zoo
from memplan.core.units import format_bytes
from memplan.pipeline.sweep import min_budget

RESULTS = RESULTS_DIR / "whole_step.md"


def _adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True)


class _Row:
    """One way of training: a step function, its optimizer, the budget it was given."""

    def __init__(self, name: str, step: Callable[[], None], budget: int | None, detail: str) -> None:
        self.name, self.step, self.budget, self.detail = name, step, budget, detail
        self.peak = 0
        self.times: list[float] = []


def _planned_at_smallest(module, args, kwargs, **options) -> tuple[int, memplan.OptimizedModule]:
    """The step planned at the smallest budget memplan finds for it (`memplan.min_budget`), or
    in steps of 2% above it where the solver, in its time limit, finds no plan there (the search
    for the minimum is not a proof, nor is the solve)."""
    probe = memplan.optimize(module, 10**15, solver="store_all", example_inputs=args, example_kwargs=kwargs, **options)
    budget = min_budget(probe.plan.analysis)
    while True:
        try:
            planned = memplan.optimize(module, budget, time_limit=20, example_inputs=args, example_kwargs=kwargs,
                                       **options)
            return budget, planned
        except memplan.InfeasibleBudgetError:
            budget = int(budget * 1.02)


def run(model_name: str, size: str, repeats: int, batch: int = 16) -> str:
    built = zoo.build(model_name, size=size, batch_size=batch)
    base = memplan.WithLoss(built.model, built.loss_fn)
    args, kwargs = tuple(built.example_inputs), dict(built.example_kwargs)
    rows: list[_Row] = []

    eager = copy.deepcopy(base)
    rows.append(_Row("eager", training_step(eager, _adamw(eager), args, kwargs), None, "torch autograd + AdamW"))

    ckpt = copy.deepcopy(base)
    blocks = checkpoint_blocks(ckpt.model, layout_for(model_name, ckpt.model))
    rows.append(_Row("checkpoint per block", training_step(ckpt, _adamw(ckpt), args, kwargs), None,
                     f"{blocks} blocks + AdamW"))

    alone = copy.deepcopy(base)
    budget, planned = _planned_at_smallest(alone, args, kwargs)
    rows.append(_Row("memplan, activations only", training_step(planned, _adamw(alone), args, kwargs), budget,
                     "optimizer.step() outside the plan"))

    held_at_once = 0  # parameters + gradients + Adam state: what eager holds at its update
    for after, state in ((True, "device"), (False, "device"), (False, "host")):
        module = copy.deepcopy(base)
        optimizer = _adamw(module)
        options = dict(optimizer=optimizer, updates_after_backward=after, optimizer_state=state)
        budget, planned = _planned_at_smallest(module, args, kwargs, **options)
        plan = planned.plan
        analysis = plan.analysis
        held_at_once = 2 * analysis.param_bytes + analysis.all_optimizer_state_bytes
        mode = "after backward" if analysis.lowered.updates_after_backward else "in backward"
        where = (f"state in host memory ({format_bytes(analysis.host_optimizer_state_bytes)})"
                 if state == "host" else "state on the device")
        rows.append(_Row(f"memplan optimizer=, {'after' if after else 'in'} backward, state on {state}",
                         training_step(planned, optimizer, args, kwargs), budget,
                         f"{mode}, {where}, predicted {format_bytes(plan.predicted_peak)}"))

    peaks_and_interleaved_times(rows, repeats)  # (the state exists from the second step on)
    eager_time = statistics.median(rows[0].times)
    eager_peak = rows[0].peak
    lines = [
        f"## The whole step with AdamW: {model_name} ({size}), batch {batch}",
        "",
        "Peak: measured from the start of forward to the end of the last update, optimizer state included",
        "(on the device; state in host memory is counted apart, as the CPU tracker marks host storages).",
        f"Parameters + gradients + AdamW state, all of which eager holds at its update: {format_bytes(held_at_once)}.",
        f"Time: median of {repeats} interleaved steps over eager's median (spread: min-max over eager's median);",
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU.",
        "",
        "| method | budget given | measured peak | of eager's | step time | spread | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = statistics.median(row.times) / eager_time
        spread = f"{min(row.times) / eager_time:.2f}-{max(row.times) / eager_time:.2f}"
        budget = format_bytes(row.budget) if row.budget is not None else "-"
        lines.append(f"| {row.name} | {budget} | {format_bytes(row.peak)} | {row.peak / eager_peak:.0%} | "
                     f"{ratio:.2f}x | {spread} | {row.detail} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 1],
                        help="one table per batch size (at 1, parameters and optimizer state dominate the step)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tables = [run(args.model, args.size, args.repeats, batch) for batch in args.batches]
    text = "# The whole training step with AdamW, side by side\n\n" + "\n".join(tables)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
