"""``memplan.optimize``: the public entry point, and the choice between its two front ends.

A model whose forward traces as one graph is planned whole (`memplan.frontend.module.OptimizedModule`:
one plan per input signature, the optimizer update and saved plans included). A model whose
Python reads tensor values (a branch on a value, ``.item()``, boolean masks, eager MoE routing)
cannot be one graph: on its first call it is handed, with a `memplan.frontend.module.GraphBreakWarning`,
to ``torch.compile`` with memplan's backend (`memplan.frontend.backend`), which splits it there and
plans every graph under one shared step budget. ``graph_breaks=False`` keeps the
``CaptureError`` instead.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable

import torch
import torch.nn as nn

from memplan.frontend.distributed import (DataParallel, DistributedTrainingError, is_data_parallel,
                                         made_on_first_rank, reduce_at_last_micro_step,
                                         refuse_unsupported_data_parallel)
from memplan.frontend.module import OptimizedModule
from memplan.frontend.paged import keep_parameters_on_device
from memplan.costs.cost_model import DeviceProfile
from memplan.frontend.backend import MemplanBackend
from memplan.pipeline.options import PlanOptions, StepOptions
from memplan.pipeline.saved import SavedPlan, saved_from_plan


class SplitAtGraphBreaks:
    """Makes ``model`` compiled with memplan's backend, for the options ``optimize`` was given
    (a picklable callable, so that an optimized module can be copied and saved)."""

    def __init__(self, model: nn.Module, budget: int | str, options: PlanOptions):
        self.model = model
        self.budget = budget
        self.options = options

    def __call__(self) -> tuple[Any, MemplanBackend]:
        backend = MemplanBackend(self.budget, self.options)
        return torch.compile(self.model, backend=backend), backend


def share_first_ranks_plan(ddp: nn.Module, opt: OptimizedModule, args: tuple, kwargs: dict) -> None:
    """Plan ``opt`` for these inputs once, on the DDP group's first rank, and bind that plan on every
    other rank (`made_on_first_rank`); plans for other inputs are made on each rank as they come."""
    group = ddp.process_group
    text = made_on_first_rank(group, lambda: saved_from_plan(opt.prepare(*args, **kwargs)).to_json())
    failure: Exception | None = None
    if torch.distributed.get_rank(group) != 0:
        try:
            opt.bind(SavedPlan.from_json(text), *args, **kwargs)
        except Exception as exc:  # said to every rank below, or the others would wait in DDP's first step
            failure = exc
    failed = torch.tensor([failure is not None], dtype=torch.int32)
    torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=group)
    if failure is not None:
        raise failure
    if failed.item():
        raise DistributedTrainingError("another rank could not bind the plan this rank made for every rank")


def share_first_plan_at_first_step(ddp: nn.Module, opt: OptimizedModule) -> Callable[[tuple, dict, int], None]:
    """`OptimizedModule.first_step` under DDP without example inputs: where every rank's first step
    has the same input signature (and holds no gradients), its plan is made once, on the first rank,
    and bound on every other (`share_first_ranks_plan`). Each rank solving for itself would get a
    different time-limited plan, so a different order of finished gradients, and DDP orders its
    buckets by the first rank's: on another rank the first bucket would fill late, and the all-reduces
    wait for the end of backward. Every rank runs its first step together (DDP's forward), so the
    collectives here are entered by all; a signature first seen later is planned on each rank."""

    def first_step(args: tuple, kwargs: dict, held: int) -> None:
        group = ddp.process_group
        # (None: this rank shares no plan: gradients held, a plan made already by prepare(), or inputs
        # that do not pickle; every rank still enters the gather, and all decide on what it gathered)
        mine = opt.input_signature(args, kwargs, held) if held == 0 and not opt.plans else None
        try:
            pickle.dumps(mine)
        except Exception:
            mine = None
        every: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(every, mine, group=group)
        if every[0] is not None and all(sig == every[0] for sig in every):
            share_first_ranks_plan(ddp, opt, args, kwargs)

    return first_step


def optimize(
    model: nn.Module,
    budget: int | str | None = None,
    *,
    example_inputs: Any = None,
    example_kwargs: dict | None = None,
    solver: str = "auto",
    time_limit: float | None = None,
    device_profile: str | DeviceProfile | None = None,
    offload: bool | None = None,
    profile: bool = False,
    compile: bool | Callable[..., Any] = False,
    kernel_scratch: bool | None = None,
    host_memory: int | str | None = None,
    optimizer: Any = None,
    grad_norm: bool = False,
    updates_after_backward: bool = False,
    max_grad_norm: float | None = None,
    optimizer_state: str = "auto",
    accumulate_steps: int = 1,
    clip_by: str = "auto",
    parameters: str = "auto",
    master_weights: bool = False,
    plan: Any = None,
    graph_breaks: bool = True,
) -> OptimizedModule:
    """Wrap ``model`` so that its training step's peak memory stays within ``budget``.

    ``budget`` is bytes (int), a string such as ``"16GB"``, or a share of the
    eager step's forward+backward peak such as ``"50%"`` (per input signature); it bounds the
    peak that :func:`memplan.measure_peak` reports for one forward+backward:
    parameters, buffers, inputs, activations, gradients and temporaries.
    Plans are made on the first call per input signature, or immediately
    for ``example_inputs`` (and ``example_kwargs``). Raises :class:`memplan.InfeasibleBudgetError`
    when no plan fits.

    How plans are made (`memplan.pipeline.options.PlanOptions`, where each is documented): ``solver``,
    ``time_limit``, ``device_profile``, ``offload``, ``profile``, ``compile``, ``kernel_scratch``,
    ``host_memory``.
    What the step does beyond forward and backward (`memplan.pipeline.options.StepOptions`): ``optimizer``,
    ``grad_norm``, ``updates_after_backward``, ``max_grad_norm``, ``optimizer_state``,
    ``accumulate_steps``, ``clip_by``, ``parameters``, ``master_weights``.
    ``plan=path`` reuses a plan written by ``Plan.save`` (budget defaults to the saved one)
    after checking it was made for this model and these inputs and validating it under the budget.
    ``graph_breaks=True``: a model whose Python reads tensor values runs split at those
    places through ``torch.compile`` with memplan's backend (see :mod:`memplan.frontend.entry`);
    False: it raises :class:`memplan.CaptureError`.

    ``model`` may be a ``DistributedDataParallel``: its module is planned inside it, the budget
    per rank with DDP's gradient buckets counted, and the DDP is returned with the optimized
    module as its ``module`` (`memplan.frontend.distributed`); with ``example_inputs`` the plan
    is solved once, on the first rank, and bound on the others.
    """
    options = PlanOptions(solver=solver, time_limit=time_limit, device_profile=device_profile, offload=offload,
                          profile=profile, compile=compile, kernel_scratch=kernel_scratch,
                          host_memory=host_memory)
    step = StepOptions(optimizer=optimizer, grad_norm=grad_norm, updates_after_backward=updates_after_backward,
                       max_grad_norm=max_grad_norm, optimizer_state=optimizer_state,
                       accumulate_steps=accumulate_steps, clip_by=clip_by, parameters=parameters,
                       master_weights=master_weights)
    ddp = model if is_data_parallel(model) else None
    if ddp is not None:
        # Planned inside the DDP it is given: the DDP is returned, its module the optimized one.
        # (No split at graph breaks: the backend's graphs cannot hand gradients to DDP yet, so a model
        # whose Python reads tensor values raises memplan.CaptureError at its first plan.)
        refuse_unsupported_data_parallel(ddp, step, optimized=isinstance(ddp.module, OptimizedModule))
        opt = OptimizedModule(ddp.module, budget, options, step, plan=plan, data_parallel=DataParallel.of(ddp))
        if step.optimizer is not None and step.accumulate_steps > 1:
            reduce_at_last_micro_step(ddp)
    else:
        split = SplitAtGraphBreaks(model, budget, options) if graph_breaks and budget is not None else None
        opt = OptimizedModule(model, budget, options, step, plan=plan, graph_breaks=split)
    if example_inputs is not None:
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        if ddp is not None and plan is None:
            share_first_ranks_plan(ddp, opt, example_inputs, example_kwargs or {})
        else:
            try:
                opt.prepare(*example_inputs, **(example_kwargs or {}))
            except Exception:
                if step.parameters == "host":  # refused: the parameters are not paged after all
                    keep_parameters_on_device(model)
                raise
    if ddp is not None:
        if plan is None and example_inputs is None:
            opt.first_step = share_first_plan_at_first_step(ddp, opt)
        ddp.module = opt
        return ddp
    return opt
