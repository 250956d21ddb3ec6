"""A CPU dropout split into its mask's draw and a multiply (`memplan.passes.dropout_split`): the op's
values to the bit, and a plan that recomputes a dropout's output by the multiply alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import memplan
from memplan import WithLoss
from memplan.passes.dropout_split import split_dropouts
from memplan.measure.tracker import measure_peak

from .helpers import assert_close_step, assert_same_step, twin
from .test_kernels import _assert_bitwise, _awkward

aten = torch.ops.aten


def _dropouts(x, p):
    out, mask = aten.native_dropout.default(x.neg(), p, True)
    again, _ = aten.native_dropout.default(out * 2.0, p, True)
    return again, mask


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.1, 1.0])
def test_a_split_dropout_computes_the_op_bit_for_bit(dtype, p):
    """Mask, output and the generator's state after the step are the op's, NaN and -0.0 included;
    an output the graph drops (the second dropout's mask) is not drawn otherwise."""
    x = _awkward((6, 5, 4), dtype, "contiguous")
    gm = make_fx(_dropouts)(x, p)
    torch.manual_seed(3)
    out, mask = gm(x, p)
    after = torch.get_rng_state()
    split = split_dropouts(gm)
    assert [s.dropout for s in split] == ["native_dropout", "native_dropout_1"]
    assert {s.mask for s in split} | {s.apply for s in split} == {
        n.name for n in gm.graph.nodes if n.target in (torch.ops.memplan.dropout_mask.default,
                                                       torch.ops.memplan.dropout_apply.default)}
    targets = _targets(gm)
    assert "aten.native_dropout.default" not in targets
    assert targets.count("memplan.dropout_mask.default") == 2 and targets.count("memplan.dropout_apply.default") == 2
    torch.manual_seed(3)
    got_out, got_mask = gm(x, p)
    assert torch.equal(torch.get_rng_state(), after)
    _assert_bitwise(got_mask, mask)
    _assert_bitwise(got_out, out)


@pytest.mark.parametrize("case", ["transposed", "eval", "empty"])
def test_a_dropout_drawn_otherwise_is_not_split(case):
    """A strided input (the op's mask follows its layout), eval (no draw) and an empty input keep
    the op, and the graph computes the op's values."""
    x = torch.randn(0, 5) if case == "empty" else torch.randn(6, 5)

    def step(x):
        return aten.native_dropout.default(x.t() if case == "transposed" else x, 0.3, case != "eval")

    gm = make_fx(step)(x)
    assert split_dropouts(gm) == []
    assert "aten.native_dropout.default" in _targets(gm)
    torch.manual_seed(0)
    out, mask = step(x)
    torch.manual_seed(0)
    got_out, got_mask = gm(x)
    assert torch.equal(got_out, out) and torch.equal(got_mask, mask) and got_mask.dtype == mask.dtype


# (bfloat16 with one dropout only: Inductor's fused chains round it once where eager rounds after each op)
@pytest.mark.slow
@pytest.mark.parametrize("dtype, chain", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_a_compiled_split_dropout_fuses_the_multiply_and_draws_eager_mask(dtype, chain, p):
    """Inductor calls the mask's kernel (eager's draws) and fuses `dropout_apply` away: neither it
    nor the op is called; output, mask and generator state are the op's, NaN and -0.0 included
    (``chain``: two dropouts)."""
    from memplan.runtime.inductor.compiler import inductor_compiler

    def step(x):
        return _dropouts(x, p) if chain else aten.native_dropout.default(x * 1.0, p, True)

    x = _awkward((33, 17), dtype, "contiguous")
    gm = make_fx(step)(x)
    split_dropouts(gm)
    called = compiled_as_eager(inductor_compiler(gm, [x]), step, x)
    assert "memplan::dropout_mask" in called and "memplan::dropout_apply" not in called, called
    assert "aten::native_dropout" not in called, called


def compiled_as_eager(compiled, step, x) -> set[str]:
    """Run ``compiled`` and ``step`` (eager) on ``x`` from one seed: their (output, mask) and the
    generator's state after them are the same to the bit. Returns the ops the compiled run called."""
    from torch.profiler import profile

    torch.manual_seed(5)
    out, mask = step(x)
    after_op = torch.get_rng_state()
    torch.manual_seed(5)
    with profile() as prof:
        got_out, got_mask = compiled([x])
    assert torch.equal(torch.get_rng_state(), after_op)
    _assert_bitwise(got_mask, mask)
    _assert_bitwise(got_out, out)
    return {e.key for e in prof.key_averages()}


class _DropoutMLP(nn.Module):
    """Wide dropouts between narrow layers: their outputs are the bytes a plan drops first."""

    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_a_plan_recomputes_dropout_outputs_by_the_multiply_and_trains_as_eager(compile):
    """Under a tight budget the plan recomputes dropout outputs from their kept masks
    (`dropout_apply`), the step's gradients are eager's (exactly, eager runtime; within fused
    kernels' rounding, compiled) and the step stays within the budget."""
    torch.manual_seed(0)
    step = WithLoss(_DropoutMLP(), lambda out: out.square().mean())
    reference = twin(step)
    x = torch.randn(256, 256)
    eager_peak = measure_peak(lambda: reference(x).backward(), resident=[*reference.parameters(), x])
    for p in reference.parameters():
        p.grad = None
    budget = int(0.6 * eager_peak)
    # (kernel_scratch off: compile=True would plan room for the eager ops' scratch, another plan)
    opt = memplan.optimize(step, budget, example_inputs=(x,), compile=compile, kernel_scratch=False, time_limit=3)
    applies = {s.apply for s in opt.plan.analysis.capture.dropouts_split}
    recomputed = [d.name for d in opt.plan.decisions if d.decision == "recompute"]
    by_multiply = len(applies.intersection(recomputed))
    assert by_multiply > 0, recomputed
    assert f"4 split into their mask's draw and a multiply; {by_multiply} outputs recomputed" in opt.plan.report()
    torch.manual_seed(1)
    loss = opt(x)
    loss.backward()
    torch.manual_seed(1)
    ref_loss = reference(x)
    ref_loss.backward()
    if compile:
        assert_close_step(opt, reference, loss, ref_loss)
    else:
        assert_same_step(opt, reference, loss, ref_loss)
        for p in step.parameters():
            p.grad = None
        assert measure_peak(lambda: opt(x).backward(), resident=[*step.parameters(), x]) <= budget
