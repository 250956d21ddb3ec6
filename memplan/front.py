"""``memplan.optimize``: the public entry point, and the choice between its two front ends.

A model whose forward traces as one graph is planned whole (`memplan.api.OptimizedModule`:
one plan per input signature, the optimizer update and saved plans included). A model whose
Python reads tensor values (a branch on a value, ``.item()``, boolean masks, eager MoE routing)
cannot be one graph: on its first call it is handed, with a `memplan.api.GraphBreakWarning`,
to ``torch.compile`` with memplan's backend (`memplan.dynamo`), which splits it there and
plans every graph under one shared step budget. ``graph_breaks=False`` keeps the
``CaptureError`` instead.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from memplan.api import OptimizedModule
from memplan.costs import DeviceProfile
from memplan.dynamo import PLAN_OPTIONS, MemplanBackend


class SplitAtGraphBreaks:
    """Makes ``model`` compiled with memplan's backend, for the options ``optimize`` was given
    (a picklable callable, so that an optimized module can be copied and saved)."""

    def __init__(self, model: nn.Module, budget: int | str, options: dict[str, Any]):
        self.model = model
        self.budget = budget
        self.options = {k: v for k, v in options.items() if k in PLAN_OPTIONS and v is not None}

    def __call__(self) -> tuple[Any, MemplanBackend]:
        backend = MemplanBackend(self.budget, **self.options)
        return torch.compile(self.model, backend=backend), backend


def optimize(
    model: nn.Module,
    budget: int | str | None = None,
    *,
    example_inputs: Any = None,
    example_kwargs: dict | None = None,
    solver: str = "auto",
    time_limit: float | None = None,
    device_profile: str | DeviceProfile | None = None,
    graph_breaks: bool = True,
    **options: Any,
) -> OptimizedModule:
    """Wrap ``model`` so that its training step's peak memory stays within ``budget``.

    ``budget`` is bytes (int), a string such as ``"16GB"``, or a share of the
    eager step's forward+backward peak such as ``"50%"`` (per input signature); it bounds the
    peak that :func:`memplan.measure_peak` reports for one forward+backward:
    parameters, buffers, inputs, activations, gradients and temporaries.
    Plans are made on the first call per input signature, or immediately
    for ``example_inputs``. ``profile=True`` times every op of the step on the
    model's device instead of estimating it from ``device_profile``. ``offload=True``
    lets the plan page activations to host memory over the device's host link as
    well as recompute them (default: on for CUDA models, off on CPU, where it is
    a real copy into host-counted memory, for testing). Raises :class:`memplan.InfeasibleBudgetError`
    when no plan fits. ``plan=path`` reuses a plan written by ``Plan.save``
    (budget defaults to the saved one) after checking it was made for this
    model and these inputs and validating it under the budget.
    ``graph_breaks=True``: a model whose Python reads tensor values runs split at those
    places through ``torch.compile`` with memplan's backend (see :mod:`memplan.front`);
    False: it raises :class:`memplan.CaptureError`.
    ``compile=True`` compiles each plan's runs of ATen ops with Inductor, its memory decisions kept
    (:mod:`memplan.compiled`; ``opt.compile_report`` says what was compiled).
    """
    split = None
    if graph_breaks and budget is not None:
        split = SplitAtGraphBreaks(model, budget, dict(solver=solver, time_limit=time_limit,
                                                       device_profile=device_profile, **options))
    opt = OptimizedModule(model, budget, solver=solver, time_limit=time_limit, device_profile=device_profile,
                          graph_breaks=split, **options)
    if example_inputs is not None:
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        opt.prepare(*example_inputs, **(example_kwargs or {}))
    return opt
