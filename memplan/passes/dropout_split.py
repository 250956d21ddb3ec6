"""Graph pass: a CPU dropout as its mask's draw and a multiply.

``aten.native_dropout`` returns its output and the bool mask it drew; the backward reads the
mask. As one op it is random throughout, so a plan that drops its output and needs it again
replays the op from the generator state of its first run: the whole mask drawn again (on the
CPU about 85% of the op's time, ten times a multiply) and a Python step between compiled runs.

`split_dropouts` rewrites each CPU dropout of a contiguous floating-point input in training as
two ops of `memplan.ops.kernels`: ``memplan::dropout_mask`` (the random draw, exactly the op's) and
``memplan::dropout_apply`` (``x * mask * scale``, deterministic). The mask is a quarter of the
output's bytes and backward reads it anyway, so a plan keeps it and recomputes the output by one
multiply, which a compiled run fuses with the ops around it. Values, masks and the generator's
state stay the op's to the bit (`tests/memplan/test_dropout_split.py`). CUDA's dropout is one fused
kernel that draws otherwise; it stays as it is.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from memplan.ops.kernels import drawn_as_the_op

aten = torch.ops.aten


@dataclass(frozen=True)
class SplitDropout:
    """One dropout the pass split: its node's name, and its two nodes' (``apply`` None where
    nothing read the output)."""

    dropout: str
    mask: str
    apply: str | None


def _splittable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.native_dropout.default:
        return False
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return (isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype.is_floating_point
            and drawn_as_the_op(val, train) and all(u.target is operator.getitem for u in node.users))


def split_dropouts(gm: fx.GraphModule) -> list[SplitDropout]:
    """Rewrite ``gm`` in place (see the module docstring); returns the dropouts split."""
    split = []
    for node in list(gm.graph.nodes):
        if not _splittable(node):
            continue
        x, p = node.args[0], node.args[1]
        items = list(node.users)
        out_val, mask_val = node.meta["val"]
        meta = {k: v for k, v in node.meta.items() if k != "val"}
        with gm.graph.inserting_before(node):
            mask = gm.graph.create_node("call_function", torch.ops.memplan.dropout_mask.default, (x, p),
                                        name=f"{node.name}_mask")
            mask.meta.update(meta, val=mask_val)
            out = None
            if any(item.args[1] == 0 for item in items):  # (an output nobody reads is not made)
                out = gm.graph.create_node("call_function", torch.ops.memplan.dropout_apply.default, (x, mask, p),
                                           name=f"{node.name}_apply")
                out.meta.update(meta, val=out_val)
        for item in items:
            item.replace_all_uses_with(out if item.args[1] == 0 else mask)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        split.append(SplitDropout(node.name, mask.name, out.name if out is not None else None))
    if split:
        gm.recompile()
    return split
