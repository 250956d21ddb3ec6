"""``memplan.analyze``: what one training step of an unmodified model costs.

Captures the joint graph on fake tensors (nothing allocated), puts costs on
it, and predicts the peak of running it as eager PyTorch would: every value
kept from its computation to its last use, in graph order. The prediction
comes from the one simulator (``solvers.simulate``) over the store-all
schedule, the same arithmetic every plan is checked by.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import solvers
from memplan.capture import Capture, capture
from memplan.costs import DeviceProfile, GraphCosts, annotate, get_profile
from memplan.problem import Lowered, lower


@dataclass
class Analysis:
    """Sizes and predicted costs of one eager training step."""

    num_nodes: int  # ATen ops in the joint graph
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    activation_bytes: int  # storages the forward leaves for the backward (what autograd saves)
    eager_peak: int  # predicted peak bytes of one eager forward+backward
    flops: float  # total FLOPs of forward+backward
    predicted_time: float  # seconds, store-all, on the profile's device
    profile: DeviceProfile
    capture: Capture = field(repr=False)
    costs: GraphCosts = field(repr=False)
    lowered: Lowered = field(repr=False)
    store_all: "solvers.Solution" = field(repr=False)

    @property
    def graph_peak(self) -> int:
        """Predicted peak of executing the joint graph in order, freeing after last use."""
        return self.store_all.peak


def saved_activation_bytes(cap: Capture, costs: GraphCosts, low: Lowered) -> int:
    """Bytes of the distinct storages computed in forward and read in backward."""
    fwd: set[str] = set()
    storages: set[int] = set()
    seen_backward = False
    graph = low.graph
    for name in graph.nodes:
        if name in low.tangents or name == "__backward__":
            seen_backward = True
            continue
        if not seen_backward:
            if name in low.fx_nodes and low.fx_nodes[name].op == "call_function":
                fwd.add(name)
            continue
        for pred in graph.predecessors(name):
            if pred in fwd:
                storages.update(costs.values[pred].storages)
    return sum(costs.storage_bytes[s] for s in storages)


def analyze_capture(cap: Capture, profile: DeviceProfile) -> Analysis:
    costs = annotate(cap.graph_module, profile)
    low = lower(cap, costs)
    store_all = solvers.solve(low.problem, method="store_all")

    def kind_bytes(kind: str) -> int:
        names = [n.name for n, p in zip(cap.placeholders(), cap.primals) if p.kind == kind]
        return sum(costs.values[n].nbytes for n in names)

    return Analysis(
        num_nodes=sum(1 for n in cap.graph.nodes if n.op == "call_function"),
        param_bytes=kind_bytes("param"),
        buffer_bytes=kind_bytes("buffer"),
        input_bytes=kind_bytes("input"),
        activation_bytes=saved_activation_bytes(cap, costs, low),
        eager_peak=store_all.peak,
        flops=costs.total_flops(),
        predicted_time=store_all.cost,
        profile=profile,
        capture=cap,
        costs=costs,
        lowered=low,
        store_all=store_all,
    )


def analyze(
    model: torch.nn.Module,
    example_inputs: Any = (),
    example_kwargs: dict | None = None,
    *,
    device_profile: str | DeviceProfile | None = None,
) -> Analysis:
    """Capture ``model`` on fake tensors and predict its eager step's memory and time."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    cap = capture(model, example_inputs, example_kwargs)
    return analyze_capture(cap, get_profile(device_profile, device))
