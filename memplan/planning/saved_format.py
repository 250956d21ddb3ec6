"""The file format of a saved plan: what it records about a :class:`~memplan.pipeline.plan.Plan`, as JSON.

A plan is only meaningful for the joint graph it was solved on: the schedule
names that graph's nodes. So a saved plan records two signatures, both read
off the capture (never off the device: a plan made for a model built on the
meta device is reused for the same model on the CPU):

* the *input signature*: the structure, shapes, dtypes and ``requires_grad``
  of the inputs, their non-tensor leaves, and the training flag;
* the *graph signature*: a hash of every joint-graph node's name, op, target,
  arguments and output shapes and dtypes, which covers the parameters too.

This module writes and reads the document (``Plan.save`` writes through it);
:mod:`memplan.pipeline.saved` turns it into a :class:`~memplan.pipeline.saved.SavedPlan` and
checks and reuses that against a fresh capture.
"""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

import solvers
from memplan.updates.probe import UpdatePlacement
from memplan.passes.output_use import OutputUse

if TYPE_CHECKING:
    from memplan.capture.signature import Capture

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


def count_params(cap: Capture) -> int:
    """Parameter elements of the captured model (for error messages)."""
    vals = [n.meta.get("val") for n, info in zip(cap.placeholders(), cap.primals) if info.kind == "param"]
    return sum(v.numel() for v in vals if isinstance(v, torch.Tensor))


# --------------------------------------------------------------------------- #
# The document
# --------------------------------------------------------------------------- #


def record_to_json(record: dict[str, Any]) -> str:
    """The JSON document of a record (as ``Plan.record`` makes it)."""
    data = {
        "format": FORMAT,
        "version": VERSION,
        "num_params": record["num_params"],
        "inputs": record["inputs"],
        "num_nodes": record["num_nodes"],
        "graph_signature": record["graph_signature"],
        "input_signature": record["input_signature"],
        "budget": record["budget"],
        "predicted_peak": record["predicted_peak"],
        "predicted_time": record["predicted_time"],
        "method": record["method"],
        "status": record["status"],
        "lower_bound": record["lower_bound"],
        "solve_time": record["solve_time"],
        "torch_version": torch.__version__,
        "no_grad_outputs": sorted(record["output_use"].no_grad),
        "dropped_outputs": sorted(record["output_use"].dropped),
        "dropped_inputs": sorted(record["output_use"].inputs_dropped),
        "schedule": record["schedule"].to_list(),
    }
    placement = record.get("placement")
    if placement is not None:  # a whole-step plan: where the optimizer's updates run, what state they keep
        data["optimizer"] = {
            "state_bytes": record["optimizer_state_bytes"],
            "after_backward": placement.after_backward,
            "host": sorted(placement.host),
            "accumulate_steps": placement.accumulate_steps,
            "norm_pass": placement.norm_pass,
            "bucket_bytes": placement.bucket_bytes,
        }
    return json.dumps(data, indent=1)


def record_from_json(text: str, where: str = "document") -> dict[str, Any]:
    """The record a JSON document holds (the inverse of :func:`record_to_json`).

    Raises :class:`PlanMismatchError`, naming ``where``, for anything but a saved
    plan of this format version.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanMismatchError(f"{where} is not a saved memplan plan (not JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanMismatchError(f"{where} is not a saved memplan plan (no format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise PlanMismatchError(f"{where} has plan format version {data.get('version')}; this memplan reads {VERSION}")
    try:
        return dict(
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
            output_use=OutputUse(frozenset(int(i) for i in data.get("no_grad_outputs", [])),
                                 frozenset(int(i) for i in data.get("dropped_outputs", [])),
                                 frozenset(int(i) for i in data.get("dropped_inputs", []))),
            **_optimizer_fields(data.get("optimizer")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanMismatchError(f"{where} is a damaged memplan plan: {type(exc).__name__}: {exc}") from None


def _optimizer_fields(data: dict | None) -> dict[str, Any]:
    """The record's whole-step fields from a document's ``optimizer`` entry (absent: a plan
    made without an optimizer)."""
    if data is None:
        return {}
    return dict(
        placement=UpdatePlacement(after_backward=bool(data["after_backward"]),
                                  host=frozenset(str(n) for n in data.get("host", [])),
                                  accumulate_steps=int(data.get("accumulate_steps", 1)),
                                  norm_pass=bool(data.get("norm_pass", False)),
                                  # a plan saved before buckets: one call per parameter
                                  bucket_bytes=int(data.get("bucket_bytes", 0))),
        optimizer_state_bytes=int(data["state_bytes"]),
    )
