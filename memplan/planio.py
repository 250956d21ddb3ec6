"""Saved plans: write a solved :class:`~memplan.plan.Plan` to JSON and reuse it without solving.

A plan is only meaningful for the joint graph it was solved on: the schedule
names that graph's nodes. So a saved plan records two signatures, both read
off the capture (never off the device: a plan made for a model built on the
meta device is reused for the same model on the CPU):

* the *input signature*: the structure, shapes, dtypes and ``requires_grad``
  of the inputs, their non-tensor leaves, and the training flag;
* the *graph signature*: a hash of every joint-graph node's name, op, target,
  arguments and output shapes and dtypes, which covers the parameters too.

Loading checks both against a fresh capture, then replays the schedule
through ``solvers.validate`` on the freshly lowered Problem under the budget
in force, so a stale or edited file can never run unchecked.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

import solvers
from memplan.analysis import Analysis, analyze_capture, replay_eager_peak_of
from memplan.capture import Capture, capture
from memplan.costs import DeviceProfile
from memplan.output_use import OutputUse
from memplan.plan import Plan, format_bytes, plan_from_schedule
from memplan.runtime import Program, build_program

FORMAT = "memplan.Plan"
VERSION = 1


class PlanMismatchError(ValueError):
    """A saved plan does not belong to this model, these inputs, or this budget."""


# --------------------------------------------------------------------------- #
# Signatures
# --------------------------------------------------------------------------- #


def _describe_val(val: Any) -> Any:
    """Shape and dtype of a node's value (device left out on purpose), nested like the value."""
    if isinstance(val, torch.Tensor):
        return [str(val.dtype).removeprefix("torch."), list(val.shape)]
    if isinstance(val, (list, tuple)):
        return [_describe_val(v) for v in val]
    return repr(val) if isinstance(val, (int, float, bool)) or val is None else type(val).__name__


def graph_signature(cap: Capture) -> str:
    """Hex digest over the joint graph: node names, ops, targets, arguments, value shapes/dtypes."""
    h = hashlib.sha256()
    for node in cap.graph.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}")
        entry = [node.name, node.op, str(node.target), repr(args), _describe_val(node.meta.get("val"))]
        h.update(json.dumps(entry, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def describe_inputs(cap: Capture) -> list[str]:
    """One readable line per input tensor, e.g. ``input[0]: int64[8, 1024]``."""
    lines = []
    placeholders = cap.placeholders()
    for node, info in zip(placeholders, cap.primals):
        if info.kind != "input":
            continue
        val = node.meta.get("val")
        shape = ", ".join(str(d) for d in val.shape) if isinstance(val, torch.Tensor) else "?"
        dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "?"
        grad = " (requires grad)" if info.requires_grad else ""
        lines.append(f"{info.name}: {dtype}[{shape}]{grad}")
    return lines


def input_signature(cap: Capture) -> str:
    """Hex digest of what the plan assumes about the call: input structure, tensors, constants, mode."""
    training = cap.signature.key[2]
    parts = [str(cap.input_spec), repr(cap.input_constants), describe_inputs(cap), f"training={training}"]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


# --------------------------------------------------------------------------- #
# The saved plan
# --------------------------------------------------------------------------- #


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

    def to_json(self) -> str:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "num_params": self.num_params,
            "inputs": self.inputs,
            "num_nodes": self.num_nodes,
            "graph_signature": self.graph_signature,
            "input_signature": self.input_signature,
            "budget": self.budget,
            "predicted_peak": self.predicted_peak,
            "predicted_time": self.predicted_time,
            "method": self.method,
            "status": self.status,
            "lower_bound": self.lower_bound,
            "solve_time": self.solve_time,
            "torch_version": torch.__version__,
            "no_grad_outputs": sorted(self.output_use.no_grad),
            "dropped_outputs": sorted(self.output_use.dropped),
            "schedule": self.schedule.to_list(),
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, path: str | None = None) -> "SavedPlan":
        where = path or "document"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatchError(f"{where} is not a saved memplan plan (not JSON: {exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanMismatchError(f"{where} is not a saved memplan plan (no format {FORMAT!r})")
        if data.get("version") != VERSION:
            raise PlanMismatchError(f"{where} has plan format version {data.get('version')}; this memplan reads {VERSION}")
        try:
            return cls(
                budget=int(data["budget"]),
                predicted_peak=int(data["predicted_peak"]),
                predicted_time=float(data["predicted_time"]),
                method=str(data["method"]),
                status=str(data["status"]),
                lower_bound=None if data.get("lower_bound") is None else float(data["lower_bound"]),
                solve_time=float(data.get("solve_time", 0.0)),
                graph_signature=str(data["graph_signature"]),
                input_signature=str(data["input_signature"]),
                inputs=list(data.get("inputs", [])),
                num_nodes=int(data.get("num_nodes", 0)),
                num_params=int(data.get("num_params", 0)),
                schedule=solvers.Schedule.from_list(data["schedule"]),
                path=path,
                output_use=OutputUse(frozenset(int(i) for i in data.get("no_grad_outputs", [])),
                                     frozenset(int(i) for i in data.get("dropped_outputs", []))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanMismatchError(f"{where} is a damaged memplan plan: {type(exc).__name__}: {exc}") from None

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
            nodes, params = _num_nodes(cap), _num_params(cap)
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


def _num_nodes(cap: Capture) -> int:
    return sum(1 for n in cap.graph.nodes if n.op == "call_function")


def _num_params(cap: Capture) -> int:
    vals = [n.meta.get("val") for n, info in zip(cap.placeholders(), cap.primals) if info.kind == "param"]
    return sum(v.numel() for v in vals if isinstance(v, torch.Tensor))


def saved_from_plan(plan: Plan) -> SavedPlan:
    cap = plan.analysis.capture
    return SavedPlan(
        budget=plan.budget,
        predicted_peak=plan.predicted_peak,
        predicted_time=plan.predicted_time,
        method=plan.method,
        status=plan.status,
        lower_bound=plan.lower_bound,
        solve_time=plan.solve_time,
        graph_signature=graph_signature(cap),
        input_signature=input_signature(cap),
        inputs=describe_inputs(cap),
        num_nodes=_num_nodes(cap),
        num_params=_num_params(cap),
        schedule=plan.schedule,
        output_use=cap.output_use,
    )


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` to ``path`` as JSON (see :func:`load_plan`)."""
    Path(path).write_text(saved_from_plan(plan).to_json())


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
) -> tuple[Plan, Program]:
    """The counterpart of :func:`memplan.plan.make_plan` that reuses ``saved`` instead of solving."""
    try:
        cap = capture(model, args, kwargs, output_use=saved.output_use)
    except ValueError as exc:  # those outputs' gradients are more than addends in this model
        raise PlanMismatchError(f"{saved.path or 'the saved plan'} was made for a different model: {exc}") from None
    saved.check(cap)  # before the eager replay: a mismatch should fail fast
    analysis = analyze_capture(cap, profile, replay_eager_peak_of(cap, model, args, kwargs), measure_on)
    plan = saved.bind(analysis, budget)
    return plan, build_program(cap, analysis.lowered, plan.schedule)
