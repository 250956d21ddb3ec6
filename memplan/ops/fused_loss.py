"""``memplan::log_softmax_nll_backward``: cross-entropy's backward written into one buffer.

The op `memplan.passes.loss_fusion` puts in place of ``nll_loss_backward`` followed by
``_log_softmax_backward_data``. Its kernel writes the one-hot buffer, then turns it into the
gradient where it lies: on the CPU, where the ATen kernel sums a row before it writes any of
it, in one call over its input; elsewhere a block of rows at a time (one block is the op's
scratch, which `scratch_bytes` gives so that plans count it). The values are the two ops' to
the bit.
"""
from __future__ import annotations

from typing import Optional

import torch
from memplan.core.config import TUNABLES

aten = torch.ops.aten



def _block_rows(rows: int) -> int:
    return max(1, -(-rows // TUNABLES.loss_scratch_blocks))


def _over_its_input(device: torch.device) -> bool:
    """Whether the kernel writes the gradient over its input on ``device`` (else block by block)."""
    return device.type == "cpu"


def scratch_bytes(val: torch.Tensor) -> int:
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
    """The op's kernel, which the eager runtime calls straight (`memplan.ops.kernels.eager_kernel`), so that
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
