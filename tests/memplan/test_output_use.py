"""A loss that does not use some outputs: their gradients are learned absent and not planned.

The Hugging Face pattern: the model computes its loss and returns ``(loss,
logits, hidden_states)``; the step calls ``loss.backward()``. Eager autograd
never makes a gradient for the logits; memplan's first plan has to count one
(it cannot know yet), and from the second call on it plans without it.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memplan
from memplan.capture.trace import capture
from memplan.costs.cost_model import get_profile
from memplan.measure.tracker import measure_peak
from memplan.models import zoo
from memplan.passes.output_use import OutputUse
from memplan.pipeline.plan import make_plan
from tests.memplan.helpers import clear_grads

VOCAB, WIDTH, BATCH, SEQ = 2000, 64, 8, 64
LOGITS_BYTES = BATCH * SEQ * VOCAB * 4


class _CausalLM(nn.Module):
    """Embedding, two residual MLP blocks with layer norm and dropout, a vocabulary head and a
    shifted next-token loss computed inside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        h = self.emb(ids)
        hidden = [h]
        for block in self.blocks:
            h = h + block(h)
            hidden.append(h)
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return loss, logits, tuple(hidden)


def _lm_and_twin() -> tuple[_CausalLM, _CausalLM, torch.Tensor, torch.Tensor]:
    """A seeded model, its eager twin, and (ids, labels)."""
    torch.manual_seed(0)
    model = _CausalLM()
    return model, copy.deepcopy(model), *_inputs()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, ids


def _step(module: nn.Module, ids, labels, loss_of, caller_keeps_output: bool = True) -> tuple[int, torch.Tensor]:
    """One seeded step: (measured peak, loss). Its caller holds the whole output through backward
    (as ``out = model(**batch); out.loss.backward()`` does) unless ``caller_keeps_output`` is off."""
    clear_grads(module)
    kept = {}

    def run():
        torch.manual_seed(0)
        out = module(ids, labels)
        kept["loss"] = loss_of(out)
        if not caller_keeps_output:
            del out
        kept["loss"].backward()

    return measure_peak(run), kept["loss"].detach()


def _trainer_step(module: nn.Module, ids, labels) -> tuple[int, torch.Tensor]:
    """A step whose caller keeps only the loss, as Hugging Face's Trainer does (``compute_loss``
    returns ``outputs.loss``)."""
    return _step(module, ids, labels, lambda out: out[0], caller_keeps_output=False)


def _smallest_budget_for_every_gradient(model: nn.Module, ids, labels) -> int:
    """The smallest budget a plan that counts every output's gradient fits (what the first call
    plans for when it fits)."""
    with pytest.raises(memplan.InfeasibleBudgetError) as smallest:
        make_plan(model, (ids, labels), {}, 1000, profile=get_profile(None))
    return smallest.value.min_budget


def _same_step(step, module: nn.Module, model: nn.Module, reference: nn.Module, *args) -> int:
    """``step(module, *args)`` and ``step(reference, *args)``: the same loss and gradients (``model`` is
    the module ``module`` optimizes). Returns ``module``'s measured peak."""
    peak, loss = step(module, *args)
    _, ref_loss = step(reference, *args)
    torch.testing.assert_close(loss, ref_loss)
    _assert_same_grads(model, reference)
    return peak


def _assert_same_grads(module: nn.Module, reference: nn.Module) -> None:
    for (name, p), r in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, msg=lambda m: f"{name}: {m}")


def test_every_output_gradient_of_the_lm_is_an_addend():
    # The logits and each hidden state feed the loss inside the model: their tangents are only added.
    cap = capture(_CausalLM(), _inputs())
    assert cap.addend_only_outputs == {1, 2, 3, 4}


