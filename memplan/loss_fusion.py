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
input; one block (`SCRATCH_BLOCKS`) is the op's scratch, which the node declares
(`memplan.storage.SCRATCH_BYTES`) so that plans count it. Either way the values are the two ops'
to the bit (`tests/memplan/test_loss_fusion.py`), and the step holds two logits-size buffers
where it held three.

Inductor calls the op as a kernel of its own; a log-softmax backward whose gradient comes from
anything else (label smoothing, a weighted sum of losses), or in another dtype than its input's
(``half_to_float``), stays as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from memplan.storage import SCRATCH_BYTES

aten = torch.ops.aten

# The gradient is made this many blocks of rows at a time: one block's bytes are the op's scratch.
SCRATCH_BLOCKS = 32


@dataclass(frozen=True)
class FusedLossBackward:
    """One loss backward the pass fused: the two nodes it replaced, and the node that replaced them."""

    nll_backward: str
    log_softmax_backward: str
    fused: str


def _block_rows(rows: int) -> int:
    return max(1, -(-rows // SCRATCH_BLOCKS))


def _over_its_input(device: torch.device) -> bool:
    """Whether the kernel writes the gradient over its input on ``device`` (else block by block)."""
    return device.type == "cpu"


def _scratch_bytes(val: torch.Tensor) -> int:
    """What `fused_kernel` allocates beside the buffer it returns, for a result like ``val``."""
    return 0 if _over_its_input(val.device) else _block_rows(val.shape[0]) * val.shape[1] * val.element_size()


@torch.library.custom_op("memplan::log_softmax_nll_backward", mutates_args=())
def log_softmax_nll_backward(
    grad_output: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], reduction: int,
    ignore_index: int, total_weight: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype,
) -> torch.Tensor:
    """``_log_softmax_backward_data(nll_loss_backward(grad_output, output, target, weight, reduction,
    ignore_index, total_weight), output, dim, input_dtype)`` for 2-D log-probabilities ``output``
    whose classes are ``dim`` 1, in one buffer (see the module docstring)."""
    return fused_kernel(grad_output, target, weight, reduction, ignore_index, total_weight, output, dim, input_dtype)


def fused_kernel(grad_output, target, weight, reduction, ignore_index, total_weight, output, dim, input_dtype):
    """The op's kernel, which the eager runtime calls straight (`memplan.kernels.eager_kernel`), so that
    a step's memory tracker sees what it allocates."""
    grad = aten.nll_loss_backward.default(grad_output, output, target, weight, reduction, ignore_index,
                                          total_weight)
    if _over_its_input(grad.device):
        return softmax_backward_over_its_input(grad, output, dim, input_dtype)
    return softmax_backward_block_by_block(grad, output, dim, input_dtype)


def softmax_backward_over_its_input(grad: torch.Tensor, output: torch.Tensor, dim: int,
                                    input_dtype: torch.dtype) -> torch.Tensor:
    """``_log_softmax_backward_data(grad, output, dim, input_dtype)`` written over ``grad``: the CPU
    kernel sums a row before it writes the row, and then makes each entry from the same entry of
    its input, so its values are the op's; one call and no scratch (block by block took 32 calls:
    1.1 ms against 0.7 ms on 4 MB of logits)."""
    return aten._log_softmax_backward_data.out(grad, output, dim, input_dtype, out=grad)


def softmax_backward_block_by_block(grad: torch.Tensor, output: torch.Tensor, dim: int,
                                    input_dtype: torch.dtype) -> torch.Tensor:
    """``_log_softmax_backward_data(grad, output, dim, input_dtype)`` into ``grad``, `_block_rows` rows
    at a time (each block the kernel's own result on those rows, copied back over them), whatever
    the kernel does with an output that aliases its input; one block is the scratch."""
    step = _block_rows(grad.shape[0])
    for start in range(0, grad.shape[0], step):
        rows = slice(start, start + step)
        grad[rows].copy_(aten._log_softmax_backward_data.default(grad[rows], output[rows], dim, input_dtype))
    return grad


@log_softmax_nll_backward.register_fake
def _log_softmax_nll_backward_fake(grad_output, target, weight, reduction, ignore_index, total_weight, output,
                                   dim, input_dtype):
    return torch.empty_like(output, memory_format=torch.contiguous_format)


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
        if _scratch_bytes(val):
            new.meta[SCRATCH_BYTES] = _scratch_bytes(val)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(nll)
        fused.append(FusedLossBackward(nll.name, node.name, new.name))
    if fused:
        gm.recompile()
    return fused
