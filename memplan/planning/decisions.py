"""What a schedule does with each value: kept, computed again, or paged to host memory and back.

The report's view of a solved schedule (`memplan.pipeline.plan.Plan`): a `ValueDecision` per value
computed, a `Transfer` per value paged out, and the bytes of the parameters it fetches.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import solvers
from memplan.passes.paging import FETCH
from memplan.planning.analysis import Analysis
from memplan.planning.lowering import BACKWARD, is_reference


@dataclass
class ValueDecision:
    """What the plan does with one value computed in forward and needed in backward."""

    name: str
    nbytes: int
    decision: str  # "keep" | "recompute" | "offload"
    computations: int


@dataclass
class Transfer:
    """One value the plan pages out to host memory and back, with predicted times (seconds into the step)."""

    name: str
    nbytes: int
    out_after: str  # the compute after which its copy to host starts
    out_time: float
    back_before: str | None  # the first compute that reads it after it comes back (None: never read again)
    back_time: float | None  # when its copy back starts


def value_decisions(analysis: Analysis, schedule: "solvers.Schedule") -> list[ValueDecision]:
    """What ``schedule`` does with each value the joint graph computes (once at least)."""
    low = analysis.lowered
    computes = Counter(str(node) for op, node in schedule if op == "compute")
    offloaded = {str(node) for op, node in schedule if op == "offload"}
    out = []
    for name, node in low.fx_nodes.items():
        if node.op != "call_function" or is_reference(name) or name == BACKWARD or name in low.norm_pass:
            continue
        n = computes.get(name, 0)
        if n == 0:
            continue
        decision = "offload" if name in offloaded else "recompute" if n > 1 else "keep"
        out.append(ValueDecision(name, analysis.costs.values[name].new_bytes, decision, n))
    return out


def transfers_of(problem: "solvers.Problem", schedule: "solvers.Schedule", clock) -> list[Transfer]:
    """Each offloaded value: after which compute it leaves, before which it comes back, and when."""
    steps = [(op.value, str(node)) for op, node in schedule]
    out = []
    for k, (op, name) in enumerate(steps):
        if op != "offload":
            continue
        before = next((n for o, n in reversed(steps[:k]) if o == "compute"), "start")
        back_at = next((j for j in range(k + 1, len(steps)) if steps[j] == ("prefetch", name)), None)
        back_before, back_time = None, None
        if back_at is not None:
            reader = problem.index[name]
            succs = {str(problem.names[s]) for s in problem.succs[reader]}
            back_before = next((n for o, n in steps[back_at + 1:] if o == "compute" and n in succs), None)
            back_time = float(clock[back_at - 1]) if back_at > 0 else 0.0
        out_time = float(clock[k - 1]) if k > 0 else 0.0
        out.append(Transfer(name, int(problem.mem[problem.index[name]]), before, out_time, back_before, back_time))
    return out


def fetched_bytes(analysis: Analysis, schedule: "solvers.Schedule") -> int:
    """Bytes of paged parameters ``schedule`` fetches to the device in a step (`memplan.passes.paging`),
    each fetch of each counted."""
    nodes, values = analysis.lowered.fx_nodes, analysis.costs.values
    return sum(values[name].nbytes for op, name in schedule
               if op == "compute" and name in nodes and nodes[name].target is FETCH)
