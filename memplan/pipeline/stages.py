"""The pipeline written once: capture -> learn the updates -> eager replay -> costs and lowering
-> (solve) -> build.

Every caller goes through these functions: `memplan.pipeline.plan.make_plan` (``optimize`` and
the backend), `memplan.pipeline.saved.make_plan_from_saved` (a saved plan reused), `analyze`
(the exported ``memplan.analyze``) and the CLI. None of them calls the capture, the optimizer's
probe or the analysis by itself (`tests/test_layers.py` checks it), so a stage added here is added
for all of them.

``stage``: a context manager factory ``stage(key, text)`` wrapped around each stage, for callers
that time or show progress (the CLI's spinner, ``make_plan``'s phase timer); the keys are
"capture", "optimizer", "eager" and (in `analyze`) "analyze".
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from memplan.capture.signature import Capture
from memplan.capture.trace import capture
from memplan.costs.cost_model import DeviceProfile, get_profile
from memplan.passes.output_use import OutputUse
from memplan.passes.paging import page_parameters, with_paged
from memplan.planning.analysis import Analysis, analyze_capture, costs_with_added_nodes, replay_eager_peak_of
from memplan.core.config import TUNABLES
from memplan.updates.buckets import bucket_caps
from memplan.updates.master_weights import has_master, uses_master_weights
from memplan.updates.probe import ParamUpdate, UpdatePlacement, learn_updates
from memplan.updates.runner import Accumulation, UpdateRunner
from memplan.runtime.program import Program, build_program

Stage = Callable[[str, str], ContextManager[Any]]


def no_stage(key: str, text: str) -> ContextManager[None]:
    """The default ``stage``: nothing around a stage."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class PreparedStep:
    """What the stages before the costs make of one step: its joint graph, what the optimizer's
    update of each parameter costs (empty without an optimizer), and the eager step's peak."""

    capture: Capture
    updates: list[ParamUpdate]
    eager_peak: int


def capture_step(model: torch.nn.Module, args: tuple, kwargs: dict, *, output_use: OutputUse = OutputUse(),
                 stage: Stage = no_stage, paged: bool = False) -> Capture:
    """The first stage alone: the step's joint graph (`memplan.capture.trace.capture`); with
    ``paged``, every parameter in host memory and fetched before its readers (`page_parameters`)."""
    with stage("capture", "capturing forward+backward on fake tensors"):
        cap = capture(model, args, kwargs, output_use=output_use)
        if paged:
            page_parameters(cap.graph_module, [node for node, info in zip(cap.placeholders(), cap.primals)
                                               if info.kind == "param"])
        return cap


def prepare_step(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    profile: DeviceProfile,
    output_use: OutputUse = OutputUse(),
    optimizer: torch.optim.Optimizer | None = None,
    measure_on: torch.device | None = None,
    eager_peak: int | None = None,
    captured: Capture | None = None,
    stage: Stage = no_stage,
    paged: bool = False,
) -> PreparedStep:
    """Capture the step, learn its optimizer's updates and replay it eagerly on fake tensors.

    ``eager_peak``: the eager step's peak when the caller has replayed it already for this output
    use. ``captured``: the step's capture when the caller made it already (`capture_step`; a saved
    plan checks it before anything else runs). ``measure_on``: the optimizer's update is timed there.
    ``paged``: the parameters live in host memory between their uses (`capture_step`)."""
    cap = captured if captured is not None else capture_step(model, args, kwargs, output_use=output_use, stage=stage,
                                                             paged=paged)
    updates: list[ParamUpdate] = []
    if optimizer is not None:
        with stage("optimizer", f"learning what {type(optimizer).__name__} keeps and allocates"):
            updates = learn_updates(optimizer, model, [p.name for p in cap.primals], profile,
                                    measure_times=measure_on is not None)
            if paged:
                params = dict(model.named_parameters())
                updates = [_paged(u, params[u.name], optimizer) for u in updates]
    with stage("eager", "replaying the eager step on fake tensors"):
        if eager_peak is None:
            eager_peak = replay_eager_peak_of(cap, model, args, kwargs)
    return PreparedStep(cap, updates, eager_peak)


def _paged(update: ParamUpdate, p: torch.Tensor, optimizer: torch.optim.Optimizer) -> ParamUpdate:
    """``update`` of paged parameter ``p``; with an fp32 master (`memplan.updates.master_weights`), its
    state in fp32 as the master's is, and the master's bytes."""
    if not uses_master_weights(optimizer) or not has_master(p):
        return dataclasses.replace(update, paged=True)
    widen = 4 / p.element_size()
    return dataclasses.replace(update, paged=True, state_bytes=int(update.state_bytes * widen),
                               master_bytes=int(update.grad_bytes * widen))


