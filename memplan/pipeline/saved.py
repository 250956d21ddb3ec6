"""Saved plans as objects: check a saved plan against a fresh capture and reuse it without solving.

The file itself (what a saved plan records, the input and graph signatures,
the JSON) is :mod:`memplan.planning.saved_format`. Loading checks both signatures
against a fresh capture, then replays the schedule through
``solvers.validate`` on the freshly lowered Problem under the budget in
force, so a stale or edited file can never run unchecked.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

import solvers
from memplan.planning.analysis import Analysis
from memplan.capture.signature import Capture
from memplan.costs.cost_model import DeviceProfile
from memplan.passes.output_use import OutputUse
from memplan.updates.probe import UpdatePlacement
from memplan.updates.runner import Accumulation
from memplan.pipeline.plan import Plan, plan_from_schedule
from memplan.pipeline.stages import analyze_step, build_step, capture_step, prepare_step
from memplan.planning.lowering import SCRATCH_PREFIX
from memplan.core.storage import SCRATCH_BYTES
from memplan.planning.saved_format import (
    PlanMismatchError,
    count_params,
    describe_inputs,
    graph_signature,
    input_signature,
    record_from_json,
    record_to_json,
)
from memplan.runtime.program import Program
from memplan.core.units import format_bytes


@dataclass
class SavedPlan:
    """A plan read back from disk: its schedule and what it was made for."""

    budget: int
    predicted_peak: int
    predicted_time: float
    method: str
    status: str
    lower_bound: float | None
    solve_time: float
    graph_signature: str
    input_signature: str
    inputs: list[str]  # readable, for error messages
    num_nodes: int  # ATen ops of the joint graph, for error messages
    num_params: int  # parameter elements, for error messages
    schedule: "solvers.Schedule"
    path: str | None = None
    output_use: OutputUse = field(default_factory=OutputUse)  # what the plan assumed about the outputs
    # A whole-step plan (made with optimizer=): where its updates run and the state they keep.
    placement: UpdatePlacement | None = None
    optimizer_state_bytes: int = 0

    def to_json(self) -> str:
        """The plan as the JSON document ``Plan.save`` writes (:mod:`memplan.planning.saved_format`)."""
        return record_to_json({f.name: getattr(self, f.name) for f in fields(self) if f.name != "path"})

    @classmethod
    def from_json(cls, text: str, path: str | None = None) -> "SavedPlan":
        """Read a JSON document; :class:`PlanMismatchError` for anything but a saved plan."""
        return cls(**record_from_json(text, path or "document"), path=path)

    def check(self, cap: Capture) -> None:
        """Raise :class:`PlanMismatchError` unless this plan was made for ``cap``'s model and inputs."""
        where = self.path or "the saved plan"
        if input_signature(cap) != self.input_signature:
            now = describe_inputs(cap)
            raise PlanMismatchError(
                f"{where} was made for other inputs: saved for {'; '.join(self.inputs) or 'no tensor inputs'}, "
                f"called with {'; '.join(now) or 'no tensor inputs'}"
                + (" (same tensors: another argument structure, constant or train/eval mode)" if now == self.inputs else "")
                + "; re-plan for these inputs"
            )
        if graph_signature(cap) != self.graph_signature:
            nodes, params = cap.num_ops(), count_params(cap)
            raise PlanMismatchError(
                f"{where} was made for a different model: saved for {self.num_params:,} parameters and "
                f"{self.num_nodes} ATen ops, this model has {params:,} parameters and {nodes} ATen ops"
                + (" (same counts: other shapes, dtypes, or another torch version)" if (nodes, params) == (self.num_nodes, self.num_params) else "")
                + "; re-plan for this model"
            )

    def bind(self, analysis: Analysis, budget: int | None = None) -> Plan:
        """Check the plan against ``analysis`` and validate it under ``budget`` (default: the saved one)."""
        self.check(analysis.capture)
        budget = self.budget if budget is None else budget
        try:
            return plan_from_schedule(
                analysis, budget, self.schedule, method=self.method, status=self.status,
                lower_bound=self.lower_bound, solve_time=self.solve_time,
            )
        except solvers.ScheduleError as exc:
            where = self.path or "the saved plan"
            if exc.kind == "over-budget":
                raise PlanMismatchError(
                    f"{where} peaks at {format_bytes(self.predicted_peak)}, over the budget {format_bytes(budget)}; "
                    "raise the budget or re-plan"
                ) from None
            raise PlanMismatchError(f"{where} is not a valid schedule for this model: {exc}") from None


