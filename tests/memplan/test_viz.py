"""memplan.viz: the numbers behind the plots agree with the plan, and every plot renders to a PNG."""
from __future__ import annotations

import numpy as np
import pytest

import memplan
import solvers
from memplan import viz
from memplan.problem import BACKWARD

from .helpers import build_step

pytest.importorskip("matplotlib")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plan():
    """A tiny GPT planned tight enough to recompute something."""
    module, args, kwargs = build_step("gpt", meta=True)
    analysis = memplan.analyze(module, args, kwargs)
    p = memplan.plan.solve_plan(analysis, int(analysis.eager_peak * 0.85))
    assert any(d.decision == "recompute" for d in p.decisions)
    return p


def _png(fig, path) -> bytes:
    fig.savefig(path, dpi=60)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    return data


def test_timelines_come_from_the_simulator(plan):
    eager, planned = viz.memory_timelines(plan)
    assert planned.peak == plan.predicted_peak <= plan.budget
    assert eager.peak == plan.store_all_peak
    assert planned.total_time == pytest.approx(plan.predicted_time)
    assert eager.total_time == pytest.approx(plan.store_all_time)
    assert 0 < planned.backward_start < planned.total_time
    assert len(planned.time) == len(planned.memory) == len(plan.schedule) + 1


@pytest.mark.parametrize("width", [1, 7, 80, 5000])
def test_resampling_never_hides_the_peak(plan, width):
    _, planned = viz.memory_timelines(plan)
    strip = viz.resample_max(planned, width)
    assert len(strip) == width
    assert strip.max() == planned.peak
    assert strip.min() >= planned.memory.min()


def test_rs_matrices_match_the_schedule(plan):
    rs = viz.rs_matrices(plan)
    sim = solvers.simulate(plan.analysis.lowered.problem, plan.schedule)
    n = len(rs.values)
    assert rs.R.shape[1] == rs.S.shape[1] == n
    # Stage t computes value t for the first time: the diagonal is full.
    assert rs.R[np.arange(n), np.arange(n)].all()
    assert int(rs.R.sum()) - n == sim.recomputations
    # Nothing is resident before it was first computed.
    assert not np.triu(rs.S[:n, :n]).any()
    assert rs.values[rs.backward_stage] == BACKWARD


def test_layer_breakdown_accounts_for_every_saved_byte(plan):
    rows = viz.layer_breakdown(plan, depth=2)
    labels = [r.module for r in rows]
    assert "blocks.0" in labels and "blocks.1" in labels and "(loss)" in labels
    saved = sum(r.kept_bytes + r.recomputed_bytes + r.offloaded_bytes for r in rows)
    assert saved == plan.analysis.activation_bytes
    assert sum(r.recomputed_bytes for r in rows) > 0
    extra = sum(r.recompute_time for r in rows)
    assert extra == pytest.approx(plan.predicted_time - plan.store_all_time, rel=1e-6, abs=1e-12)
    deeper = viz.layer_breakdown(plan, depth=3)
    assert len(deeper) > len(rows) and any(r.module.startswith("blocks.0.attn") for r in deeper)


def test_plot_memory(plan, tmp_path):
    fig = viz.plot_memory(plan)
    assert len(fig.axes) == 1
    assert len(fig.axes[0].get_lines()) == 3  # eager, planned, budget
    _png(fig, tmp_path / "memory.png")


def test_plot_rs_matrices(plan, tmp_path):
    fig = viz.plot_rs_matrices(plan)
    assert len(fig.axes) == 2
    assert all(len(ax.get_images()) == 1 for ax in fig.axes)
    _png(fig, tmp_path / "rs.png")


def test_plot_layers(plan, tmp_path):
    fig = viz.plot_layers(plan)
    assert len(fig.axes) == 1
    rows = viz.layer_breakdown(plan)
    assert len(fig.axes[0].patches) == 3 * len(rows)  # kept, recomputed, offloaded per row
    _png(fig, tmp_path / "layers.png")


def test_sweep_and_curve(plan, tmp_path):
    a = plan.analysis
    low = viz.min_budget(a)
    points = viz.sweep(a, [("100%", a.eager_peak), ("min", low), ("half min", low // 2)])
    assert [p.feasible for p in points] == [True, True, False]
    assert points[0].plan.predicted_overhead <= points[1].plan.predicted_overhead
    assert points[2].min_budget is not None and points[2].min_budget >= low // 2
    assert points[2].as_dict()["status"] == "infeasible"
    fig = viz.plot_budget_curve(points, eager_peak=a.eager_peak)
    assert len(fig.axes) == 1
    assert len(fig.axes[0].get_lines()) == 2  # the curve and the eager-peak line
    _png(fig, tmp_path / "curve.png")


def test_timelines_and_plot_count_gradients_held_from_an_earlier_step(tmp_path):
    # Gradient accumulation: the second step starts with the parameters' gradients on the device
    # and gets a plan for what they leave of the budget. Its timeline shows them all step long,
    # so the plotted peak is the plan's predicted one (which counts them) and the measured one.
    import torch

    from memplan.measure import measure_peak

    module, args, kwargs = build_step("mlp")
    opt = memplan.optimize(module, 10**12, example_inputs=args, example_kwargs=kwargs)
    opt(*args, **kwargs).backward()
    torch.manual_seed(0)
    measured = measure_peak(lambda: opt(*args, **kwargs).backward())
    held = opt.plan.held_gradient_bytes
    assert held == sum(p.numel() * p.element_size() for p in module.parameters())
    eager, planned = viz.memory_timelines(opt.plan)
    assert planned.peak == opt.plan.predicted_peak
    assert abs(measured - planned.peak) <= 0.01 * measured, (measured, planned.peak)
    assert planned.memory.min() >= held and eager.peak == opt.plan.store_all_peak + held
    _png(viz.plot_memory(opt.plan), tmp_path / "held.png")


def test_plot_memory_keeps_a_far_budget_off_its_scale(plan):
    # optimize(model, "1TB") keeps everything: a 1 TB budget line would flatten both curves.
    import dataclasses

    far = dataclasses.replace(plan, budget=10**12)
    (ax,) = viz.plot_memory(far).axes
    assert ax.get_ylim()[1] < 2 * max(plan.store_all_peak, plan.predicted_peak) / _unit_of(ax)
    assert any("off the scale" in t.get_text() for t in ax.get_legend().get_texts())
    (ax,) = viz.plot_memory(plan).axes  # a budget near the peaks stays on the scale, as a line
    assert ax.get_ylim()[1] >= plan.budget / _unit_of(ax)


def _unit_of(ax) -> float:
    """Bytes per unit of the memory axis, read off its label ("device memory (MB)")."""
    unit = ax.get_ylabel().rsplit("(", 1)[1].rstrip(")")
    return {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]