@pytest.mark.slow
def test_outputs_the_loss_does_not_use_are_planned_without_a_gradient_from_the_second_call():
    model, reference, ids, labels = _lm_and_twin()
    loss_only = lambda out: out[0]  # noqa: E731
    eager, _ = _step(reference, ids, labels, loss_only)
    opt = memplan.optimize(model, 10**12)
    peaks = []
    for _ in range(3):
        peak = _same_step(_step, opt, model, reference, ids, labels, loss_only)
        assert abs(peak - opt.plan.predicted_peak) <= 0.02 * peak, (peak, opt.plan.predicted_peak)
        peaks.append(peak)
    # First call: a gradient buffer for the logits and each hidden state. Then none.
    hidden_bytes = 3 * BATCH * SEQ * WIDTH * 4
    assert peaks[0] - peaks[1] >= LOGITS_BYTES + hidden_bytes - 4096, peaks
    assert peaks[1] == peaks[2]
    assert peaks[1] <= eager * 1.01, (peaks, eager)
    assert opt.plan.analysis.capture.output_use == OutputUse(no_grad=frozenset({1, 2, 3, 4}))  # all held
    assert len(opt.plans) == 2
    assert "no gradient for output tensor(s) 1, 2, 3, 4" in opt.plan.report()


@pytest.mark.slow
def test_a_tight_budget_holds_and_the_plan_without_unused_gradients_recomputes_less():
    model, reference, ids, labels = _lm_and_twin()
    loss_only = lambda out: out[0]  # noqa: E731
    budget = int(1.02 * _smallest_budget_for_every_gradient(model, ids, labels))  # the first plan barely fits
    opt = memplan.optimize(model, budget)
    overheads = []
    for call in range(2):
        peak = _same_step(_step, opt, model, reference, ids, labels, loss_only)
        assert peak <= budget, (call, peak, budget)
        overheads.append(opt.plan.predicted_overhead)
    assert opt.plan.analysis.capture.output_use.no_grad == {1, 2, 3, 4}
    assert overheads[1] < overheads[0], overheads


@pytest.mark.slow
def test_a_gradient_for_an_output_planned_without_one_is_exact_warns_and_ends_the_specialization():
    model, reference, ids, labels = _lm_and_twin()
    opt = memplan.optimize(model, 10**12)
    for _ in range(2):  # learn, then run the plan without output gradients
        _step(opt, ids, labels, lambda out: out[0])
    assert opt.plan.analysis.capture.output_use.no_grad
    with_logits = lambda out: out[0] + out[1].square().mean()  # noqa: E731
    with pytest.warns(UserWarning, match=r"output tensor\(s\) \[1\] got a gradient"):
        _same_step(_step, opt, model, reference, ids, labels, with_logits)
    # From then on: the plan for every gradient, and no more learning for these inputs.
    for loss_of in (with_logits, lambda out: out[0]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _same_step(_step, opt, model, reference, ids, labels, loss_of)
        assert opt.plan.analysis.capture.output_use.no_grad == frozenset()
    assert len(opt.plans) == 2


def test_an_output_whose_gradient_is_not_only_an_addend_cannot_be_planned_without_it():
    # A head the model does not use itself: its gradient flows through the head's own backward.
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk, self.main, self.aux = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)

        def forward(self, x):
            h = self.trunk(x).relu()
            main = self.main(h)
            return main.square().mean(), main, self.aux(h)

    x = torch.randn(8, 16)
    assert capture(TwoHeads(), (x,)).addend_only_outputs == {1}
    with pytest.raises(ValueError, match=r"outputs \[2\] cannot be planned without a gradient"):
        capture(TwoHeads(), (x,), output_use=OutputUse(no_grad=frozenset({1, 2})))


