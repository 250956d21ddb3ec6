"""Measure the runtime of every op of a joint graph on the real device (``profile=True``).

The roofline in :mod:`memplan.costs` is a guess; this runs each ATen node
once more on real tensors of the right shapes and takes the median of a few
timings. Inputs are made from the fake values' metadata: floating tensors
are random normal, integer and boolean tensors zero (a valid index for any
embedding or gather). Only one node's inputs and outputs are alive at a
time, so profiling needs no more memory than the largest single op.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


def _materialize(val: Any, device: torch.device) -> Any:
    def make(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        if out.is_floating_point() or out.is_complex():
            out.normal_()
        else:
            out.zero_()
        return out

    return pytree.tree_map_only(torch.Tensor, make, val)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_op_times(
    gm: fx.GraphModule,
    device: torch.device | str,
    *,
    repeats: int = 3,
    skip: set[str] | None = None,
) -> dict[str, float]:
    """Median seconds of each ``call_function`` node of ``gm`` on ``device``.

    Nodes in ``skip`` (views, getitems: they move no data) are not timed.
    An op that fails on synthetic inputs (one that checks values, not just
    shapes) is left out; the caller keeps its roofline estimate.
    """
    device = torch.device(device)
    skip = skip or set()
    times: dict[str, float] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.name in skip:
                continue
            args, kwargs = pytree.tree_map_only(
                fx.Node, lambda n: _materialize(n.meta.get("val"), device), (node.args, node.kwargs)
            )
            try:
                node.target(*args, **kwargs)  # warm-up: first-call allocations, kernel selection
                samples = []
                for _ in range(repeats):
                    _sync(device)
                    start = time.perf_counter()
                    node.target(*args, **kwargs)
                    _sync(device)
                    samples.append(time.perf_counter() - start)
            except Exception:  # noqa: BLE001 - value-checking ops keep their estimate
                continue
            times[node.name] = statistics.median(samples)
    return times
