"""memplan.tools.viz: the numbers behind the plots agree with the plan, and every plot renders to a PNG."""
from __future__ import annotations

import numpy as np
import pytest

import memplan
import solvers
from memplan.tools import viz
from memplan.planning.lowering import BACKWARD

from .helpers import build_step

pytest.importorskip("matplotlib")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plan():
    """A tiny GPT planned tight enough to recompute something."""
    module, args, kwargs = build_step("gpt", meta=True)
    analysis = memplan.analyze(module, args, kwargs)
    p = memplan.pipeline.plan.solve_plan(analysis, int(analysis.eager_peak * 0.75))
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


@pytest.mark.slow
def test_sweep_and_curve(plan, tmp_path):
    a = plan.analysis
    low = memplan.min_budget(a)
    points = memplan.sweep(a, [("100%", a.eager_peak), ("min", low), ("half min", low // 2)])
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

    from memplan.measure.tracker import measure_peak

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


# --------------------------------------------------------------------------- #
# The whole step: memory by what holds it (memory_breakdown, plot_memory, the update phase)
# --------------------------------------------------------------------------- #


def _whole_step(**options):
    """An MLP's step with AdamW planned through ``memplan.optimize``: (plan, module); skips when
    this tree's ``optimize`` does not take ``options`` yet (host state, accumulation)."""
    import torch

    module, args, kwargs = build_step("mlp", batch_size=64)
    try:
        opt = memplan.optimize(module, 10**12, solver="store_all", optimizer=torch.optim.AdamW(module.parameters()),
                               example_inputs=args, example_kwargs=kwargs, **options)
    except TypeError as exc:
        if options and "option" in str(exc):
            pytest.skip(f"memplan.optimize takes no {', '.join(options)} here: {exc}")
        raise
    return opt.plan, module


@pytest.fixture(scope="module")
def whole_step():
    """AdamW's state and updates in the plan, under a budget that makes the plan recompute; one
    optimizer call per parameter, so that the updates run along backward."""
    from memplan.core.config import override

    with override(bucket_bytes=0):
        store_all, _ = _whole_step()
    a = store_all.analysis
    assert a.optimizer_state_bytes > 0 and a.lowered.updates
    budget = max(int(a.graph_peak - 0.4 * a.activation_bytes), memplan.min_budget(a))
    p = memplan.pipeline.plan.solve_plan(a, budget, time_limit=1)
    assert any(d.decision == "recompute" for d in p.decisions)
    return p


@pytest.fixture(scope="module")
def after_backward():
    """The same step with every update waiting for the end of backward (``GRADS_FINAL``)."""
    p, _ = _whole_step(updates_after_backward=True)
    assert p.analysis.lowered.updates_after_backward
    return p


def _simulated(plan) -> np.ndarray:
    """The one simulator's memory before the first step and after each step of the plan."""
    problem = memplan.pipeline.plan.problem_for(plan.analysis, plan.budget, plan.schedule.has_transfers())
    sim = solvers.simulate(problem, plan.schedule)
    return np.concatenate([[sim.initial], sim.timeline]) + plan.held_gradient_bytes


@pytest.mark.parametrize("which", ["whole_step", "after_backward", "plan"])
def test_breakdown_adds_up_to_the_simulated_memory_at_every_step(which, request):
    plan = request.getfixturevalue(which)
    bd = viz.memory_breakdown(plan)
    _, planned = viz.memory_timelines(plan)
    assert len(bd.time) == len(plan.schedule) + 1
    np.testing.assert_array_equal(bd.total, _simulated(plan))
    np.testing.assert_array_equal(bd.total, planned.memory)
    assert int(bd.total.max()) == plan.predicted_peak
    for name, _, _ in viz.BREAKDOWN_CATEGORIES:
        assert (getattr(bd, name) >= 0).all(), name
    a = plan.analysis
    # The primals and graph constants (a loss's target) are resident all step; nothing else counts with them.
    problem = a.lowered.problem
    constants = sum(int(problem.mem[v]) for v in problem.sources if str(problem.names[v]).startswith("attr:"))
    assert (bd.parameters == a.param_bytes + a.buffer_bytes + a.input_bytes + constants).all()
    assert bd.gradients.max() > 0 and bd.activations.max() > 0
    assert sum(bd.at(bd.peak_index).values()) == plan.predicted_peak


@pytest.mark.parametrize("which", ["whole_step", "after_backward"])
def test_optimizer_state_category_is_the_device_state_at_every_step(which, request):
    plan = request.getfixturevalue(which)
    bd = viz.memory_breakdown(plan)
    state = plan.analysis.optimizer_state_bytes
    assert state > 0
    assert (bd.optimizer_state == state).all()
    assert bd.host_optimizer_state_bytes == 0 and bd.host_state_params == 0


def test_update_phase_and_gradients_of_the_whole_step(whole_step, after_backward):
    for plan in (whole_step, after_backward):
        bd = viz.memory_breakdown(plan)
        assert bd.backward_start < bd.update_start < bd.update_end <= bd.time[-1]
        # Each update frees the gradient it applies: none is left when the step ends.
        assert bd.gradients[-1] == 0
    bd = viz.memory_breakdown(after_backward)
    # Updates after backward: every gradient is final, and all of them held, when the first starts.
    start = int(np.searchsorted(bd.time, bd.update_start, side="right"))
    assert bd.gradients[start] == bd.gradients.max() > 0
    assert bd.update_start > viz.memory_breakdown(whole_step).update_start


def test_without_an_optimizer_the_gradients_are_held_to_the_end(plan):
    bd = viz.memory_breakdown(plan)
    assert bd.update_start is None and bd.update_end is None
    assert not bd.optimizer_state.any() and not bd.accumulated_gradients.any()
    # Every parameter's gradient is a sink: on the device at the end, at its own size.
    assert bd.gradients[-1] == plan.analysis.param_bytes


def _categories(problem, **named) -> list[int]:
    """Per node of ``problem``, its row of BREAKDOWN_CATEGORIES: ``named`` node -> category, else activations."""
    row = {name: i for i, (name, _, _) in enumerate(viz.BREAKDOWN_CATEGORIES)}
    return [row[named.get(str(v), "activations")] for v in problem.names]


def _rows(problem, steps, **named) -> dict[str, list[int]]:
    schedule = solvers.Schedule.from_list(steps)
    rows = viz.category_bytes(problem, schedule, _categories(problem, **named))
    sim = solvers.simulate(problem, schedule)
    np.testing.assert_array_equal(rows.sum(axis=0), np.concatenate([[sim.initial], sim.timeline]))
    return {name: rows[i].tolist() for i, (name, _, _) in enumerate(viz.BREAKDOWN_CATEGORIES)}


def test_category_bytes_follow_the_alias_rule():
    import networkx as nx

    # A gradient that is a view of a backward temporary: its bytes are the temporary's while the
    # temporary is resident, the gradient's own once it is freed.
    G = nx.DiGraph()
    G.add_node("p", mem=10, cost=0.0, recomputable=False)
    G.add_node("mm", mem=100, cost=1.0)
    G.add_node("grad", mem=100, cost=0.0, alias_of="mm")
    G.add_node("h", mem=5, cost=1.0)
    G.add_edges_from([("p", "mm"), ("mm", "grad"), ("grad", "h")])
    problem = solvers.Problem.from_networkx(G, budget=10**6)
    rows = _rows(problem, [("compute", "mm"), ("compute", "grad"), ("free", "mm"), ("compute", "h")],
                 p="parameters", grad="gradients")
    assert rows["parameters"] == [10] * 5
    assert rows["activations"] == [0, 100, 100, 0, 5]
    assert rows["gradients"] == [0, 0, 0, 100, 100]

    # Two whole-storage views of one freed storage (unbind's outputs): one storage, counted once.
    G = nx.DiGraph()
    G.add_node("p", mem=0, cost=0.0, recomputable=False)
    G.add_node("base", mem=64, cost=1.0)
    G.add_edge("p", "base")
    for v in ("v1", "v2"):
        G.add_node(v, mem=64, cost=0.0, alias_of="base", same_storage=True)
        G.add_edge("base", v)
    G.add_node("out", mem=1, cost=1.0)
    G.add_edges_from([("v1", "out"), ("v2", "out")])
    problem = solvers.Problem.from_networkx(G, budget=10**6)
    rows = _rows(problem, [("compute", "base"), ("compute", "v1"), ("compute", "v2"), ("free", "base"),
                           ("compute", "out")], v1="gradients", v2="gradients")
    assert rows["gradients"] == [0, 0, 0, 0, 64, 64]
    assert rows["activations"] == [0, 64, 64, 64, 0, 1]


def test_category_bytes_show_what_came_back_from_host():
    import networkx as nx

    G = nx.DiGraph()
    G.add_node("p", mem=0, cost=0.0, recomputable=False)
    G.add_node("x", mem=30, cost=1.0)
    G.add_node("y", mem=2, cost=1.0)
    G.add_edges_from([("p", "x"), ("x", "y")])
    problem = solvers.Problem.from_networkx(G, budget=10**6, host_bandwidth=1e9)
    rows = _rows(problem, [("compute", "x"), ("offload", "x"), ("free", "x"), ("prefetch", "x"), ("compute", "y"),
                           ("free", "x")])
    assert rows["activations"] == [0, 30, 30, 0, 0, 2, 2]
    assert rows["from_host"] == [0, 0, 0, 0, 30, 30, 0]


def test_plot_memory_of_the_whole_step(whole_step, after_backward, tmp_path):
    for plan, phase in ((whole_step, "updates (during backward)"), (after_backward, "updates")):
        fig = viz.plot_memory(plan)
        (ax,) = fig.axes
        assert len(ax.get_lines()) >= 3  # eager, planned, budget (and the update phase's edges)
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        for needle in ("optimizer state", "gradients", "activations", "parameters"):
            assert any(text.startswith(needle) for text in legend), (needle, legend)
        assert phase in [t.get_text().strip() for t in ax.texts]
        assert len(ax.collections) >= 4  # one area per category that holds bytes, and the peak marker
        _png(fig, tmp_path / "whole_step.png")


def test_plot_memory_notes_optimizer_state_in_host_memory(tmp_path):
    plan, _ = _whole_step(optimizer_state="host")
    a = plan.analysis
    if not getattr(a, "host_optimizer_state_bytes", 0):
        pytest.skip("this tree keeps no optimizer state in host memory")
    bd = viz.memory_breakdown(plan)
    assert not bd.optimizer_state.any()  # none of it on the device: no area
    assert bd.host_optimizer_state_bytes == a.host_optimizer_state_bytes
    assert bd.host_state_params == len(a.lowered.updates)
    (ax,) = viz.plot_memory(plan).axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(text.startswith("optimizer state in host memory") for text in legend), legend
    assert not any(text.startswith("optimizer state:") for text in legend), legend


def test_accumulated_gradients_category():
    plan, _ = _whole_step(accumulate_steps=2)
    accumulated = getattr(plan.analysis, "accumulated_gradient_bytes", 0)
    if not accumulated:
        pytest.skip("this tree holds no accumulation buffers in the Problem")
    bd = viz.memory_breakdown(plan)
    assert (bd.accumulated_gradients == accumulated).all()
    np.testing.assert_array_equal(bd.total, _simulated(plan))
