"""Markdown tables and JSON from :class:`~benchmarks.harness.runner.ModelResult`.

* :func:`model_table`: one row per (budget, method), the full detail.
* :func:`speed_table`: one model, one row per method: the lowest budget met
  and the step-time ratio (with its spread over rounds) at every budget.
* :func:`summary_table`: one row per model, one column per method: the
  lowest budget the method met and its step-time ratio at the 50% budget.
* :func:`minimum_table`: each method's own minimum, as a share of eager's peak.
* :func:`readme_summary`: what the project README shows: the summary table alone, with
  links to the per-model files and to the full report in the results folder.

:func:`to_json` and :func:`from_json` write and read ``results.json``, so the
Markdown can be regenerated from a finished run (``python -m benchmarks --from-results``).
"""
from __future__ import annotations

import json
from typing import Any

from benchmarks.harness.config import ModelSpec
from benchmarks.harness.core import Candidate, Cell
from benchmarks.harness.methods import OWN_MIN
from benchmarks.harness.runner import ModelResult
from benchmarks.harness.steps import GradCheck

COLUMNS = (
    "budget",
    "method",
    "configuration",
    "measured peak (MB)",
    "% of eager peak",
    "met budget",
    "time × eager",
    "round spread",
    "plan s",
    "compile s",
    "grads vs eager",
    "note",
)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def markdown_table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the header, its rule, a line per row of cells."""
    lines = [_row(list(header)), _row(["---"] * len(header))]
    lines += [_row(r) for r in rows]
    return "\n".join(lines)


def spread(pair: tuple[float, float]) -> str:
    """A min-max spread of ratios, as the tables print it."""
    return f"{pair[0]:.2f}-{pair[1]:.2f}"


def met_text(cell: Cell) -> str:
    if cell.status == "n/a":
        return "n/a"
    if cell.status in ("infeasible", "error"):
        return f"no ({cell.status})"
    if cell.met is None:
        return "—"
    return "yes" if cell.met else "NO"


def _budget_text(cell: Cell, eager_peak: int) -> str:
    if cell.budget_label != OWN_MIN:
        return f"{cell.budget_label} ({cell.budget / 1e6:.1f} MB)" if cell.budget else cell.budget_label
    if cell.budget is None:
        return OWN_MIN
    return f"{OWN_MIN} ({cell.budget / 1e6:.1f} MB, {cell.budget / eager_peak:.0%})"


def spread_text(cand: Candidate) -> str:
    """The smallest and largest per-round ratio, e.g. "0.97–1.08"."""
    if cand.ratio_spread is None:
        return "—"
    lo, hi = cand.ratio_spread
    return f"{lo:.2f}–{hi:.2f}"


def cell_row(cell: Cell, eager_peak: int) -> list[str]:
    cand = cell.candidate
    if cand is None:
        dashes = ["—"] * (len(COLUMNS) - 7)
        return [_budget_text(cell, eager_peak), cell.method, "—", "—", "—", met_text(cell), *dashes, cell.note]
    note = "; ".join(x for x in (cand.note, cell.note) if x)
    return [
        _budget_text(cell, eager_peak),
        cell.method,
        cand.label,
        f"{cand.peak / 1e6:.1f}" if cand.peak is not None else "—",
        f"{cand.peak / eager_peak:.0%}" if cand.peak is not None else "—",
        met_text(cell),
        f"{cand.time_ratio:.2f}" if cand.time_ratio is not None else "—",
        spread_text(cand),
        f"{cand.plan_s:.1f}",
        f"{cand.compile_s:.1f}" if cand.compile_s is not None else "—",
        cand.grads.cell() if cand.grads else "—",
        note,
    ]


def model_table(res: ModelResult) -> str:
    order = [label for label, _ in res.budgets] + [OWN_MIN]
    rows = []
    for label in order:
        for method in res.methods:
            cell = res.cell(label, method)
            if cell is not None:
                rows.append(cell_row(cell, res.eager_peak))
    return markdown_table(COLUMNS, rows)


def _eager_line(res: ModelResult) -> str:
    profiled = ""
    if res.eager_profiled_peak is not None:
        profiled = (
            f" (profiler, the measurement of the compiled rows: {res.eager_profiled_peak / 1e6:.1f} MB, "
            f"{res.eager_profiled_peak - res.eager_peak:+,} bytes)"
        )
    return (
        f"{res.description}. Eager step: measured peak {res.eager_peak / 1e6:.1f} MB{profiled}, "
        f"{res.eager_time_s:.3f} s (median). Model runtime in the harness: {res.runtime_s:.0f} s."
    )


def model_section(res: ModelResult) -> str:
    return f"### {res.spec.label}\n\n{_eager_line(res)}\n\n{model_table(res)}\n"


def _met_correctly(cell: Cell | None) -> bool:
    return bool(cell and cell.met and cell.candidate and cell.candidate.grads and cell.candidate.grads.ok)


def lowest_met(res: ModelResult, method: str) -> str:
    """The smallest budget of the grid the method met with eager's gradients, e.g. "35%"; "none" if none."""
    met = [(b, label) for label, b in res.budgets if _met_correctly(res.cell(label, method))]
    if not met:
        cell = res.cell(res.budgets[0][0], method)
        return "n/a" if cell is not None and cell.status == "n/a" else "none"
    return min(met)[1]


