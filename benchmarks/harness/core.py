"""The harness's vocabulary: a model under test, a runnable configuration, a table cell.

* :class:`ModelUnderTest`: one zoo model as a loss-returning step module,
  its inputs, eager's gradients and eager's measured peak.
* :class:`Candidate`: one runnable configuration of one method (say, the
  compiled step at ``activation_memory_budget=0.5``). It is measured once
  (peak, gradients) and timed in the interleaved repetitions; several cells
  may share it (checkpointing has one configuration for every budget).
* :class:`Cell`: one (budget, method) entry of a model's table.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import memplan
from benchmarks.harness.config import ModelSpec
from benchmarks.harness.steps import (
    GradCheck,
    StepInputs,
    clear_grads,
    closure_tensors,
    collect_grads,
    compare_grads,
    measure_step_peak,
)
from benchmarks.models.layouts import BlockLayout, layout_for
from memplan.models import zoo


@dataclass
class Candidate:
    """One runnable configuration; ``measure`` fills ``peak`` and ``grads``."""

    method: str
    label: str  # what distinguishes it, e.g. "fraction 0.50" or "budget 70%"
    module: nn.Module  # call -> scalar loss
    params: list[tuple[str, nn.Parameter]]  # under eager's parameter names
    plan_s: float = 0.0  # planning: memplan's optimize() call (solve, capture, codegen)
    compile_s: float | None = None  # compiling: Inductor's first step (None: nothing compiled)
    compiled: bool = False  # runs compiled code: measured with the profiler (``profiled_peak``)
    note: str = ""
    peak: int | None = None
    grads: GradCheck | None = None
    time_ratio: float | None = None
    times: list[float] = field(default_factory=list)
    ratio_spread: tuple[float, float] | None = None  # (min, max) of the per-round time ratios


@dataclass
class Cell:
    """One (budget, method) entry: which candidate answers it, or why none does."""

    budget_label: str  # "100%", "70%", ..., or "own min"
    budget: int | None  # bytes; for "own min" the method's own minimum
    method: str
    candidate: Candidate | None = None
    status: str = "ok"  # ok | infeasible | n/a | error
    note: str = ""

    @property
    def met(self) -> bool | None:
        """Measured peak <= budget; None when nothing was measured."""
        if self.candidate is None or self.candidate.peak is None or self.budget is None:
            return None
        return self.candidate.peak <= self.budget


@dataclass
class ModelUnderTest:
    """A zoo model as one loss-returning step, with eager's reference results."""

    spec: ModelSpec
    name: str
    description: str
    step: nn.Module  # memplan.WithLoss(zoo model, loss_fn)
    inputs: StepInputs
    layout: BlockLayout
    eager_params: list[tuple[str, nn.Parameter]]
    ref_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    grad_noise: dict[str, float] = field(default_factory=dict)  # eager float32 vs float64, relative
    eager_peak: int = 0

    @classmethod
    def build(cls, spec: ModelSpec, device: torch.device) -> "ModelUnderTest":
        zm = zoo.build(spec.name, size=spec.size, batch_size=spec.batch_size, device=device)
        step = memplan.WithLoss(zm.model, zm.loss_fn)
        return cls(
            spec=spec,
            name=spec.name,
            description=zm.description,
            step=step,
            inputs=StepInputs(
                tuple(zm.example_inputs), dict(zm.example_kwargs), torch.device(device), closure_tensors(zm.loss_fn)
            ),
            layout=layout_for(spec.name, zm.model),
            eager_params=list(step.named_parameters()),
        )

    @property
    def args(self) -> tuple[Any, ...]:
        return self.inputs.args

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.inputs.kwargs

    def twin(self) -> tuple[nn.Module, list[tuple[str, nn.Parameter]]]:
        """A deep copy of the step module and its parameters under eager's names.

        Names are read before the caller rewires the copy, so gradients can be
        compared by name whatever wrappers go in.
        """
        clear_grads(self.eager_params)
        module = copy.deepcopy(self.step)
        return module, list(module.named_parameters())

    def measure(self, cand: Candidate) -> Candidate:
        """Fill ``cand.peak`` and ``cand.grads`` from one seeded, measured step."""
        cand.peak = measure_step_peak(cand.module, cand.params, self.inputs, compiled=cand.compiled)
        cand.grads = compare_grads(collect_grads(cand.params), self.ref_grads, self.grad_noise)
        clear_grads(cand.params)
        return cand
