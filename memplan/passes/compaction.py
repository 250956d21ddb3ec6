"""Copy out a view that outlives the rest of its storage.

A view keeps its whole storage alive. The skip half of a concatenation's
gradient is the common case: ``cat``'s backward slices the incoming gradient,
the decoder half is read at once, and the encoder half waits until the
backward pass reaches the encoder, so eager PyTorch holds the whole gradient
until then. When every other reader of a storage is done and only a view of at
most half of it is still to be read, copying that view out (one ``clone``)
frees the rest at the price of one read and one write of the view.

`copy_out_late_views` rewrites the joint graph so: the copy is one more value
in the Problem, so every solver may still keep, free or recompute it like any
other, and the simulator counts its bytes like any other.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from memplan.core.storage import dense_tensors, storage_key
from memplan.core.config import TUNABLES



@dataclass(frozen=True)
class CopiedView:
    """One copy the rewrite made: ``view`` read late, copied to ``copy`` after ``after``."""

    view: str
    copy: str
    after: str
    view_bytes: int
    storage_bytes: int


def _single_dense(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) and val.layout == torch.strided else None


def _late_views(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, list[fx.Node], int, int]]:
    """(view, last read of the rest of its storage, the view's readers after it, view bytes, storage bytes)."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    members: dict[int, list[fx.Node]] = {}  # storage key -> the nodes whose value holds it, in order
    owner: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        for key in {storage_key(t) for t in dense_tensors(node.meta.get("val"))}:
            members.setdefault(key, []).append(node)
            owner.setdefault(key, node)
    found = []
    for key, holders in members.items():
        if owner[key].op != "call_function" or len(holders) < 3:
            continue  # inputs and tangents live all step anyway; a view needs a base and a sibling
        if any(user.op == "output" for h in holders for user in h.users):
            continue  # an output (or something saved for backward) keeps the storage to the end
        for view in holders[1:]:
            val = _single_dense(view)
            if val is None or view.op != "call_function" or any(u in holders for u in view.users):
                continue  # only a plain tensor read by ops, not viewed further, is copied
            storage = val.untyped_storage().nbytes()
            view_bytes = val.numel() * val.element_size()
            if not 0 < view_bytes <= TUNABLES.max_view_fraction * storage:
                continue
            rest = [u for h in holders if h is not view for u in h.users if u is not view]
            last_rest = max(rest, key=position.__getitem__, default=None)
            if last_rest is None or position[last_rest] < position[view]:
                continue
            late = [u for u in view.users if position[u] > position[last_rest]]
            if late:
                found.append((view, last_rest, late, view_bytes, storage))
    return found


def copy_out_late_views(gm: fx.GraphModule) -> list[CopiedView]:
    """Rewrite ``gm`` in place: each late-read view gets a copy made right after the
    rest of its storage is last read, and its later readers read the copy. Returns the copies."""
    copies = []
    for view, last_rest, late, view_bytes, storage in _late_views(gm):
        val = view.meta["val"]
        with gm.graph.inserting_after(last_rest):
            copy = gm.graph.create_node("call_function", torch.ops.aten.clone.default, (view,), name=f"{view.name}_copy")
        copy.meta.update({k: v for k, v in view.meta.items() if k != "val"})
        with detect_fake_mode([val]) or contextlib.nullcontext():
            copy.meta["val"] = torch.ops.aten.clone.default(val)
        for user in late:
            user.replace_input_with(view, copy)
        copies.append(CopiedView(view.name, copy.name, last_rest.name, view_bytes, storage))
    if copies:
        gm.recompile()
    return copies
