"""Do the two CPU peak measurements agree on eager steps? ``python -m benchmarks.studies.measure_agreement``.

Compiled steps are measured with ``memplan.measure.tracker.profiled_peak`` (profiler
allocation events), eager ones with ``MemoryTracker`` (a dispatch mode). The
benchmark tables put both side by side, so this checks, on the eager step of
every zoo model, that they count the same thing: the step's state
(parameters, buffers, inputs) plus everything it allocates. They should agree
to the allocator's alignment, except where a kernel allocates scratch below
the dispatcher, which only the profiler sees (CPU convolutions). Writes
``benchmarks/results/measure_agreement.md``.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness.config import ModelSpec
from benchmarks.harness.core import ModelUnderTest
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.steps import clear_grads, measure_step_peak

MODELS: tuple[str, ...] = ("mlp", "gpt", "vit", "cnn", "resnet50", "unet")


@dataclass
class Agreement:
    """One model's eager step measured both ways."""

    model: str
    convolutions: int
    tracker: int
    profiler: int

    @property
    def diff(self) -> int:
        return self.profiler - self.tracker

    def row(self) -> str:
        return (
            f"| {self.model} | {self.convolutions} | {self.tracker / 1e6:.3f} | {self.profiler / 1e6:.3f} "
            f"| {self.diff:+,} | {self.diff / self.tracker:+.2%} |"
        )


def _convolutions(module: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())


def agreement(spec: ModelSpec) -> Agreement:
    """The eager step of ``spec``, warmed up, then measured by the tracker and by the profiler."""
    mut = ModelUnderTest.build(spec, torch.device("cpu"))
    clear_grads(mut.eager_params)
    mut.step(*mut.args, **mut.kwargs).backward()  # warm-up: lazy init, first-call allocations
    # ``compiled=True`` only selects the profiler: the step itself runs eagerly here.
    tracker = measure_step_peak(mut.step, mut.eager_params, mut.inputs)
    profiler = measure_step_peak(mut.step, mut.eager_params, mut.inputs, compiled=True)
    clear_grads(mut.eager_params)
    return Agreement(spec.label, _convolutions(mut.step), tracker, profiler)


def table(rows: list[Agreement]) -> str:
    head = (
        "## Profiler (`profiled_peak`) against tracker (`MemoryTracker`) on eager steps\n\n"
        "One seeded forward+backward per model, one thread; both count parameters, buffers and inputs "
        "as resident. The profiler also sees scratch that kernels allocate below the dispatcher "
        "(CPU convolutions), which the tracker cannot.\n\n"
        "| model | conv layers | tracker MB | profiler MB | profiler − tracker (bytes) | relative |\n"
        "|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(r.row() for r in rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.measure_agreement", description=__doc__)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--size", default="small", help="zoo size (the benchmark tables use small)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "measure_agreement.md")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in (m for m in ns.models.split(",") if m):
        rows.append(agreement(ModelSpec(name, ns.size)))
        print(rows[-1].row(), flush=True)
    text = table(rows)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
