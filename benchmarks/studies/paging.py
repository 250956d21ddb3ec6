"""Parameters paged to host memory: how far below parameters + gradients + AdamW state a step goes, at what time.

Issue #50's benchmark, on the simulated host of a CPU machine (host storages marked, a fetch is a
clone): a parameter-heavy zoo GPT (few tokens, wide blocks) at budgets from the eager step's peak
down to 1/16 of W, the bytes of its parameters, gradients and AdamW state. Side by side, in one
process, interleaved:

* eager: ``loss.backward(); opt.step()`` (its own peak is its budget);
* memplan with every parameter's AdamW state in host memory, updated there (ZeRO-Offload's fixed
  rule: the parameters stay on the device) (``optimizer_state="host", parameters="device"``);
* memplan with every parameter paged (``parameters="host"``, ZeRO-Infinity's fixed rule, though
  the plan keeps a copy from the forward to the backward where it fits instead of fetching twice);
* memplan with the state where the budget needs it, the parameters on the device (``parameters="device"``);
* memplan's default (``parameters="auto"``): the state where the budget needs it, and parameters
  paged, the largest first, only where the step does not fit otherwise.

Every cell: the measured whole-step peak (the dispatch tracker; host storages apart), the step
time over eager's (median of interleaved repetitions), the predicted step time (`Plan.predicted_time`,
the quantity the default compares against the fixed rules), the bytes the plan moves over the
host link per step, each way (`Plan.host_traffic`), and the planning seconds. A "-" where the
planner finds no plan.
Writes ``benchmarks/results/paging.md``.

    python -m benchmarks.studies.paging [--repeats 7] [--time-limit 5] [--divisors 1 2 4 8 16]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch

import memplan
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.steps import peaks_and_interleaved_times, training_step
from memplan.core.units import format_bytes
from memplan.models import zoo

RESULTS = RESULTS_DIR / "paging.md"
CONFIG = {"seq": 8, "d_model": 128, "layers": 6}  # (zoo gpt tiny's vocabulary and heads, batch 1)
MODES = {
    "state on host": {"optimizer_state": "host", "parameters": "device"},
    "every parameter paged": {"parameters": "host"},
    "state as needed": {"parameters": "device"},
    "default (auto)": {},
}


def _adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True)


class _Cell:
    def __init__(self, step: Callable[[], None] | None, plan=None) -> None:
        self.step, self.plan = step, plan
        self.peak = 0
        self.times: list[float] = []


def run(repeats: int, time_limit: float, divisors: list[int]) -> str:
    built = zoo.build("gpt", size="tiny", batch_size=1, overrides=CONFIG)
    base = memplan.WithLoss(built.model, built.loss_fn)
    args, kwargs = tuple(built.example_inputs), dict(built.example_kwargs)
    whole = 4 * sum(p.numel() * p.element_size() for p in base.parameters())
    eager = copy.deepcopy(base)
    cells: dict[tuple[int, str], _Cell] = {(0, "eager"): _Cell(training_step(eager, _adamw(eager), args, kwargs))}
    planning: dict[tuple[int, str], float] = {}
    for divisor in divisors:
        for mode, options in MODES.items():
            module = copy.deepcopy(base)
            optimizer = _adamw(module)
            started = time.perf_counter()
            try:
                planned = memplan.optimize(module, whole // divisor, optimizer=optimizer, example_inputs=args,
                                           example_kwargs=kwargs, time_limit=time_limit, **options)
            except memplan.InfeasibleBudgetError:
                cells[(divisor, mode)] = _Cell(None)
                continue
            planning[(divisor, mode)] = time.perf_counter() - started
            cells[(divisor, mode)] = _Cell(training_step(planned, optimizer, args, kwargs), planned.plan)
    runnable = [c for c in cells.values() if c.step is not None]
    peaks_and_interleaved_times(runnable, repeats)  # (the state exists from the second step on)
    eager_cell = cells[(0, "eager")]
    eager_time = statistics.median(eager_cell.times)
    lines = [
        f"## Paging a parameter-heavy GPT: zoo gpt {CONFIG}, batch 1",
        "",
        f"W = parameters + gradients + AdamW state = {format_bytes(whole)}; eager's measured whole-step peak "
        f"{format_bytes(eager_cell.peak)} ({eager_cell.peak / whole:.2f} W), its step {eager_time * 1e3:.1f} ms.",
        f"Each cell: measured peak (host storages apart) / step time over eager's (median of {repeats} interleaved) /",
        "predicted step time / bytes moved per step to the host and back (predicted: `Plan.host_traffic`) / planning "
        "seconds; the default's paged parameters where it pages some.",
        f"`time_limit={time_limit:g}`; torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU "
        "(host memory simulated: a fetch is a clone).",
        "",
        "| budget | " + " | ".join(MODES) + " |",
        "|---|" + "---|" * len(MODES),
    ]
    for divisor in divisors:
        row = [f"W/{divisor} = {format_bytes(whole // divisor)}"]
        for mode in MODES:
            cell = cells[(divisor, mode)]
            if cell.step is None:
                row.append("-")
                continue
            out, back = cell.plan.host_traffic
            paged = cell.plan.paged_parameters
            some = f" / {len(paged)} of {len(list(base.parameters()))} paged" if paged and mode.startswith("default") else ""
            row.append(f"{format_bytes(cell.peak)} / {statistics.median(cell.times) / eager_time:.2f}x / "
                       f"{cell.plan.predicted_time * 1e3:.2f} ms / {format_bytes(out)} out, {format_bytes(back)} in / "
                       f"{planning[(divisor, mode)]:.1f} s{some}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--divisors", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = "# Parameters paged to host memory\n\n" + run(args.repeats, args.time_limit, args.divisors)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
