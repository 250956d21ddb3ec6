"""One model through every method: reference, cells, interleaved timing.

Order of work for a model:

1. eager reference: gradients (seeded) and the measured peak; the budgets
   are fractions of that peak;
2. every method fills its cells, measuring each configuration once (peak and
   gradients against eager);
3. every distinct configuration, eager included, is timed in ``reps``
   interleaved rounds (one step each per round, in the same process, the
   order rotated each round so that no configuration always follows the
   same one); a configuration's time ratio is the median over rounds of its
   time over eager's time in the same round, and its spread the smallest and
   largest of those per-round ratios.

Compiled configurations are measured with the profiler
(``memplan.measure.tracker.profiled_peak``), the others with the dispatch-mode
tracker; eager's step is measured both ways so the two can be compared
(they agree to the byte on steps without convolutions; see
``benchmarks/studies/measure_agreement.py``).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.harness.config import BenchConfig, ModelSpec
from benchmarks.harness.core import Candidate, Cell, ModelUnderTest
from benchmarks.harness.methods import DEFAULT_METHODS, EAGER, METHODS
from benchmarks.harness.steps import (
    clear_grads,
    collect_grads,
    float32_noise,
    measure_step_peak,
    time_step,
)


@dataclass
class ModelResult:
    """Everything the report needs about one model."""

    spec: ModelSpec
    description: str
    eager_peak: int
    eager_time_s: float  # median eager step time
    eager_profiled_peak: int | None  # eager's step measured as compiled steps are (the profiler)
    budgets: list[tuple[str, int]]
    cells: list[Cell]
    runtime_s: float
    notes: list[str] = field(default_factory=list)

    def cell(self, budget_label: str, method: str) -> Cell | None:
        return next((c for c in self.cells if c.budget_label == budget_label and c.method == method), None)

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(c.method for c in self.cells))


def budget_label(fraction: float) -> str:
    return f"{fraction:.0%}"


def _log(msg: str) -> None:
    print(msg, flush=True)


def _reference(mut: ModelUnderTest) -> Candidate:
    """Eager: seeded gradients to compare against, their float32 noise, then a measured step."""
    clear_grads(mut.eager_params)
    torch.manual_seed(0)
    loss = mut.step(*mut.args, **mut.kwargs)  # warm-up, and the reference gradients
    loss.backward()
    mut.ref_grads = collect_grads(mut.eager_params)
    mut.grad_noise = _float32_noise(mut, loss.item())
    eager = mut.measure(Candidate(EAGER, "torch autograd", mut.step, mut.eager_params))
    mut.eager_peak = eager.peak or 0
    return eager


def _float32_noise(mut: ModelUnderTest, loss32: float) -> dict[str, float]:
    """Eager float32's gradient error against the same step in float64.

    Trusted only when the float64 step drew the same dropout masks (its loss
    agrees with float32's); otherwise no noise allowance is made.
    """
    module, params = mut.twin()
    module.double()

    def to64(x):
        return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    args = tuple(to64(a) for a in mut.args)
    kwargs = {k: to64(v) for k, v in mut.kwargs.items()}
    torch.manual_seed(0)
    try:
        loss = module(*args, **kwargs)
        loss.backward()
    except RuntimeError:  # a loss closure holding float32 tensors, say
        return {}
    if abs(loss.item() - loss32) > 1e-4 * max(1.0, abs(loss32)):
        return {}
    return float32_noise(mut.ref_grads, collect_grads(params))


def _compile_cache(cfg: BenchConfig) -> contextlib.AbstractContextManager:
    """An empty Inductor cache for one method (``cfg.cold_compile``), or the user's cache as it is."""
    if not cfg.cold_compile:
        return contextlib.nullcontext()
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


def _eager_profiled_peak(mut: ModelUnderTest, eager: Candidate) -> int | None:
    """Eager's step measured with the profiler, the measurement of the compiled rows (CPU only)."""
    if mut.inputs.device.type != "cpu":
        return None
    peak = measure_step_peak(eager.module, eager.params, mut.inputs, compiled=True)
    clear_grads(eager.params)
    return peak


def _time_interleaved(cands: list[Candidate], mut: ModelUnderTest, reps: int) -> None:
    """Median and (min, max) of per-round ratios to eager (``cands[0]``).

    Round ``r`` starts at configuration ``r mod n``: a step right after a
    heavy one (a cold cache, the allocator returning memory) is not always
    the same configuration's.
    """
    for c in cands:
        c.times = []
    for r in range(reps):
        shift = r % len(cands)
        for c in cands[shift:] + cands[:shift]:
            c.times.append(time_step(c.module, c.params, mut.inputs))
    eager = cands[0].times
    for c in cands:
        ratios = [t / e for t, e in zip(c.times, eager)]
        c.time_ratio = statistics.median(ratios)
        c.ratio_spread = (min(ratios), max(ratios))
        clear_grads(c.params)


def run_model(spec: ModelSpec, cfg: BenchConfig) -> ModelResult:
    start = time.perf_counter()
    device = torch.device(cfg.device)
    mut = ModelUnderTest.build(spec, device)
    eager = _reference(mut)
    eager_profiled = _eager_profiled_peak(mut, eager)
    budgets = [(budget_label(f), int(f * mut.eager_peak)) for f in cfg.fractions]
    _log(f"[{spec.name}] eager peak {mut.eager_peak / 1e6:.1f} MB; budgets " + ", ".join(l for l, _ in budgets))

    cells: list[Cell] = []
    options = dict(eager=eager, bisect_steps=cfg.bisect_steps, memplan_time_limit=cfg.memplan_time_limit)
    selected = cfg.methods or DEFAULT_METHODS
    for method, fn in METHODS.items():
        if method not in selected and method != EAGER:
            continue
        t0 = time.perf_counter()
        with _compile_cache(cfg):
            new = fn(mut, list(budgets), **options)
        cells += new
        _log(f"[{spec.name}] {method}: {time.perf_counter() - t0:.1f} s")

    # Each distinct configuration once, eager first.
    cands: list[Candidate] = [eager]
    for c in cells:
        if c.candidate is not None and all(c.candidate is not k for k in cands):
            cands.append(c.candidate)
    t0 = time.perf_counter()
    _time_interleaved(cands, mut, cfg.reps)
    _log(f"[{spec.name}] timing {len(cands)} configurations x {cfg.reps}: {time.perf_counter() - t0:.1f} s")

    return ModelResult(
        spec=spec,
        description=mut.description,
        eager_peak=mut.eager_peak,
        eager_time_s=statistics.median(eager.times),
        eager_profiled_peak=eager_profiled,
        budgets=budgets,
        cells=cells,
        runtime_s=time.perf_counter() - start,
    )


def run(cfg: BenchConfig) -> list[ModelResult]:
    """Every model of ``cfg`` in turn (CPU: with ``cfg.threads`` intra-op threads)."""
    threads = torch.get_num_threads()
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    try:
        results = []
        for spec in cfg.models:
            results.append(run_model(spec, cfg))
            torch._dynamo.reset()  # drop compiled graphs of the finished model
        return results
    finally:
        torch.set_num_threads(threads)
