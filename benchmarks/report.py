"""Markdown tables and JSON from :class:`~benchmarks.runner.ModelResult`.

* :func:`model_table`: one row per (budget, method), the full detail.
* :func:`summary_table`: one row per model, one column per method: the
  lowest budget the method met and its step-time ratio at the 50% budget.
* :func:`minimum_table`: each method's own minimum, as a share of eager's peak.
"""
from __future__ import annotations

import json
from typing import Any

from benchmarks.core import Cell
from benchmarks.methods import OWN_MIN
from benchmarks.runner import ModelResult

COLUMNS = (
    "budget",
    "method",
    "configuration",
    "measured peak (MB)",
    "% of eager peak",
    "met budget",
    "time × eager",
    "plan s",
    "grads vs eager",
    "note",
)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def _table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = [_row(list(header)), _row(["---"] * len(header))]
    lines += [_row(r) for r in rows]
    return "\n".join(lines)


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


def cell_row(cell: Cell, eager_peak: int) -> list[str]:
    cand = cell.candidate
    if cand is None:
        return [_budget_text(cell, eager_peak), cell.method, "—", "—", "—", met_text(cell), "—", "—", "—", cell.note]
    note = "; ".join(x for x in (cand.note, cell.note) if x)
    return [
        _budget_text(cell, eager_peak),
        cell.method,
        cand.label,
        f"{cand.peak / 1e6:.1f}" if cand.peak is not None else "—",
        f"{cand.peak / eager_peak:.0%}" if cand.peak is not None else "—",
        met_text(cell),
        f"{cand.time_ratio:.2f}" if cand.time_ratio is not None else "—",
        f"{cand.plan_s:.1f}",
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
    return _table(COLUMNS, rows)


def model_section(res: ModelResult) -> str:
    head = (
        f"### {res.spec.label}\n\n{res.description}. Eager step: measured peak "
        f"{res.eager_peak / 1e6:.1f} MB, {res.eager_time_s:.3f} s (median). Model runtime "
        f"in the harness: {res.runtime_s:.0f} s.\n\n"
    )
    return head + model_table(res) + "\n"


def _met_correctly(cell: Cell | None) -> bool:
    return bool(cell and cell.met and cell.candidate and cell.candidate.grads and cell.candidate.grads.ok)


def lowest_met(res: ModelResult, method: str) -> str:
    """The smallest budget of the grid the method met with eager's gradients, e.g. "35%"; "none" if none."""
    met = [(b, label) for label, b in res.budgets if _met_correctly(res.cell(label, method))]
    if not met:
        cell = res.cell(res.budgets[0][0], method)
        return "n/a" if cell is not None and cell.status == "n/a" else "none"
    return min(met)[1]


def ratio_at(res: ModelResult, method: str, label: str = "50%") -> str:
    cell = res.cell(label, method)
    if cell is None or cell.status == "n/a":
        return "n/a"
    if not cell.met or cell.candidate is None or cell.candidate.time_ratio is None:
        return "—"
    grads = "" if cell.candidate.grads is None or cell.candidate.grads.ok else " (grads FAIL)"
    return f"{cell.candidate.time_ratio:.2f}×{grads}"


def summary_table(results: list[ModelResult]) -> str:
    methods = list(dict.fromkeys(m for r in results for m in r.methods))
    rows = [[r.spec.name] + [f"{lowest_met(r, m)} · {ratio_at(r, m)}" for m in methods] for r in results]
    return _table(["model"] + methods, rows)


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
    return _table(["model"] + methods, rows)


SUMMARY_LEGEND = (
    "Each cell: the lowest budget the method met with gradients matching eager's (of 100/70/50/35% of "
    "eager's measured peak) · its step time over eager's at the 50% budget (— where it did not meet 50%)."
)
MINIMUM_LEGEND = (
    "Each method's own minimum: measured peak as a share of eager's · step time over eager's. "
    "\"(over)\": memplan's measured peak exceeded the minimum budget it planned for."
)


def summary_markdown(results: list[ModelResult], total_s: float, environment: str) -> str:
    return (
        f"{SUMMARY_LEGEND}\n\n{summary_table(results)}\n\n{MINIMUM_LEGEND}\n\n{minimum_table(results)}\n\n"
        f"Generated by `python -m benchmarks` in {total_s / 60:.1f} min ({environment}).\n"
    )


METHODOLOGY = """## How these numbers are made

* **Peak**: `memplan.measure_peak` around one seeded forward+backward (CPU:
  the storage tracker, counting parameters, buffers, inputs, activations,
  gradients and temporaries the step touches; CUDA: allocator statistics
  minus what other configurations hold). Compiled steps are measured with the
  same tracker marked `ignore_compile_internals`, or dynamo would run them
  eagerly under it.
* **Met budget**: measured peak <= budget, in bytes.
* **Time × eager**: median over interleaved rounds (every configuration, eager
  included, steps once per round) of the step time over eager's in the same
  round. CPU runs use one intra-op thread.
* **Plan s**: memplan: the whole `optimize` call (capture, solve, codegen).
  compile: the first step (dynamo, AOTAutograd, partitioning); the note gives
  the probes the fraction search compiled for that budget and their total
  time.
* **Grads vs eager**: every parameter gradient against eager's from the same
  seed; a gradient passes within 1e-3 of its largest magnitude plus 4x eager's
  own float32 error (eager float32 against eager float64). The compiled peer
  runs with `torch._inductor.config.fallback_random = True`, so its dropout
  draws eager's masks; a failure at a fraction below 1 means the partitioner
  recomputed a random op in the backward and drew a different mask than the
  forward used (CPU has no RNG functionalization).
* **Own min**: checkpointing and eager have one configuration; compile's is
  fraction 0; memplan's is `InfeasibleBudgetError.min_budget` from a 1-byte
  budget, planned and measured.
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


def to_json(results: list[ModelResult], total_s: float, environment: str) -> dict[str, Any]:
    def cell(c: Cell) -> dict[str, Any]:
        cand = c.candidate
        return {
            "budget_label": c.budget_label,
            "budget": c.budget,
            "method": c.method,
            "status": c.status,
            "note": c.note,
            "met": c.met,
            "configuration": cand.label if cand else None,
            "peak": cand.peak if cand else None,
            "time_ratio": cand.time_ratio if cand else None,
            "plan_s": cand.plan_s if cand else None,
            "grads_ok": cand.grads.ok if cand and cand.grads else None,
            "grads_max_rel_err": cand.grads.max_rel_err if cand and cand.grads else None,
        }

    return {
        "total_s": total_s,
        "environment": environment,
        "models": [
            {
                "name": r.spec.name,
                "size": r.spec.size,
                "batch_size": r.spec.batch_size,
                "eager_peak": r.eager_peak,
                "eager_time_s": r.eager_time_s,
                "runtime_s": r.runtime_s,
                "cells": [cell(c) for c in r.cells],
            }
            for r in results
        ],
    }


def dump_json(results: list[ModelResult], total_s: float, environment: str) -> str:
    return json.dumps(to_json(results, total_s, environment), indent=1)
