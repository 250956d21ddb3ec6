"""The first step through the ``torch.compile`` backend on a model with graph breaks.

A 6-block MLP (width 128, batch 512) split by a branch on a value, an ``.item()`` and a
boolean mask, trained for a few steps at shares of its eager peak through
``torch.compile(model, backend=memplan.backend(budget=...))``. Each step's peak is read off
the allocator's events (`memplan.measure.tracker.profiled_peak`: a dispatch-mode tracker cannot
watch a compiled frame), its gradients compared with eager's, and what the backend said
(warnings, errors) recorded. ``python -m benchmarks.studies.first_step`` writes
``benchmarks/results/first_step.md``.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import memplan
from benchmarks.harness.paths import RESULTS_DIR
from memplan.measure.tracker import measure_peak, profiled_peak

MiB = 2**20
RESULTS = RESULTS_DIR / "first_step.md"


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class SplitByPython(nn.Module):
    """Six blocks with a value branch after block 2, an ``.item()`` after block 4 and a mask at the end."""

    def __init__(self, d: int = 128, n: int = 6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        b = self.blocks
        x = b[1](b[0](x))
        if x.mean() > 0:
            x = x * 0.5
        x = b[3](b[2](x))
        scale = x.abs().mean().item()
        x = b[5](b[4](x / (1.0 + scale)))
        picked = x[x.sum(-1) > 0]
        return self.head(x).square().mean() + picked.square().mean()


def run(fraction: float, steps: int, time_limit: float) -> dict:
    """One budget: each step's peak (bytes), the largest gradient difference from eager, what was said."""
    torch.manual_seed(0)
    model, x = SplitByPython(), torch.randn(512, 128)
    model(x).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    eager = measure_peak(lambda: model(x).backward(), resident=list(model.parameters()))
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    budget = int(fraction * eager)
    compiled = torch.compile(model, backend=memplan.backend(budget=budget, time_limit=time_limit))
    peaks, said, error, worst = [], [], None, 0.0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                peaks.append(profiled_peak(lambda: compiled(x).backward(), resident=[*model.parameters(), x]))
            except memplan.InfeasibleBudgetError as exc:
                error = f"{type(exc).__name__} at step {len(peaks) + 1}"
        said.append(sum(1 for w in seen if "memplan" in str(w.message)))
        if error:
            break
        worst = max(worst, max((p.grad - r).abs().max().item() for p, r in zip(model.parameters(), reference)))
    return dict(fraction=fraction, eager=eager, budget=budget, peaks=peaks, said=said, error=error, worst=worst)


def row(r: dict) -> str:
    peaks = r["peaks"]
    mark = lambda p: f"{p / MiB:.2f}" + (" (over)" if p > r["budget"] else "")  # noqa: E731
    later = peaks[1:]
    return (f"| {r['fraction']:.0%} ({r['budget'] / MiB:.2f} MiB) | {mark(peaks[0]) if peaks else '-'} | "
            + (f"{min(later) / MiB:.2f}-{max(later) / MiB:.2f}" + (" (over)" if max(later) > r["budget"] else "")
               if later else "-")
            + f" | {sum(r['said'])} | {r['error'] or '-'} | {r['worst']:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.9,0.7,0.6,0.5")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [run(float(f), args.steps, args.time_limit) for f in args.fractions.split(",")]
    lines = [
        "# The first step through the backend, with graph breaks",
        "",
        f"`python -m benchmarks.studies.first_step` (torch {torch.__version__}, one thread): {SplitByPython.__doc__}",
        f"Eager peak {results[0]['eager'] / MiB:.2f} MiB. Peaks by the allocator's events (`profiled_peak`), "
        f"MiB; {args.steps} steps per budget.",
        "",
        "| budget | step 1 | steps 2-5 | memplan warnings | error | max gradient difference from eager |",
        "|---|---|---|---|---|---|",
        *(row(r) for r in results),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
