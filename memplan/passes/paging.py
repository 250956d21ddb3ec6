"""Page parameters: each lives in host memory between its uses.

A parameter is a source of the step: resident from its start to its end. Paged, its
placeholder holds no device memory (the parameter is in host memory, its optimizer state
and update there too), and `page_parameters` gives it one *fetch* (`memplan.ops.transfer.
fetch_parameter`) that every op reading the parameter reads instead. The fetch is one more
value of the joint graph, so the solve that decides recomputation decides the paging too: it
keeps the copy made for the forward until the backward, or frees it and fetches it again
(a recomputation whose cost is the parameter's bytes over the host link), as the budget asks.
ZeRO-Infinity fetches every parameter twice, always.

The update writes the host parameter in place after its last read (`memplan.planning.lowering`
orders every update after its parameter's last reader, a fetch made again included), and the
copies already fetched hold the values the backward must read: eager's.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from memplan.ops.transfer import fetch_parameter

PAGED = "memplan_paged"  # meta key: this placeholder's parameter lives in host memory
FETCH = torch.ops.memplan.fetch_parameter.default


@dataclass(frozen=True)
class PagedParameter:
    """One parameter paged: its placeholder and the fetch its readers read."""

    placeholder: str
    fetch: str
    nbytes: int


def is_paged(node: fx.Node) -> bool:
    """Whether ``node`` is the placeholder of a parameter that lives in host memory."""
    return bool(node.meta.get(PAGED))


def page_parameters(gm: fx.GraphModule, placeholders: Iterable[fx.Node]) -> list[PagedParameter]:
    """Rewrite ``gm`` in place: each of ``placeholders`` (parameters' placeholders) is marked as
    living in host memory, and (where it is read) gets a fetch right before its first reader,
    which every reader but the graph's output reads instead. A placeholder paged already is left
    as it is. Returns the fetches made."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    paged = []
    for node in placeholders:
        val = node.meta.get("val")
        readers = [u for u in node.users if u.op != "output"]
        if is_paged(node) or not isinstance(val, torch.Tensor):
            continue
        node.meta[PAGED] = True  # (in host memory, read or not)
        if not readers:
            continue
        first = min(readers, key=position.__getitem__)
        with gm.graph.inserting_before(first):
            fetch = gm.graph.create_node("call_function", FETCH, (node, val.device), name=f"{node.name}_fetch")
        with detect_fake_mode([val]) or contextlib.nullcontext():
            fetch.meta["val"] = fetch_parameter(val, val.device)
        for reader in readers:
            reader.replace_input_with(node, fetch)
        paged.append(PagedParameter(node.name, fetch.name, val.untyped_storage().nbytes()))
    if paged:
        gm.recompile()
    return paged


def with_paged(gm: fx.GraphModule, names: Iterable[str]) -> fx.GraphModule:
    """A copy of ``gm`` whose placeholders named ``names`` are paged (`page_parameters`), ``gm``
    left as it is. The nodes are copied, their metadata dicts too, the values in them (fake
    tensors) shared: the copy costs a pass over the graph, not a capture."""
    graph = copy.deepcopy(gm.graph)
    copied = fx.GraphModule(gm, graph)
    wanted = set(names)
    page_parameters(copied, [node for node in graph.find_nodes(op="placeholder") if node.name in wanted])
    return copied


def paged_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the parameters ``gm`` keeps in host memory (each storage once)."""
    storages = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if is_paged(node) and isinstance(val, torch.Tensor):
            storages[id(val.untyped_storage())] = val.untyped_storage().nbytes()
    return sum(storages.values())