def analyze_step(
    prepared: PreparedStep,
    profile: DeviceProfile,
    *,
    measure_on: torch.device | None = None,
    placement: UpdatePlacement = UpdatePlacement(),
    carry_limit: tuple[int, int] | None = None,
    scratch_on: torch.device | None = None,
) -> Analysis:
    """Costs, the solver's Problem and the store-all baseline of a prepared step
    (`memplan.planning.analysis.analyze_capture`), its updates placed as ``placement`` says."""
    return analyze_capture(prepared.capture, profile, prepared.eager_peak, measure_on, prepared.updates, placement,
                           carry_limit=carry_limit, scratch_on=scratch_on)


def analyze_placement(analysis: Analysis, placement: UpdatePlacement) -> Analysis:
    """The same step lowered again with its updates placed otherwise; its costs are reused."""
    return analyze_capture(analysis.capture, analysis.profile, analysis.eager_peak, None, analysis.updates,
                           placement, costs=analysis.costs)


def analyze_paged(analysis: Analysis, names: frozenset[str], model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None, placement: UpdatePlacement) -> Analysis:
    """The step of ``analysis`` with the parameters named ``names`` paged as well (`with_paged`: its
    graph copied, the analysis' own left as it is), lowered with its updates placed as ``placement``
    says (which must keep the paged parameters' state in host memory); the known costs are reused."""
    cap = analysis.capture
    placeholders = {info.name: node.name for node, info in zip(cap.placeholders(), cap.primals) if info.kind == "param"}
    paged = dataclasses.replace(cap, graph_module=with_paged(cap.graph_module, [placeholders[n] for n in names]))
    params = dict(model.named_parameters())
    updates = [_paged(u, params[u.name], optimizer) if u.name in names and not u.paged else u for u in analysis.updates]
    return analyze_capture(paged, analysis.profile, analysis.eager_peak, None, updates, placement,
                           costs=costs_with_added_nodes(paged, analysis.costs, analysis.profile))


def build_step(
    analysis: Analysis,
    schedule: Any,
    timeline: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    grad_norm: bool = False,
    max_grad_norm: float | None = None,
    accumulation: Accumulation | None = None,
    handout_bytes: int | None = None,
) -> Program:
    """The runnable program of a solved schedule, with the runner of the optimizer updates it places.
    ``handout_bytes``: gradients go to a distributed engine in groups of about that many bytes as
    they are made (`memplan.runtime.handout`), and the updates step with the engine's reduced ones."""
    runner = update_runner(analysis, model, optimizer, grad_norm, max_grad_norm, accumulation,
                           reduced_in_grad=handout_bytes is not None)
    return build_program(analysis.capture, analysis.lowered, schedule, runner, timeline, handout_bytes)


def update_runner(analysis: Analysis, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  grad_norm: bool = False, max_grad_norm: float | None = None,
                  accumulation: Accumulation | None = None, reduced_in_grad: bool = False) -> UpdateRunner | None:
    """The runner that applies ``optimizer`` to the parameters the analysis' plan updates (None: no updates)."""
    low = analysis.lowered
    if optimizer is None or not low.updates:
        return None
    params = dict(model.named_parameters())
    host = frozenset(slot for slot, (_, _, name) in enumerate(low.updates) if name in low.host_states)
    return UpdateRunner(optimizer, [params[name] for _, _, name in low.updates], grad_norm, max_grad_norm,
                        host, accumulation, reduced_in_grad)


def step_bucket_caps(updates: Sequence[ParamUpdate]) -> list[int]:
    """The bucket caps a whole step's plan tries, largest first (`memplan.updates.buckets.bucket_caps`)."""
    return bucket_caps([u.grad_bytes for u in updates], TUNABLES.bucket_bytes, TUNABLES.min_buckets)


def analyze(
    model: torch.nn.Module,
    example_inputs: Any = (),
    example_kwargs: dict | None = None,
    *,
    device_profile: str | DeviceProfile | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    host_state: bool = False,
    paged: bool = False,
    stage: Stage = no_stage,
) -> Analysis:
    """Capture ``model`` on fake tensors and predict its eager step's memory and time
    (with ``optimizer``: the whole step, its state and updates included; ``host_state``: every
    parameter's state in host memory, updated there; ``paged``: the parameters too, `capture_step`)."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    profile = get_profile(device_profile, device)
    prepared = prepare_step(model, example_inputs, dict(example_kwargs or {}), profile=profile, optimizer=optimizer,
                            stage=stage, paged=paged)
    updates = prepared.updates
    # (the placement `memplan.pipeline.plan.make_plan` tries first: its largest bucket cap)
    placement = UpdatePlacement(host=frozenset(u.name for u in updates) if host_state else frozenset(),
                                bucket_bytes=step_bucket_caps(updates)[0] if updates else 0)
    with stage("analyze", "costing and lowering the joint graph"):
        return analyze_step(prepared, profile, placement=placement)