def ratio_at(res: ModelResult, method: str, label: str = "50%", spread: bool = False) -> str:
    """The time ratio of ``method`` at budget ``label`` (optionally with its spread); "—" if not met."""
    cell = res.cell(label, method)
    if cell is None or cell.status == "n/a":
        return "n/a"
    if not cell.met or cell.candidate is None or cell.candidate.time_ratio is None:
        return "—"
    grads = "" if cell.candidate.grads is None or cell.candidate.grads.ok else " (grads FAIL)"
    rng = f" ({spread_text(cell.candidate)})" if spread else ""
    return f"{cell.candidate.time_ratio:.2f}×{rng}{grads}"


def speed_table(res: ModelResult) -> str:
    """One row per method: the lowest budget met, then the time ratio (min–max over rounds) per budget."""
    labels = [label for label, _ in res.budgets]
    rows = [[m, lowest_met(res, m)] + [ratio_at(res, m, label, spread=True) for label in labels] for m in res.methods]
    return markdown_table(["method", "lowest budget met"] + [f"time at {label}" for label in labels], rows)


SPEED_LEGEND = (
    "Per model: the lowest budget each method met with gradients matching eager's, and its step time "
    "over eager's at each budget: median over interleaved rounds (min–max of the per-round ratios); "
    "— where the budget was not met."
)


def summary_table(results: list[ModelResult]) -> str:
    methods = list(dict.fromkeys(m for r in results for m in r.methods))
    rows = [[r.spec.name] + [f"{lowest_met(r, m)} · {ratio_at(r, m)}" for m in methods] for r in results]
    return markdown_table(["model"] + methods, rows)


def minimum_table(results: list[ModelResult]) -> str:
    methods = list(dict.fromkeys(m for r in results for m in r.methods))
    rows = []
    for r in results:
        row = [r.spec.name]
        for m in methods:
            cell = r.cell(OWN_MIN, m)
            cand = cell.candidate if cell else None
            if cand is None or cand.peak is None:
                row.append("n/a" if cell is None or cell.status == "n/a" else cell.status)
            else:
                ratio = f"{cand.time_ratio:.2f}×" if cand.time_ratio is not None else "—"
                flag = "" if cell.met is not False else " (over)"
                row.append(f"{cand.peak / r.eager_peak:.0%}{flag} · {ratio}")
        rows.append(row)
    return markdown_table(["model"] + methods, rows)


SUMMARY_LEGEND = (
    "Each cell: the lowest budget the method met with gradients matching eager's (of 100/70/50/35% of "
    "eager's measured peak) · its step time over eager's at the 50% budget (— where it did not meet 50%)."
)
MINIMUM_LEGEND = (
    "Each method's own minimum: measured peak as a share of eager's · step time over eager's. "
    "\"(over)\": memplan's measured peak exceeded the minimum budget it planned for."
)


