"""The eager runtime's faster code (`memplan.ops.kernels`): exact to the bit, and in place only where safe."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import memplan
from memplan import WithLoss
from memplan.ops.kernels import (ATEN_TARGET, IN_PLACE, dropout_apply, dropout_mask, drawn_as_the_op,
                             native_dropout_backward, use_stand_ins)

from .helpers import assert_same_step, twin

aten = torch.ops.aten


def _awkward(shape, dtype, layout):
    """Values with every special a product can meet (NaN, infinities, signed zeros), laid out as asked."""
    x = torch.randn(shape, dtype=torch.float64)
    flat = x.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=torch.float64)
    x = x.to(dtype)
    if layout == "transposed":
        return x.transpose(0, 1)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(a), torch.signbit(b))  # -0.0 stays -0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last"])
@pytest.mark.parametrize("p", [0.0, 0.1, 1.0])
def test_dropout_kernels_compute_the_op_bit_for_bit(dtype, layout, p):
    """The split dropout's two ops (a contiguous input; a strided one stays the op): same mask
    (same draws, same layout), same output; the backward's stand-in the same gradient; NaN and
    -0.0 included, and the generator left where the op leaves it."""
    x = _awkward((6, 5, 4, 3), dtype, layout)
    torch.manual_seed(3)
    out, mask = aten.native_dropout.default(x, p, True)
    after_op = torch.get_rng_state()
    if layout == "contiguous":
        torch.manual_seed(3)
        got_mask = dropout_mask(x, p)
        got_out = dropout_apply(x, got_mask, p)
        assert torch.equal(torch.get_rng_state(), after_op)
        _assert_bitwise(got_mask, mask)
        _assert_bitwise(got_out, out)
    else:
        assert not drawn_as_the_op(x, True)

    grad = _awkward(tuple(x.shape), dtype, "contiguous")
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    _assert_bitwise(native_dropout_backward(grad, mask, scale), aten.native_dropout_backward.default(grad, mask, scale))


def _traced(fn, *args):
    """``fn`` traced to a functional ATen graph with fake values in its meta, as capture makes them."""
    return make_fx(fn, tracing_mode="fake")(*args)


def _rewritten(fn, *args):
    """(``fn``'s graph with `use_stand_ins` applied, {op name: ran in place}) after checking that it
    computes what ``fn`` computes and leaves its inputs untouched."""
    gm = _traced(fn, *args)
    expected = gm(*[a.clone() for a in args])
    use_stand_ins(gm.graph)
    gm.recompile()
    inputs = [a.clone() for a in args]
    got = gm(*inputs)
    for a, b in zip(inputs, args):
        assert torch.equal(a, b), "an input was written"
    for g, e in zip(got if isinstance(got, (tuple, list)) else [got], expected if isinstance(expected, (tuple, list))
                    else [expected]):
        assert torch.equal(g, e)
    return {str(n.meta[ATEN_TARGET]): bool(n.meta.get(IN_PLACE)) for n in gm.graph.nodes if ATEN_TARGET in n.meta}


def test_an_elementwise_op_runs_in_place_where_its_input_dies_there():
    """``relu(x @ w)``: the product dies at the ReLU, the ReLU's result at the add: both in place."""
    def f(x, w, b):
        return torch.relu(x @ w) + b

    changed = _rewritten(f, torch.randn(4, 5), torch.randn(5, 6), torch.randn(4, 6))
    assert changed == {"aten.relu.default": True, "aten.add.Tensor": True}


def test_no_op_runs_in_place_over_a_value_read_later_through_a_view():
    """The product's storage is read after the ReLU, through a view of it: the ReLU must not write it."""
    def f(x, w):
        a = x @ w
        flat = a.view(-1)
        return torch.relu(a).sum(), flat * 2

    assert _rewritten(f, torch.randn(4, 5), torch.randn(5, 6)) == {}


def test_no_op_runs_in_place_over_a_step_input_or_a_view_of_one():
    """Inputs (parameters, the batch) outlive the step; a transpose views its input's storage. (The
    ReLUs' own results die at the add and the multiply, which take them over.)"""
    def f(x, w):
        return torch.relu(x) + 1, torch.relu(w.t()) * 3

    assert _rewritten(f, torch.randn(4, 5), torch.randn(5, 4)) == {"aten.add.Tensor": True, "aten.mul.Tensor": True}


def test_no_op_runs_in_place_where_the_result_is_laid_out_otherwise_or_broadcast():
    def f(x, w, bias):
        a = x @ w  # (4, 6)
        column = a[:, :1].contiguous()  # (4, 1): broadcast by the add, not its shape
        return column + a, (x @ w).t() * 2  # the product's transpose: strides the multiply does not keep

    changed = _rewritten(f, torch.randn(4, 5), torch.randn(5, 6), torch.randn(6))
    assert "aten.add.Tensor" not in changed and "aten.mul.Tensor" not in changed


def test_a_planned_resnet_block_runs_its_relus_and_skip_adds_in_place_and_trains_as_eager():
    """A residual block with BatchNorm: the ReLUs and the skip add run in place in the eager runtime,
    gradients, loss and running statistics stay eager's exactly."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + x)

    torch.manual_seed(0)
    step = WithLoss(nn.Sequential(Block(), Block()), lambda out: out.square().mean())
    reference = twin(step)
    x = torch.randn(4, 8, 12, 12)
    opt = memplan.optimize(step, 10**12, solver="store_all", example_inputs=(x,))
    loss, ref_loss = opt(x), reference(x)
    loss.backward()
    ref_loss.backward()
    assert_same_step(opt, reference, loss, ref_loss)
    for b, rb in zip(opt.buffers(), reference.buffers()):
        assert torch.equal(b, rb)
    program = opt._plans[opt._last_signature][1]
    in_place = [str(n.meta[ATEN_TARGET]) for n in program.forward.module.graph.nodes if n.meta.get(IN_PLACE)]
    assert in_place.count("aten.relu.default") == 4 and in_place.count("aten.add.Tensor") >= 2


def test_an_op_the_plan_runs_at_its_peak_stays_out_of_place():
    """In place, the op would lower the step's peak below the plan's prediction (which tests and
    users hold to the byte): given the plan's timeline, only ops below its peak change."""
    def f(x, w, b):
        return torch.relu(x @ w) + b

    gm = _traced(f, torch.randn(4, 5), torch.randn(5, 6), torch.randn(4, 6))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    for step, node in enumerate(ops):
        node.meta["memplan_step"] = step
    relu = next(n for n in ops if n.target is aten.relu.default)
    timeline = [100.0] * len(ops)
    timeline[ops.index(relu)] = 140.0  # the ReLU runs at the peak; the add below it
    use_stand_ins(gm.graph, timeline)
    assert relu.target is aten.relu.default and IN_PLACE not in relu.meta
    assert [str(n.meta[ATEN_TARGET]) for n in ops if n.meta.get(IN_PLACE)] == ["aten.add.Tensor"]


def test_an_op_reading_its_dying_input_twice_runs_in_place_and_one_reading_a_view_of_it_does_not():
    def twice(x, w):
        a = x @ w
        return a + a

    def through_a_view(x, w):
        a = x @ w
        return a + a.t()  # (6, 6): the transpose reads the storage the add would write

    assert _rewritten(twice, torch.randn(4, 5), torch.randn(5, 6)) == {"aten.add.Tensor": True}
    assert _rewritten(through_a_view, torch.randn(6, 5), torch.randn(5, 6)) == {}


def test_a_compiled_dropout_on_a_strided_input_calls_the_op():
    """Where the mask would be drawn in another order (a transposed input), Inductor calls the op."""
    from torch.profiler import profile

    from memplan.runtime.inductor.compiler import inductor_compiler

    def step(x):
        return aten.native_dropout.default(x.t(), 0.3, True)

    x = torch.randn(8, 6)
    compiled = inductor_compiler(make_fx(step)(x), [x])
    torch.manual_seed(5)
    out, mask = aten.native_dropout.default(x.t(), 0.3, True)
    torch.manual_seed(5)
    with profile() as prof:
        got_out, got_mask = compiled([x])
    assert torch.equal(got_mask, mask) and torch.equal(got_out, out)
    assert "aten::native_dropout" in {e.key for e in prof.key_averages()}


def test_no_op_runs_in_place_over_a_value_being_copied_to_host_memory():
    """An offload's copy runs on a side stream (CUDA): an op that wrote its value in place after the
    offload was issued could overwrite it before the copy has read it, and the value prefetched for
    backward would be the op's result. On the CPU the copy is synchronous, so the wrong values only
    show on a GPU; what must hold is that no offloaded value is written in place."""
    from memplan.ops.transfer import offload
    from memplan.ops.kernels import use_stand_ins

    graph = _traced(lambda x, w: torch.relu(x @ w) + 1, torch.randn(4, 5), torch.randn(5, 6)).graph
    product = next(n for n in graph.nodes if n.target is torch.ops.aten.mm.default)
    relu = next(n for n in graph.nodes if n.target is torch.ops.aten.relu.default)
    with graph.inserting_after(product):
        copied = graph.call_function(offload, (product,))
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((output.args[0], copied),)
    use_stand_ins(graph)
    assert not relu.meta.get(IN_PLACE), "the ReLU writes the product while its copy to host may still read it"
    add = next(n for n in graph.nodes if n.meta.get(ATEN_TARGET) is torch.ops.aten.add.Tensor)
    assert add.meta.get(IN_PLACE)  # the ReLU's own result is nobody's copy: the add still runs in place
