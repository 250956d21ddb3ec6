"""Graph pass: cross-entropy's backward in one buffer.

``F.cross_entropy`` traces as ``_log_softmax`` and ``nll_loss_forward``; its backward as
``nll_loss_backward``, a buffer of the logits' size that is zero but for one entry a row, and
``_log_softmax_backward_data``, which reads that buffer and the log-probabilities and writes a
third. For a language model the logits are the step's largest tensor (GPT small: 2048 rows of a
4096-word vocabulary, 33.6 MB), and the backward's start holds three of them at once: the
log-probabilities, the one-hot buffer and the gradient. That is where the whole step peaks, so
the loss alone decides how much a plan must recompute elsewhere: at half of GPT small's eager
peak, 100 of 163 MB.

`fuse_cross_entropy_backward` rewrites each such pair as one op, ``memplan::log_softmax_nll_backward``,
whose kernel writes the one-hot buffer and then turns it into the gradient where it lies. On the
CPU the ATen kernel writes over its input (it sums a row before it writes any of it, then makes
each entry from the same entry): the same values, one call, no scratch (GPT small's loss
backward: 21 ms against 32 ms for the two ops, whose second buffer is fresh memory). Elsewhere,
where that is not checked here, a block of rows at a time: each block's gradient is the ATen
kernel's on those rows (a row's sum and its entries read that row alone), copied back over the
block it was made from, with no assumption on how a kernel treats an output that aliases its
input; one block (`memplan.core.config.Tunables.loss_scratch_blocks`) is the op's scratch, which the node declares
(`memplan.core.storage.SCRATCH_BYTES`) so that plans count it. Either way the values are the two ops'
to the bit (`tests/memplan/test_loss_fusion.py`), and the step holds two logits-size buffers
where it held three.

Inductor calls the op as a kernel of its own; a log-softmax backward whose gradient comes from
anything else (label smoothing, a weighted sum of losses), or in another dtype than its input's
(``half_to_float``), stays as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from memplan.core.storage import SCRATCH_BYTES
from memplan.ops.fused_loss import scratch_bytes

aten = torch.ops.aten

@dataclass(frozen=True)
class FusedLossBackward:
    """One loss backward the pass fused: the two nodes it replaced, and the node that replaced them."""

    nll_backward: str
    log_softmax_backward: str
    fused: str


def _fusable(node: fx.Node) -> bool:
    """Whether ``node`` is a log-softmax backward of 2-D contiguous log-probabilities over their
    classes, in their own dtype, whose gradient is an NLL backward read by nothing else."""
    if node.op != "call_function" or node.target is not aten._log_softmax_backward_data.default:
        return False
    grad, output, dim, input_dtype = node.args
    if not (isinstance(grad, fx.Node) and grad.target is aten.nll_loss_backward.default
            and len(grad.users) == 1 and isinstance(output, fx.Node)):
        return False
    vals = [n.meta.get("val") for n in (grad, output, node)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    g, out, result = vals
    return (out.dim() == 2 and dim in (1, -1) and out.is_contiguous() and out.numel() > 0
            and out.dtype.is_floating_point and input_dtype == out.dtype
            and g.shape == out.shape == result.shape and g.dtype == out.dtype == result.dtype)


def fuse_cross_entropy_backward(gm: fx.GraphModule) -> list[FusedLossBackward]:
    """Rewrite ``gm`` in place (see the module docstring); returns the loss backwards fused."""
    fused = []
    for node in list(gm.graph.nodes):
        if not _fusable(node):
            continue
        nll = node.args[0]
        grad_output, _, target, weight, reduction, ignore_index, total_weight = nll.args
        _, output, dim, input_dtype = node.args
        with gm.graph.inserting_before(node):
            # (the NLL backward reads its input's shape only: the log-probabilities stand for it)
            new = gm.graph.create_node(
                "call_function", torch.ops.memplan.log_softmax_nll_backward.default,
                (grad_output, target, weight, reduction, ignore_index, total_weight, output, dim, input_dtype),
                name=f"{node.name}_fused")
        val = node.meta["val"]
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"}, val=val)
        if scratch_bytes(val):
            new.meta[SCRATCH_BYTES] = scratch_bytes(val)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(nll)
        fused.append(FusedLossBackward(nll.name, node.name, new.name))
    if fused:
        gm.recompile()
    return fused
