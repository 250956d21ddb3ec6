"""Running, measuring and timing one training step of one configuration.

Every method is reduced to the same thing: a module whose call returns the
scalar loss (``memplan.WithLoss`` around the zoo model, possibly wrapped),
stepped as ``module(*args, **kwargs).backward()``. This module measures such a
step three ways:

* **peak**: ``memplan.measure_peak`` (the CPU storage tracker, or CUDA
  allocator statistics). On CPU, steps run by ``torch.compile`` (Inductor) are
  measured with ``memplan.measure.tracker.profiled_peak`` instead, the profiler's
  allocation events plus the step's state (parameters, buffers, inputs):
  dynamo runs a frame eagerly while a dispatch mode is active, and Inductor's
  CPU wrapper allocates its buffers outside the dispatcher
  (``empty_strided_cpu``), so the tracker would measure an eager step or miss
  the compiled code's buffers. On CUDA the bytes allocated
  before the step that are not this step's own state (other configurations'
  parameters, saved reference gradients) are subtracted, so that every
  configuration is charged only for what it touches, as on CPU.
* **gradients**: the step's parameter gradients against eager's from the
  same seed (``torch.testing.assert_close``).
* **time**: wall-clock seconds (``torch.cuda.synchronize`` around the step on
  CUDA).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

import memplan
from memplan.measure.tracker import measure_peak, profiled_peak

SEED = 0


@dataclass
class GradCheck:
    """Outcome of comparing one configuration's gradients with eager's.

    ``max_rel_err``: the largest ``max|g - g_eager| / max|g_eager|`` over
    parameters (an error relative to each gradient's scale).
    """

    ok: bool
    max_rel_err: float
    detail: str = ""

    def cell(self) -> str:
        return "pass" if self.ok else f"FAIL (rel {self.max_rel_err:.1e})"


@dataclass
class StepInputs:
    """The example inputs of a step and the device it runs on."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    device: torch.device
    # Tensors the step reads that are neither inputs nor module state: a loss
    # closure's targets. The profiler counts only what it is told was resident.
    constants: tuple[torch.Tensor, ...] = ()

    def step_fn(self, module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            module(*self.args, **self.kwargs).backward()

        return run

    def state_tensors(self, params: list[tuple[str, nn.Parameter]], module: nn.Module) -> list[torch.Tensor]:
        """Parameters, buffers and inputs: what a step touches before it starts."""
        tensors = [p for _, p in params] + list(module.buffers())
        tensors += [x for x in self.args if isinstance(x, torch.Tensor)]
        tensors += [x for x in self.kwargs.values() if isinstance(x, torch.Tensor)]
        return tensors + list(self.constants)

    def state_bytes(self, params: list[tuple[str, nn.Parameter]], module: nn.Module) -> int:
        """Bytes of the distinct storages of :meth:`state_tensors`."""
        seen: set[int] = set()
        total = 0
        for t in self.state_tensors(params, module):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        return total


def closure_tensors(fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
    """The tensors a function holds in its closure (a loss function's targets)."""
    cells = getattr(fn, "__closure__", None) or ()
    found = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor):
            found.append(value)
    return tuple(found)


def clear_grads(params: list[tuple[str, nn.Parameter]]) -> None:
    for _, p in params:
        p.grad = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step_peak(
    module: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    inputs: StepInputs,
    *,
    compiled: bool = False,
) -> int:
    """Peak bytes of one step of ``module`` (seeded; gradients cleared first)."""
    clear_grads(params)
    gc.collect()
    torch.manual_seed(SEED)
    step = inputs.step_fn(module)
    if inputs.device.type == "cuda":
        synchronize(inputs.device)
        before = torch.cuda.memory_allocated(inputs.device)
        own = inputs.state_bytes(params, module)
        return memplan.measure_peak(step, inputs.device) - before + own
    if compiled:
        return profiled_peak(step, resident=inputs.state_tensors(params, module))
    return memplan.measure_peak(step, inputs.device)


def collect_grads(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor | None]:
    """Gradients by (eager) parameter name, copied to the CPU."""
    return {n: None if p.grad is None else p.grad.detach().to("cpu", copy=True) for n, p in params}


# A recomputation replays the same kernels, but decompositions (torch.compile's
# "decomp" backends) change reduction orders, and some gradients are
# ill-conditioned enough in float32 (the convolutions under ResNet-50's
# BatchNorms are off by ~10% from float64) that any change of order shows.
# A wrong dropout mask or a missed gradient is off by the gradient's own
# magnitude. So a gradient passes when its error relative to its magnitude is
# within GRAD_REL_TOL plus NOISE_FACTOR times eager's own float32 error
# (eager float32 against eager float64, see :func:`float32_noise`).
GRAD_REL_TOL = 1e-3
NOISE_FACTOR = 4.0


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` (absolute when ``ref`` is zero)."""
    if got.shape != ref.shape:
        return float("inf")
    err = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return err / scale if scale else err


def float32_noise(
    fp32: dict[str, torch.Tensor | None], fp64: dict[str, torch.Tensor | None]
) -> dict[str, float]:
    """Per parameter: eager float32's gradient error relative to float64's."""
    return {
        n: relative_error(g, fp64[n]) if g is not None and fp64.get(n) is not None else 0.0
        for n, g in fp32.items()
    }


def compare_grads(
    got: dict[str, torch.Tensor | None],
    want: dict[str, torch.Tensor | None],
    noise: dict[str, float] | None = None,
) -> GradCheck:
    """Every gradient against eager's, with a tolerance scaled to eager's own float32 error."""
    worst = 0.0
    failures: list[str] = []
    for name, ref in want.items():
        g = got.get(name)
        if ref is None or g is None:
            if (ref is None) != (g is None):
                failures.append(f"{name}: gradient {'missing' if g is None else 'unexpected'}")
                worst = float("inf")
            continue
        err = relative_error(g, ref)
        worst = max(worst, err)
        scale = ref.abs().max().item() if ref.numel() else 0.0
        tol = GRAD_REL_TOL + NOISE_FACTOR * (noise or {}).get(name, 0.0)
        try:
            torch.testing.assert_close(g, ref, rtol=0.0, atol=tol * scale + 1e-12)
        except AssertionError:
            failures.append(name)
    return GradCheck(ok=not failures, max_rel_err=worst, detail=", ".join(failures[:3]))


def time_step(module: nn.Module, params: list[tuple[str, nn.Parameter]], inputs: StepInputs) -> float:
    """Wall-clock seconds of one seeded step (CUDA: synchronized)."""
    clear_grads(params)
    torch.manual_seed(SEED)
    step = inputs.step_fn(module)
    synchronize(inputs.device)
    start = time.perf_counter()
    step()
    synchronize(inputs.device)
    return time.perf_counter() - start


def peaks_and_interleaved_times(rows: Sequence[Any], repeats: int) -> None:
    """For whole steps that make optimizer state on their first run (each row: ``step()``, and
    ``peak``, ``times`` to fill): one warm-up step each, then each step's measured peak, then
    ``repeats`` rounds of one timed step per row, interleaved so that drifts of the machine hit
    every row alike. Each step is seeded the same."""
    for row in rows:
        torch.manual_seed(0)
        row.step()
        row.peak = measure_peak(row.step)
    for _ in range(repeats):
        for row in rows:
            torch.manual_seed(0)
            started = time.perf_counter()
            row.step()
            row.times.append(time.perf_counter() - started)


def training_step(module: nn.Module, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Callable[[], None]:
    """One whole training step as a loop writes it: forward, ``backward()``, ``step()``, ``zero_grad()``."""
    def step() -> None:
        module(*args, **kwargs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step
