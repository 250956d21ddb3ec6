"""Cost model: device profiles, roofline times, measured op times, alias-aware bytes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memplan
from memplan.models.library_style import LIBRARY_STYLE, square_loss
from memplan.capture.trace import capture
from memplan.costs.cost_model import PROFILES, annotate, get_profile
from memplan.measure.timing import measure_op_times


def test_profiles_cover_cpu_a100_h100():
    for name in ("cpu", "a100", "h100"):
        p = get_profile(name)
        assert p.peak_flops > 0 and p.memory_bandwidth > 0 and p.host_bandwidth > 0
    assert PROFILES["h100"].peak_flops > PROFILES["a100"].peak_flops
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("tpu-v9")


def test_roofline_is_compute_or_memory_bound():
    p = PROFILES["a100"]
    tiny = p.op_time(flops=1e3, bytes_moved=1e3)
    compute_bound = p.op_time(flops=1e12, bytes_moved=1e3)
    memory_bound = p.op_time(flops=1e3, bytes_moved=1e10)
    assert compute_bound == pytest.approx(p.op_overhead + 1e12 / p.peak_flops)
    assert memory_bound == pytest.approx(p.op_overhead + 1e10 / p.memory_bandwidth)
    assert tiny < compute_bound and tiny < memory_bound


def test_op_factors_scale_the_roofline_of_their_kind_only():
    # The CPU profile's factors come from measured op times (`benchmarks.tools.calibrate_cpu`): dropout's
    # random numbers cost far more than the bytes it moves, which the roofline alone sees.
    p = PROFILES["cpu"]
    factors = dict(p.op_factors)
    plain = p.op_time(0.0, 4e6)
    assert p.op_time(0.0, 4e6, kind="dropout_mask") == pytest.approx(
        p.op_overhead + factors["dropout_mask"] * (plain - p.op_overhead))
    assert p.op_time(0.0, 4e6, kind="relu") == plain  # no factor: the roofline as it is
    # A graph's dropout mask is costed as its kind: far above an elementwise op of its size, and
    # far above the multiply that applies it (`memplan.passes.dropout_split`).
    x = torch.randn(64, 256, requires_grad=True)
    cap = capture(nn.Sequential(nn.Dropout(0.1), nn.ReLU()), (x,))
    costs = annotate(cap.graph_module, p)
    by_target = {n.target: costs.values[n.name].time for n in cap.graph.nodes if n.op == "call_function"}
    mask = by_target[torch.ops.memplan.dropout_mask.default]
    apply = by_target[torch.ops.memplan.dropout_apply.default]
    relu = by_target[torch.ops.aten.relu.default]
    assert mask > 5 * relu and mask > 5 * apply


def test_bytes_of_a_linear_step():
    model = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    cap = capture(model, (x,))
    costs = annotate(cap.graph_module)
    addmm = [n for n in cap.graph.nodes if n.target == torch.ops.aten.addmm.default]
    assert costs.values[addmm[0].name].new_bytes == 16 * 32 * 4
    # a storage is counted once however many values alias it
    assert sum(costs.storage_bytes.values()) == sum(v.new_bytes for v in costs.values.values())


def test_measured_times_replace_the_roofline():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 8))
    cap = capture(model, (torch.randn(64, 128),))
    estimate = annotate(cap.graph_module)
    skip = {n for n, v in estimate.values.items() if v.alias_of is not None}
    times = measure_op_times(cap.graph_module, "cpu", skip=skip)
    mms = [n.name for n in cap.graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    assert mms and all(times[m] > 0 for m in mms)
    measured = annotate(cap.graph_module, measured_times=times)
    for m in mms:
        assert measured.values[m].time == times[m]
    # optimize(profile=True) plans with measured times: the problem's costs are timings, not roofline guesses
    opt = memplan.optimize(model, 10**12, profile=True, example_inputs=(torch.randn(64, 128),))
    graph = opt.plan.analysis.lowered.graph
    for name, v in opt.plan.analysis.costs.values.items():
        if name in graph and v.alias_of is None and name in times:
            assert graph.nodes[name]["cost"] == pytest.approx(v.time)
    assert opt.plan.store_all_time == pytest.approx(sum(d["cost"] for _, d in graph.nodes(data=True)))
    # ... and the host link is measured: a copy of 32 MiB timed on this machine, not the table's figure
    measured_link = opt.plan.analysis.costs.profile.host_bandwidth
    assert measured_link != PROFILES["cpu"].host_bandwidth and 0 < measured_link < float("inf")


def test_host_bandwidth_is_the_bytes_over_the_time_of_a_real_copy():
    from memplan.measure.timing import measure_host_bandwidth

    copies = []

    def clock() -> float:  # every copy takes 1 ms by this clock, whatever the machine's load
        copies.append(None)
        return len(copies) * 1e-3

    assert measure_host_bandwidth("cpu", 2**20, repeats=3, clock=clock) == 2**20 / 1e-3
    assert len(copies) == 2 * 2 * 3  # two readings per timed copy, three copies each way
    measured = measure_host_bandwidth("cpu", 2**20)  # the wall clock: a copy takes some time
    print(f"host copy: {measured / 1e9:.1f} GB/s at 1 MiB")
    assert 0 < measured < float("inf")


class _Allocations(torch.fx.Interpreter):
    """Runs a joint graph on real tensors, recording the bytes of the storages each node makes."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)  # keep every value: storage ids stay unique
        self.seen: set[int] = set()
        self.new_bytes: dict[str, int] = {}

    def run_node(self, n):
        result = super().run_node(n)
        made = 0
        for t in torch.utils._pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.seen:
                self.seen.add(t.untyped_storage()._cdata)
                made += t.untyped_storage().nbytes()
        self.new_bytes[n.name] = made if n.op == "call_function" else 0
        return result


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LIBRARY_STYLE))
def test_every_node_allocates_the_bytes_the_cost_model_says(name):
    # Per node, not per peak: a storage counted too small anywhere could make a plan go over.
    # The spectral model's slice assignments become functional copy/scatter ops, which
    # clone the whole storage of a strided slice (fake tensors report less).
    torch.manual_seed(0)
    model, args = LIBRARY_STYLE[name]()
    cap = capture(memplan.WithLoss(model, square_loss), args)
    costs = annotate(cap.graph_module, get_profile("cpu"))
    inputs = [torch.randn(n.meta["val"].shape, dtype=n.meta["val"].dtype) if n.meta["val"].is_floating_point()
              or n.meta["val"].is_complex() else torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
              for n in cap.placeholders()]
    real = _Allocations(cap.graph_module)
    with torch.no_grad():
        real.run(*inputs)
    wrong = {n.name: (costs.values[n.name].new_bytes, real.new_bytes[n.name])
             for n in cap.graph.nodes if n.op == "call_function" and costs.values[n.name].new_bytes != real.new_bytes[n.name]}
    assert not wrong, wrong


def test_profiling_times_ops_that_read_expanded_tensors():
    # The gradient of a sum is an expand: stride 0. Synthetic inputs for the ops that read it
    # keep those strides; filling such a tensor in place is refused, so the storage is filled.
    class SumOfSquares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x).relu() * x).sum(dim=1, keepdim=True).expand(-1, 32) * x

    model = SumOfSquares()
    cap = capture(model, (torch.randn(8, 32),))
    strided = [n.name for n in cap.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor) and 0 in n.meta["val"].stride()]
    assert strided, "the graph should hold a stride-0 value"
    times = measure_op_times(cap.graph_module, "cpu")
    readers = [u.name for n in cap.graph.nodes if n.name in strided for u in n.users if u.op == "call_function"]
    assert readers and all(times[r] > 0 for r in readers)
    opt = memplan.optimize(model, 10**12, profile=True, example_inputs=(torch.randn(8, 32),))
    x = torch.randn(8, 32)
    opt(x).sum().backward()
    planned = model.lin.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(planned, model.lin.weight.grad)