@pytest.mark.slow
def test_a_saved_plan_keeps_its_missing_gradients(tmp_path):
    model, reference, ids, labels = _lm_and_twin()
    loss_only = lambda out: out[0]  # noqa: E731
    opt = memplan.optimize(model, 10**12)
    for _ in range(2):
        planned_peak, _ = _step(opt, ids, labels, loss_only)
    opt.plan.save(tmp_path / "plan.json")
    loaded = memplan.optimize(model, plan=tmp_path / "plan.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peak = _same_step(_step, loaded, model, reference, ids, labels, loss_only)
    assert peak == planned_peak
    assert loaded.plan.analysis.capture.output_use.no_grad == {1, 2, 3, 4}


@pytest.mark.slow
def test_a_budget_only_a_plan_without_unused_gradients_fits_works_from_the_first_call(monkeypatch):
    model, reference, ids, labels = _lm_and_twin()
    # below every plan that counts the logits' gradient
    budget = _smallest_budget_for_every_gradient(model, ids, labels) - LOGITS_BYTES // 2
    opt = memplan.optimize(model, budget)
    loss_only = lambda out: out[0]  # noqa: E731
    traced = []  # the first call traces twice: the plan that assumes nothing, then the one without those gradients
    # the pipeline is the only caller of capture (tests/test_layers.py)
    monkeypatch.setattr(memplan.pipeline.stages, "capture", lambda *a, **k: traced.append(k) or capture(*a, **k))
    for call in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            peak = _same_step(_step, opt, model, reference, ids, labels, loss_only)
        assert peak <= budget, (call, peak, budget)
        assert opt.plan.analysis.capture.output_use.no_grad == {1, 2, 3, 4}
    assert len(opt.plans) == 1 and len(traced) == 2, traced
    # A loss that uses the logits: exact, with a warning; the next call has no plan that fits.
    with_logits = lambda out: out[0] + out[1].square().mean()  # noqa: E731
    with pytest.warns(UserWarning, match="got a gradient"):
        _same_step(_step, opt, model, reference, ids, labels, with_logits)
    with pytest.raises(memplan.InfeasibleBudgetError):
        _step(opt, ids, labels, with_logits)


@pytest.mark.slow
def test_outputs_the_caller_drops_before_backward_are_planned_as_let_go():
    model, reference, ids, labels = _lm_and_twin()
    eager, _ = _trainer_step(reference, ids, labels)
    opt = memplan.optimize(model, 10**12)
    peaks = []
    for _ in range(3):
        peak = _same_step(_trainer_step, opt, model, reference, ids, labels)
        peaks.append(peak)
    use = opt.plan.analysis.capture.output_use
    assert use.no_grad == {1, 2, 3, 4} and 1 in use.dropped, use
    assert abs(peaks[2] - opt.plan.predicted_peak) <= 0.02 * peaks[2], (peaks, opt.plan.predicted_peak)
    assert peaks[1] == peaks[2] <= eager, (peaks, eager)
    # the eager replay makes the same assumptions, and matches eager as measured
    assert abs(opt.plan.analysis.eager_peak - eager) <= 0.01 * eager, (opt.plan.analysis.eager_peak, eager)
    assert "dropped by the caller before backward" in opt.plan.report()


@pytest.mark.slow
def test_a_caller_that_holds_an_output_planned_as_dropped_gets_exact_gradients_and_a_warning():
    model, reference, ids, labels = _lm_and_twin()
    opt = memplan.optimize(model, 10**12)
    for _ in range(2):
        _trainer_step(opt, ids, labels)
    assert 1 in opt.plan.analysis.capture.output_use.dropped
    loss_only = lambda out: out[0]  # noqa: E731
    with pytest.warns(UserWarning, match=r"output tensor\(s\) \[.*1.*\] were still held when backward began"):
        _same_step(_step, opt, model, reference, ids, labels, loss_only)
    _step(opt, ids, labels, loss_only)
    assert not opt.plan.analysis.capture.output_use


class _ReadAgainInBackward(nn.Module):
    """A block and its mean absolute value: the backward reads the block's output (sign(h))."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(x)))
        return h, h.abs().mean()


def test_an_output_the_caller_drops_is_freed_where_the_plan_frees_it():
    """A plan carries the output h into its backward and, for a caller that drops h, frees it after
    its last read there. Autograd would hold a tensor saved with ``save_for_backward`` until the
    backward returns: the runtime carries outputs as it carries every other value, so the step
    measures as planned (before: h's bytes over the plan, from its last read to backward's end)."""
    torch.manual_seed(0)
    model, x, w = _ReadAgainInBackward(), torch.randn(256, 64), torch.randn(256, 64)
    reference = copy.deepcopy(model)
    opt = memplan.optimize(model, 10**9, solver="sqrt_n")  # deterministic, and it carries h
    peaks = []
    for _ in range(3):  # the first backward shows h dropped: planned so from the second step on
        clear_grads(model)
        clear_grads(reference)
        # w is not the plan's: the tracker counts it, the plan does not
        peaks.append(measure_peak(lambda: _drop_and_step(opt, x, w), resident=[*model.parameters(), x, w]))
        _drop_and_step(reference, x, w)
        _assert_same_grads(model, reference)
    plan = opt.plan
    assert 0 in plan.analysis.capture.output_use.dropped and plan.carried_bytes >= x.nbytes, plan.report()
    assert peaks[2] - w.nbytes <= plan.predicted_peak + 64, (peaks, w.nbytes, plan.predicted_peak)
    # An output changed in place before the backward that reads it is refused, as autograd refuses it.
    h, s = opt(x)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (h.sum() + s).backward()


def _drop_and_step(module: nn.Module, x: torch.Tensor, w: torch.Tensor) -> None:
    """A step whose caller lets go of the first output before the backward."""
    h, s = module(x)
    loss = (h * w).sum() + s
    del h
    loss.backward()


def test_no_new_plan_for_outputs_too_small_to_matter():
    # Logits of 8 x 10 next to megabytes of activations, dropped once the loss is computed outside:
    # not worth planning again (memplan.core.config.Tunables.replan_fraction).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(8, 256), torch.randint(0, 10, (8,))
    opt = memplan.optimize(model, 10**12)
    for _ in range(3):
        clear_grads(model)
        F.cross_entropy(opt(x), y).backward()
    assert len(opt.plans) == 1
    assert not opt.plan.analysis.capture.output_use


@pytest.mark.slow
def test_a_loss_computed_outside_over_large_outputs_warns_once_with_the_fix():
    """The README's plain form, ``loss_fn(opt(x))``: the loss's own tensors are not in the plan."""
    zm = zoo.build("gpt", size="tiny", batch_size=4)
    (tokens,) = zm.example_inputs
    budget = memplan.optimize(zm.model, 10**12, solver="store_all", example_inputs=(tokens,)).plan.predicted_peak
    planned = memplan.optimize(zm.model, budget)
    with pytest.warns(memplan.LossOutsideWarning, match="WithLoss") as seen:
        logits = planned(tokens)
        assert logits.numel() * logits.element_size() >= memplan.core.config.TUNABLES.loss_outside_fraction * budget
        zm.loss_fn(logits).backward()
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", memplan.LossOutsideWarning)
        zm.loss_fn(planned(tokens)).backward()  # once per module
        # The loss inside the plan: a scalar output, nothing to warn about.
        inside = memplan.optimize(memplan.WithLoss(zm.model, zm.loss_fn), budget)
        inside(tokens).backward()


class _LossHead(nn.Module):
    """A cross-entropy over logits made by code before it: the inputs are not the module's."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)


def test_an_input_the_caller_lets_go_is_held_through_the_forward_only():
    """A loss head whose caller keeps no reference to the logits (`memplan.WithLoss`): declared so
    (``OutputUse.inputs_dropped``), its plan holds them from the start to the end of forward and not
    in the backward, which never reads them (it reads the log-probabilities), so its peak is one
    logits-size buffer lower; what it carries into the backward is the same."""
    head = _LossHead()
    logits = torch.randn(512, 1000, requires_grad=True)
    target = torch.randint(0, 1000, (512,))
    held, _ = make_plan(head, (logits, target), {}, 10**12, profile=get_profile(None))
    let_go, _ = make_plan(head, (logits, target), {}, 10**12, profile=get_profile(None),
                          output_use=OutputUse(inputs_dropped=frozenset({0})))
    assert let_go.analysis.capture.output_use.inputs_dropped == {0}
    assert held.predicted_peak - let_go.predicted_peak == logits.nbytes, (held.report(), let_go.report())
    assert let_go.carried_bytes == held.carried_bytes
    # made first, freed at the barrier (before the backward computes anything)
    steps = [(op, str(node)) for op, node in let_go.schedule]
    name = let_go.analysis.lowered.sources[0]
    made = steps.index(("compute", name))
    assert all(op != "compute" or node in ("__start__",) for op, node in steps[:made]), steps[:made]
    barrier, freed = steps.index(("compute", "__backward__")), steps.index(("free", name))
    assert barrier < freed and all(op == "free" for op, _ in steps[barrier + 1:freed]), steps
    assert "let go by the caller" in let_go.report()


@pytest.mark.slow
def test_a_loss_graph_lets_its_logits_go_under_the_backend_and_the_budget_holds():
    """The FSDP2 shape in one process: the blocks planned by the backend, eager code after them (the
    vocabulary head), and the loss compiled with the same backend inside `memplan.WithLoss`, which
    lets the logits go. The loss graph's plan holds them through its forward only, and the step's
    measured peak is the predicted one, under the budget, with eager's gradients. A loss function
    that keeps the logits after all is caught at its backward: a warning, and the next plans hold them."""
    from memplan.measure.tracker import profiled_peak

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, WIDTH)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

        def forward(self, ids):
            h = self.emb(ids)
            return h + self.mlp(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = Body(), nn.Linear(WIDTH, VOCAB)

        def forward(self, ids, labels):
            return self.head(self.body(ids)).reshape(-1, VOCAB), labels.reshape(-1)

    torch.manual_seed(0)
    net = Net()
    reference = memplan.WithLoss(copy.deepcopy(net), lambda out: F.cross_entropy(*out))
    ids, labels = _inputs()
    labels = labels.clone()  # a step input the first graph does not read: held by the caller, never let go
    budget = 3 * LOGITS_BYTES
    backend = memplan.backend(budget=budget, time_limit=2)
    net.body.forward = torch.compile(net.body.forward, backend=backend)
    kept: list = []
    model = memplan.WithLoss(net, torch.compile(lambda out: F.cross_entropy(*out), backend=backend))
    peaks = []
    for _ in range(3):
        clear_grads(model)
        clear_grads(reference)
        peaks.append(profiled_peak(lambda: model(ids, labels).backward(), resident=[*model.parameters(), ids, labels]))
        reference(ids, labels).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    loss_graph = backend.graphs[-1]
    assert loss_graph.inputs_dropped == {0}, loss_graph.inputs_dropped  # the logits, not the labels' view
    assert max(peaks) <= budget, (peaks, budget)  # the first step too
    assert abs(backend.predicted_peak - peaks[-1]) <= 0.02 * peaks[-1], (backend.predicted_peak, peaks)

    def keeping(out):
        kept.append(out[0])
        return F.cross_entropy(*out)

    torch._dynamo.reset()
    backend = memplan.backend(budget=10**9, time_limit=1)
    net.body.forward = torch.compile(Body.forward.__get__(net.body), backend=backend)
    model = memplan.WithLoss(net, torch.compile(keeping, backend=backend))
    model(ids, labels).backward()
    with pytest.warns(UserWarning, match="still held after its backward"):
        model(ids, labels).backward()
    assert backend.graphs[-1].inputs_dropped == frozenset()
    model(ids, labels).backward()