def saved_from_plan(plan: Plan) -> SavedPlan:
    """What saving ``plan`` records, as a :class:`SavedPlan` (without writing anything)."""
    return SavedPlan(**plan.record())


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` to ``path`` as JSON (see :func:`load_plan`); the same as ``plan.save(path)``."""
    plan.save(path)


def load_plan(path: str | Path) -> SavedPlan:
    """Read a plan written by ``Plan.save``; use it with ``memplan.optimize(model, plan=...)``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise FileNotFoundError(f"cannot read saved plan {str(p)!r}: {exc.strerror or exc}") from None
    return SavedPlan.from_json(text, str(p))


def as_saved(plan: "str | Path | SavedPlan | Plan") -> SavedPlan:
    """Whatever ``optimize(..., plan=...)`` was given, as a :class:`SavedPlan`."""
    if isinstance(plan, SavedPlan):
        return plan
    if isinstance(plan, Plan):
        return saved_from_plan(plan)
    return load_plan(plan)


def make_plan_from_saved(
    saved: SavedPlan,
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    budget: int | None,
    *,
    profile: DeviceProfile,
    measure_on: torch.device | None = None,
    scratch_on: torch.device | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    grad_norm: bool = False,
    max_grad_norm: float | None = None,
    accumulation: Accumulation | None = None,
    handout_bytes: int | None = None,
) -> tuple[Plan, Program]:
    """The counterpart of :func:`memplan.pipeline.plan.make_plan` that reuses ``saved`` instead of solving.

    A whole-step plan needs the optimizer it was made with (the same state bytes, learned
    again) and the same accumulation; its updates run where it placed them. A plan that made
    room for kernel scratch has it measured again on ``scratch_on`` (one that did not, not)."""
    where = saved.path or "the saved plan"
    _check_whole_step(saved, where, optimizer, max_grad_norm, accumulation)
    placement = saved.placement
    if handout_bytes is not None and placement is not None and (not placement.after_backward or placement.norm_pass):
        # under a distributed engine every update needs the reduced gradients: after backward
        raise PlanMismatchError(
            f"{where} runs the optimizer's updates in backward; under DistributedDataParallel they run after "
            "backward, on the averaged gradients: re-plan inside the DDP (or save a plan made there)")
    try:
        cap = capture_step(model, args, kwargs, output_use=saved.output_use)
    except ValueError as exc:  # those outputs' gradients are more than addends in this model
        raise PlanMismatchError(f"{where} was made for a different model: {exc}") from None
    saved.check(cap)  # before the eager replay: a mismatch should fail fast
    prepared = prepare_step(model, args, kwargs, profile=profile, optimizer=optimizer, measure_on=measure_on,
                            captured=cap)
    # (scratch a graph pass declared on its node is not measured: every plan counts it)
    declared = {SCRATCH_PREFIX + n.name for n in cap.graph_module.graph.nodes if SCRATCH_BYTES in n.meta}
    with_scratch = any(str(name).startswith(SCRATCH_PREFIX) and name not in declared for _, name in saved.schedule)
    analysis = analyze_step(prepared, profile, measure_on=measure_on, placement=saved.placement or UpdatePlacement(),
                            scratch_on=scratch_on if with_scratch else None)
    if optimizer is not None and analysis.all_optimizer_state_bytes != saved.optimizer_state_bytes:
        raise PlanMismatchError(
            f"{where} was made for an optimizer that keeps {format_bytes(saved.optimizer_state_bytes)} of state; "
            f"{type(optimizer).__name__} keeps {format_bytes(analysis.all_optimizer_state_bytes)} for this model: "
            "pass the optimizer the plan was made with, or re-plan"
        )
    plan = saved.bind(analysis, budget)
    return plan, build_step(analysis, plan.schedule, plan.simulated.timeline, model, optimizer, grad_norm,
                            max_grad_norm, accumulation, handout_bytes)


def _check_whole_step(saved: SavedPlan, where: str, optimizer: torch.optim.Optimizer | None,
                      max_grad_norm: float | None, accumulation: Accumulation | None) -> None:
    """Raise :class:`PlanMismatchError` unless the step's optimizer options are those ``saved`` was made for."""
    if saved.placement is None:
        if optimizer is not None:
            raise PlanMismatchError(f"{where} was made without an optimizer; re-plan with optimizer= to put its "
                                    "state and update in the budget")
        return
    if optimizer is None:
        raise PlanMismatchError(f"{where} plans the whole step with an optimizer's updates: pass optimizer= "
                                "(the one it was made with)")
    steps = accumulation.steps if accumulation is not None else 1
    if steps != saved.placement.accumulate_steps:
        raise PlanMismatchError(f"{where} was made for accumulate_steps={saved.placement.accumulate_steps}, "
                                f"not {steps}")
    if max_grad_norm is not None and not (saved.placement.after_backward or saved.placement.norm_pass):
        raise PlanMismatchError(f"{where} updates in backward, before every gradient is known: it cannot clip "
                                "the global norm (max_grad_norm=); re-plan with max_grad_norm")