def summary_markdown(results: list[ModelResult], total_s: float, environment: str) -> str:
    speed = "\n\n".join(f"**{r.spec.label}**\n\n{speed_table(r)}" for r in results)
    return (
        f"{SUMMARY_LEGEND}\n\n{summary_table(results)}\n\n{SPEED_LEGEND}\n\n{speed}\n\n"
        f"{MINIMUM_LEGEND}\n\n{minimum_table(results)}\n\n"
        f"Generated by `python -m benchmarks` in {total_s / 60:.1f} min ({environment}).\n"
    )


def readme_summary(results: list[ModelResult], total_s: float, environment: str,
                   results_dir: str = "benchmarks/results") -> str:
    """The project README's block: the summary table, and links to the per-model tables
    (``{results_dir}/<model>.md``) and to the full report (``{results_dir}/README.md``)."""
    d = results_dir.rstrip("/")
    models = ", ".join(f"[{r.spec.name}]({d}/{r.spec.name}.md)" for r in results)
    return (
        f"{SUMMARY_LEGEND}\n\n{summary_table(results)}\n\n"
        f"Every budget per model: {models}. Each method's own minimum, the step-time spreads and how "
        f"the numbers are made: [{d}/README.md]({d}/README.md). "
        f"Generated by `python -m benchmarks` in {total_s / 60:.1f} min ({environment}).\n"
    )


METHODOLOGY = """## How these numbers are made

* **Peak**: one seeded forward+backward. Eager-run configurations:
  `memplan.measure_peak` (CPU: the storage tracker, a dispatch mode counting
  parameters, buffers, inputs, activations, gradients and temporaries the
  step touches; CUDA: allocator statistics minus what other configurations
  hold). Compiled configurations (Inductor, memplan compiled) on CPU:
  `memplan.measure.tracker.profiled_peak`, the profiler's CPU allocation events summed
  in time order plus the step's parameters, buffers, inputs and loss targets.
  A dispatch mode cannot measure them: dynamo runs a frame eagerly while one
  is active, and Inductor's wrapper allocates its buffers outside the
  dispatcher. On eager steps the two agree to the byte without convolutions;
  the profiler also sees the scratch CPU convolution kernels allocate
  (`measure_agreement.md`; each model's eager line gives both).
* **Met budget**: measured peak <= budget, in bytes.
* **Time × eager**: median over interleaved rounds (every configuration, eager
  included, steps once per round, in one process, the order rotated each
  round) of the step time over eager's in the same round; **round spread**:
  the smallest and largest of those per-round ratios. CPU runs use one
  intra-op thread.
* **Plan s**: memplan: the `optimize` call (capture, solve, codegen), less
  the Inductor time `compile=True` spends inside it. **Compile s**: memplan
  compiled: Inductor's seconds from its `compile_report`; the Inductor peer:
  its first step (dynamo, AOTAutograd, partitioner, Inductor codegen and the
  C++ build, plus one step). Compiling happens outside every measurement; each method compiles into an empty Inductor cache, as a
  user's first run does. For the compiled peer the note gives the probes the fraction
  search compiled for that budget and their total time: what a user pays to
  find the fraction.
* **Grads vs eager**: every parameter gradient against eager's from the same
  seed; a gradient passes within 1e-3 of its largest magnitude plus 4x eager's
  own float32 error (eager float32 against eager float64); fused kernels
  change reduction orders, which this tolerance allows. The compiled peers
  run with `torch._inductor.config.fallback_random = True`, so dropout draws
  eager's masks; a failure at a fraction below 1 means the partitioner
  recomputed a random op in the backward and drew a different mask than the
  forward used (CPU has no RNG functionalization).
* **Own min**: checkpointing and eager have one configuration; the compiled
  peers' is fraction 0; memplan's is `InfeasibleBudgetError.min_budget` from
  a 1-byte budget, planned and measured.
"""


