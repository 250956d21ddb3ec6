"""analyze(): predicted peaks and FLOPs against measurements of the real step."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import memplan
from memplan.measure import measure_peak

from .helpers import build_step, clear_grads

ZOO = ["mlp", "cnn", "gpt", "unet"]
PEAKS: dict[str, tuple[int, int, int, int]] = {}


def _eager_step(module, args, kwargs):
    def step():
        module(*args, **kwargs).backward()

    return step


@pytest.mark.parametrize("name", ZOO)
def test_eager_peak_within_10_percent_of_measured(name):
    module, args, kwargs = build_step(name)
    a = memplan.analyze(module, args, kwargs)
    torch.manual_seed(0)
    clear_grads(module)
    measured = measure_peak(_eager_step(module, args, kwargs))
    print(f"{name}: eager predicted {a.eager_peak} measured {measured} ({a.eager_peak / measured - 1:+.2%})")
    assert abs(a.eager_peak - measured) <= 0.10 * measured


@pytest.mark.parametrize("name", ZOO)
def test_graph_peak_within_3_percent_of_running_the_graph(name):
    module, args, kwargs = build_step(name)
    opt = memplan.optimize(module, 10**12, solver="store_all", example_inputs=args, example_kwargs=kwargs)
    predicted = opt.plan.predicted_peak
    assert predicted == opt.plan.analysis.graph_peak
    clear_grads(module)
    measured = measure_peak(_eager_step(opt, args, kwargs))
    print(f"{name}: graph predicted {predicted} measured {measured} ({predicted / measured - 1:+.2%})")
    assert abs(predicted - measured) <= 0.03 * measured


@pytest.mark.parametrize("name", ZOO)
def test_flops_within_1_percent_of_flop_counter(name):
    module, args, kwargs = build_step(name)
    a = memplan.analyze(module, args, kwargs)
    with FlopCounterMode(display=False) as fc:
        module(*args, **kwargs).backward()
    expected = fc.get_total_flops()
    assert expected > 0
    assert abs(a.flops - expected) <= 0.01 * expected, (a.flops, expected)


def test_activation_and_param_bytes():
    module, args, kwargs = build_step("mlp")
    a = memplan.analyze(module, args, kwargs)
    assert a.param_bytes == sum(p.numel() * p.element_size() for p in module.parameters())
    assert 0 < a.activation_bytes < a.eager_peak
    assert a.num_nodes > 10
