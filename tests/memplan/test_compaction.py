"""Copying out a view that outlives the rest of its storage (``memplan.passes.compaction``)."""
from __future__ import annotations

import pytest
import torch

import memplan
import memplan.capture.trace
from memplan.pipeline.stages import analyze
from memplan.capture.trace import capture
from memplan.passes.compaction import copy_out_late_views
from memplan.measure.tracker import measure_peak

from .helpers import assert_same_step, build_step, clear_grads, twin


def _budget(analysis, fraction: float) -> int:
    """Sources plus ``fraction`` of what store-all holds above them."""
    base = analysis.param_bytes + analysis.buffer_bytes + analysis.input_bytes
    return int(base + fraction * (analysis.graph_peak - base))


def test_the_skip_half_of_a_concatenations_gradient_is_copied_out():
    step, args, kwargs = build_step("unet")
    cap = capture(step, args, kwargs)
    copied = {c.view: c for c in cap.copied_views}
    # Two decoder levels in the tiny U-Net: each cat's gradient is sliced in two,
    # and the encoder half is read only when backward reaches the encoder.
    assert len(copied) == 2
    nodes = {n.name: n for n in cap.graph.nodes}
    for c in copied.values():
        assert 2 * c.view_bytes == c.storage_bytes
        view, copy = nodes[c.view], nodes[c.copy]
        assert view.target == torch.ops.aten.slice.Tensor
        assert copy.target == torch.ops.aten.clone.default and copy.args == (view,)
        # The copy is made right after the last read of the rest of the storage,
        # and every reader after that reads the copy.
        assert copy.prev.name == c.after
        order = {n: i for i, n in enumerate(cap.graph.nodes)}
        assert all(order[u] < order[copy] for u in view.users if u is not copy)
        assert copy.users


@pytest.mark.slow
def test_copying_out_lowers_the_cost_at_a_tight_budget_and_keeps_the_step_exact(monkeypatch):
    step, args, kwargs = build_step("unet")
    analysis = analyze(step, args, kwargs)
    budget = _budget(analysis, 0.3)
    opt = memplan.optimize(twin(step), budget=budget, time_limit=2)
    ref = twin(step)
    torch.manual_seed(0)
    loss = opt(*args, **kwargs)
    loss.backward()
    torch.manual_seed(0)
    ref_loss = ref(*args, **kwargs)
    ref_loss.backward()
    assert_same_step(opt, ref, loss, ref_loss)
    clear_grads(opt)
    measured = measure_peak(lambda: opt(*args, **kwargs).backward())
    assert measured == opt.plan.predicted_peak <= budget
    assert "copied out       2 late-read views" in opt.plan.report()

    # The same budget without the copies: the whole gradient of each cat is held
    # until the encoder's backward, and the plan recomputes more to make room.
    monkeypatch.setattr(memplan.capture.trace, "copy_out_late_views", lambda gm: [])
    without = memplan.optimize(twin(step), budget=budget, time_limit=2)
    without(*args, **kwargs).backward()
    assert not without.plan.analysis.capture.copied_views
    assert opt.plan.predicted_overhead < without.plan.predicted_overhead - 0.05


def _small_read_late(x):
    h = x * 2
    small, rest = h[:, :2], h[:, 2:]
    r = torch.tanh(rest)  # the rest of h's storage is last read here
    return torch.sin(small) * r.sum()  # a third of h, read after it


def _big_read_late(x):
    h = x * 2
    big, rest = h[:, :4], h[:, 4:]
    r = torch.tanh(rest)
    return torch.sin(big) * r.sum()  # two thirds of h: a copy would take more than it frees


def _small_returned(x):
    h = x * 2
    small, rest = h[:, :2], h[:, 2:]
    r = torch.tanh(rest)
    return torch.sin(small) * r.sum(), small  # returned: the output holds h's storage to the end


@pytest.mark.parametrize("fn, copied", [(_small_read_late, 1), (_big_read_late, 0), (_small_returned, 0)])
def test_only_views_that_free_at_least_their_own_bytes_are_copied(fn, copied):
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 6)
    gm = make_fx(fn, tracing_mode="fake")(x)
    copies = copy_out_late_views(gm)
    assert len(copies) == copied
    for c in copies:
        assert (c.view_bytes, c.storage_bytes) == (4 * 2 * 4, 4 * 6 * 4)
        assert c.after == "tanh"
    torch.testing.assert_close(gm(x), fn(x))