def full_report(results: list[ModelResult], total_s: float, environment: str) -> str:
    parts = [
        "# memplan benchmarks\n",
        summary_markdown(results, total_s, environment),
        METHODOLOGY,
        "## Per model\n",
    ]
    parts += [model_section(r) for r in results]
    return "\n".join(parts)


def _cell_json(c: Cell) -> dict[str, Any]:
    cand = c.candidate
    return {
        "budget_label": c.budget_label,
        "budget": c.budget,
        "method": c.method,
        "status": c.status,
        "note": c.note,
        "met": c.met,
        "configuration": cand.label if cand else None,
        "candidate_note": cand.note if cand else None,
        "compiled": cand.compiled if cand else None,
        "peak": cand.peak if cand else None,
        "time_ratio": cand.time_ratio if cand else None,
        "ratio_spread": list(cand.ratio_spread) if cand and cand.ratio_spread else None,
        "plan_s": cand.plan_s if cand else None,
        "compile_s": cand.compile_s if cand else None,
        "grads_ok": cand.grads.ok if cand and cand.grads else None,
        "grads_max_rel_err": cand.grads.max_rel_err if cand and cand.grads else None,
    }


def to_json(results: list[ModelResult], total_s: float, environment: str) -> dict[str, Any]:
    return {
        "total_s": total_s,
        "environment": environment,
        "models": [
            {
                "name": r.spec.name,
                "size": r.spec.size,
                "batch_size": r.spec.batch_size,
                "description": r.description,
                "eager_peak": r.eager_peak,
                "eager_profiled_peak": r.eager_profiled_peak,
                "eager_time_s": r.eager_time_s,
                "runtime_s": r.runtime_s,
                "budgets": [list(b) for b in r.budgets],
                "cells": [_cell_json(c) for c in r.cells],
            }
            for r in results
        ],
    }


def dump_json(results: list[ModelResult], total_s: float, environment: str) -> str:
    return json.dumps(to_json(results, total_s, environment), indent=1)


def _cell_from_json(d: dict[str, Any], shared: dict[tuple, Candidate]) -> Cell:
    """A cell and its candidate; cells that named the same configuration share one again."""
    cand = None
    if d["configuration"] is not None:
        key = (d["method"], d["configuration"], d["peak"], d["time_ratio"])
        if key not in shared:
            grads = None if d["grads_ok"] is None else GradCheck(d["grads_ok"], d["grads_max_rel_err"])
            spread = d.get("ratio_spread")
            shared[key] = Candidate(
                method=d["method"],
                label=d["configuration"],
                module=None,  # type: ignore[arg-type]  # a report, not a runnable configuration
                params=[],
                plan_s=d["plan_s"] or 0.0,
                compile_s=d.get("compile_s"),
                compiled=bool(d.get("compiled")),
                note=d.get("candidate_note") or "",
                peak=d["peak"],
                grads=grads,
                time_ratio=d["time_ratio"],
                ratio_spread=tuple(spread) if spread else None,
            )
        cand = shared[key]
    return Cell(d["budget_label"], d["budget"], d["method"], cand, d["status"], d["note"])


def _model_from_json(m: dict[str, Any]) -> ModelResult:
    shared: dict[tuple, Candidate] = {}
    cells = [_cell_from_json(c, shared) for c in m["cells"]]
    budgets = m.get("budgets") or list(dict.fromkeys(
        (c.budget_label, c.budget) for c in cells if c.budget_label != OWN_MIN
    ))
    return ModelResult(
        spec=ModelSpec(m["name"], m["size"], m["batch_size"]),
        description=m.get("description", m["name"]),
        eager_peak=m["eager_peak"],
        eager_time_s=m["eager_time_s"],
        eager_profiled_peak=m.get("eager_profiled_peak"),
        budgets=[(label, b) for label, b in budgets],
        cells=cells,
        runtime_s=m["runtime_s"],
    )


def from_json(data: dict[str, Any]) -> tuple[list[ModelResult], float, str]:
    """``results.json`` back as (results, total seconds, environment), to write the Markdown again."""
    return [_model_from_json(m) for m in data["models"]], data["total_s"], data["environment"]
