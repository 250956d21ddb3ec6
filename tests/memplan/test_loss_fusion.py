"""Cross-entropy's backward in one buffer (`memplan.passes.loss_fusion`): the two ops' values to the bit,
a step that holds one logits-size buffer less, and plans that train as eager with it."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import memplan
from memplan import WithLoss
from memplan.core.config import TUNABLES
from memplan.ops.fused_loss import softmax_backward_block_by_block, softmax_backward_over_its_input
from memplan.passes.loss_fusion import fuse_cross_entropy_backward
from memplan.measure.tracker import measure_peak

from .helpers import assert_close_step, assert_same_step, twin

aten = torch.ops.aten
FUSED = torch.ops.memplan.log_softmax_nll_backward.default


def _loss_backward(grad, logits, target, weight, reduction, ignore_index):
    """Cross-entropy's forward and backward as the joint graph holds them."""
    logp = aten._log_softmax.default(logits, 1, False)
    loss, total = aten.nll_loss_forward.default(logp, target, weight, reduction, ignore_index)
    g = aten.nll_loss_backward.default(grad, logp, target, weight, reduction, ignore_index, total)
    return loss, aten._log_softmax_backward_data.default(g, logp.detach(), 1, logp.dtype)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", [0, 1, 2])  # none, mean, sum
@pytest.mark.parametrize("rows", [1, 7, 2 * TUNABLES.loss_scratch_blocks + 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_fused_backward_computes_the_two_ops_bit_for_bit(dtype, reduction, rows, weighted):
    """Class weights, ignored rows, every reduction, row counts below, at and between block sizes:
    the fused op's gradient equals ``_log_softmax_backward_data(nll_loss_backward(...))``."""
    torch.manual_seed(0)
    classes = 37
    logits = (torch.randn(rows, classes) * 4).to(dtype)
    target = torch.randint(0, classes, (rows,))
    target[::3] = -100
    weight = torch.rand(classes, dtype=dtype) if weighted else None
    grad = torch.randn(rows if reduction == 0 else (), dtype=dtype)
    gm = make_fx(_loss_backward)(grad, logits, target, weight, reduction, -100)
    loss, expected = gm(grad, logits, target, weight, reduction, -100)
    fused = fuse_cross_entropy_backward(gm)
    assert len(fused) == 1
    targets = _targets(gm)
    assert FUSED in targets
    assert aten.nll_loss_backward.default not in targets and aten._log_softmax_backward_data.default not in targets
    got_loss, got = gm(grad, logits, target, weight, reduction, -100)
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.is_contiguous()
    for a, b in ((got_loss, loss), (got, expected)):  # (NaN where every row is ignored)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [1, TUNABLES.loss_scratch_blocks - 1, 3 * TUNABLES.loss_scratch_blocks + 5])
@pytest.mark.parametrize("way", [softmax_backward_over_its_input, softmax_backward_block_by_block])
def test_both_ways_of_making_the_gradient_where_it_lies_are_the_kernel_bit_for_bit(dtype, rows, way):
    """Over its input (the CPU's way) and block by block (elsewhere; run here on the CPU): the
    log-softmax backward's values, written into the buffer it read, which is what is returned."""
    torch.manual_seed(1)
    logp = torch.log_softmax(torch.randn(rows, 300) * 3, 1).to(dtype)
    grad = torch.randn(rows, 300, dtype=dtype)
    expected = aten._log_softmax_backward_data.default(grad, logp, 1, dtype)
    got = way(grad, logp, 1, dtype)
    assert got.data_ptr() == grad.data_ptr()
    assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def _smoothed(logits, target):
    return F.cross_entropy(logits, target, label_smoothing=0.1)


def _upcast(logits, target):
    return F.nll_loss(torch.log_softmax(logits, 1, dtype=torch.float32), target)


@pytest.mark.parametrize("loss, fusable", [(_smoothed, False), (_upcast, True)])
def test_only_a_log_softmax_backward_fed_by_the_nll_backward_alone_is_fused(loss, fusable):
    """Label smoothing (the gradient is a sum of two backwards) keeps the ops; a bfloat16 model's
    loss taken in float32 (a copy up, then the log-softmax in float32) is fused. Gradients are the
    unfused graph's to the bit either way."""
    logits = torch.randn(8, 11, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 11, (8,))

    def step(logits, target):
        return torch.autograd.grad(loss(logits, target), logits)

    gm = make_fx(step)(logits, target)
    (expected,) = gm(logits, target)
    assert len(fuse_cross_entropy_backward(gm)) == int(fusable)
    assert (FUSED in _targets(gm)) == fusable
    (got,) = gm(logits, target)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


class _WideVocab(nn.Module):
    """A narrow model over a wide vocabulary: its step peaks at the loss backward."""

    def __init__(self, vocab: int = 4096, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _lm_step(rows: int = 512, vocab: int = 4096):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (rows,))
    target = torch.randint(0, vocab, (rows,))
    step = WithLoss(_WideVocab(vocab), lambda logits: F.cross_entropy(logits, target))
    return step, ids


def test_the_planned_step_holds_one_logits_buffer_less_than_eager():
    """Measured, not predicted: eager autograd's loss backward holds the log-probabilities, the
    one-hot gradient and the result at once; memplan's store-all step holds two of them and a
    block, and its gradients are eager's exactly."""
    step, ids = _lm_step()
    reference = twin(step)
    logits_bytes = 512 * 4096 * 4
    eager_peak = measure_peak(lambda: reference(ids).backward(), resident=[*reference.parameters(), ids])
    opt = memplan.optimize(step, 10**12, solver="store_all", example_inputs=(ids,))
    assert len(opt.plan.analysis.capture.losses_fused) == 1
    assert "1 cross-entropy backward(s) in one buffer" in opt.plan.report()
    for p in reference.parameters():
        p.grad = None
    planned_peak = measure_peak(lambda: opt(ids).backward(), resident=[*step.parameters(), ids])
    assert planned_peak <= eager_peak - logits_bytes + logits_bytes // 8, (planned_peak, eager_peak)
    assert planned_peak <= opt.plan.predicted_peak
    for p in step.parameters():
        p.grad = None
    loss = opt(ids)
    loss.backward()
    ref_loss = reference(ids)
    ref_loss.backward()
    assert_same_step(opt, reference, loss, ref_loss)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_a_plan_under_a_budget_below_eager_loss_trains_as_eager(compile):
    """A budget below what eager autograd's loss backward alone needs (three logits buffers) is
    met: the step's gradients are eager's (exactly, eager runtime; within fused kernels' rounding,
    compiled: a compiled run calls the fused op as a kernel), its measured peak within the budget
    (the allocator's events where code is compiled)."""
    step, ids = _lm_step()
    reference = twin(step)
    logits_bytes = 512 * 4096 * 4
    budget = 3 * logits_bytes
    opt = memplan.optimize(step, budget, example_inputs=(ids,), compile=compile, kernel_scratch=False,
                           time_limit=3)
    loss = opt(ids)
    loss.backward()
    ref_loss = reference(ids)
    ref_loss.backward()
    if compile:
        assert_close_step(opt, reference, loss, ref_loss)
        from memplan.measure.tracker import profiled_peak
        peak = profiled_peak(lambda: opt(ids).backward(), resident=[*step.parameters(), ids])
    else:
        assert_same_step(opt, reference, loss, ref_loss)
        for p in step.parameters():
            p.grad = None
        peak = measure_peak(lambda: opt(ids).backward(), resident=[*step.parameters(), ids])
    assert peak <= budget, (peak, budget)
