"""Models memplan's authors did not write: torch.nn's own building blocks, and autocast.

Each must capture, plan and train to eager's outputs and gradients.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import memplan
from benchmarks.models.library_style import LIBRARY_STYLE, square_loss
from memplan.measure import measure_peak

from .helpers import assert_same_step, clear_grads


class _Misc(nn.Module):
    """A grab bag of ops real code uses: masks, where, cumsum, interpolate, einsum, logsumexp."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)).bool())
        self.plain_tensor_attribute = torch.linspace(0, 1, 8)  # not a buffer: a graph constant

    def forward(self, x):
        y = self.lin(x).masked_fill(~self.mask[: x.shape[1]], 0.0) * self.plain_tensor_attribute
        y = torch.where(y > 0, y, 0.1 * y).cumsum(-1)
        z = F.interpolate(y.unsqueeze(1), scale_factor=2, mode="bilinear")
        return z.mean() + y.logsumexp(-1).sum() + torch.einsum("bij,bkj->bik", y, y).std()


CASES = {
    "transformer_encoder": lambda: (
        nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True), 2),
        (torch.randn(2, 10, 32),),
    ),
    "lstm": lambda: (nn.LSTM(8, 16, num_layers=2, batch_first=True), (torch.randn(3, 5, 8),)),
    "gru": lambda: (nn.GRU(8, 16, batch_first=True), (torch.randn(3, 5, 8),)),
    "multihead_attention": lambda: (
        nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True),
        (torch.randn(2, 6, 16), torch.randn(2, 6, 16), torch.randn(2, 6, 16)),
    ),
    "convtranspose_groupnorm": lambda: (
        nn.Sequential(
            nn.ConvTranspose2d(3, 8, 4, 2, 1), nn.GroupNorm(2, 8), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
        ),
        (torch.randn(2, 3, 8, 8),),
    ),
    "embedding_bag": lambda: (nn.EmbeddingBag(20, 8, mode="mean"), (torch.randint(0, 20, (4, 5)),)),
    "misc_ops": lambda: (_Misc(), (torch.randn(3, 8, 8),)),
}


def _loss(out):
    return sum(t.float().sum() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad)


def _check(model, args, budget, autocast=None):
    torch.manual_seed(0)
    model.train()
    reference = copy.deepcopy(model)
    opt = memplan.optimize(model, budget)
    ctx = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else (lambda: torch.autocast("cpu", enabled=False))
    with ctx():
        torch.manual_seed(1)
        out = opt(*args)
        torch.manual_seed(1)
        ref = reference(*args)
        loss, ref_loss = _loss(out), _loss(ref)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")
    return opt


@pytest.mark.parametrize("name", list(CASES))
def test_torch_nn_blocks_train_like_eager(name):
    model, args = CASES[name]()
    _check(model, args, 10**12)


def test_bf16_autocast_step_matches_eager_autocast():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = _check(model, (torch.randn(8, 16),), 10**12, autocast=torch.bfloat16)
    dtypes = {
        n.meta["val"].dtype
        for n in opt.plan.analysis.capture.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
    }
    assert torch.bfloat16 in dtypes


@pytest.mark.parametrize("name", list(LIBRARY_STYLE))
def test_library_style_models_are_predicted_as_measured(name):
    torch.manual_seed(0)
    # Views of one storage kept after the op that made it (unbind, split, chunk) and
    # slice assignment (functional copy and scatter ops): see benchmarks.models.library_style.
    model, args = LIBRARY_STYLE[name]()
    module = memplan.WithLoss(model, square_loss)
    reference = copy.deepcopy(module)
    # Store-all: the joint graph run in order, freeing after last use.
    store_all = memplan.optimize(module, 10**12, solver="store_all", example_inputs=args)
    measured = measure_peak(lambda: store_all(*args).backward())
    assert measured == store_all.plan.predicted_peak, (measured, store_all.plan.predicted_peak)
    # A plan that must drop 15% of the activations (each model can drop about 20% or more):
    # measured exactly as predicted, under the budget, with eager's gradients.
    analysis = store_all.plan.analysis
    budget = int(analysis.graph_peak - 0.15 * analysis.activation_bytes)
    opt = memplan.optimize(module, budget, example_inputs=args, time_limit=3)
    clear_grads(module)
    measured = measure_peak(lambda: opt(*args).backward())
    assert measured == opt.plan.predicted_peak <= budget, (measured, opt.plan.predicted_peak, budget)
    clear_grads(module)
    loss, ref_loss = opt(*args), reference(*args)
    loss.backward()
    ref_loss.backward()
    assert_same_step(module, reference, loss, ref_loss)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down, self.drop = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class _ReentrantCheckpointed(nn.Module):
    """HuggingFace/timm-style gradient checkpointing: reentrant checkpoints on a hidden state that requires grad."""

    def __init__(self, sequential: bool, d: int = 32, depth: int = 4):
        super().__init__()
        self.sequential = sequential
        self.stem = nn.Linear(d, d)
        self.blocks = nn.Sequential(*(_Block(d) for _ in range(depth)))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.stem(x)
        if self.sequential:
            h = checkpoint_sequential(self.blocks, 2, h, use_reentrant=True)
        else:
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=True)
        return self.head(h).square().mean()


@pytest.mark.parametrize("sequential", [False, True], ids=["checkpoint", "checkpoint_sequential"])
def test_reentrant_checkpoint_trains_like_eager_under_a_recomputing_budget(sequential):
    torch.manual_seed(0)
    module = _ReentrantCheckpointed(sequential)
    reference = copy.deepcopy(module)
    args = (torch.randn(256, 32),)
    store_all = memplan.optimize(module, 10**12, solver="store_all", example_inputs=args)
    analysis = store_all.plan.analysis
    budget = int(analysis.graph_peak - 0.3 * analysis.activation_bytes)
    opt = memplan.optimize(module, budget, example_inputs=args, time_limit=3)
    assert any(d.decision == "recompute" for d in opt.plan.decisions)
    clear_grads(module)
    torch.manual_seed(1)
    loss = opt(*args)
    torch.manual_seed(1)
    ref_loss = reference(*args)
    loss.backward()
    ref_loss.backward()
    assert all(p.grad is not None for p in module.parameters())
    assert_same_step(module, reference, loss, ref_loss)
