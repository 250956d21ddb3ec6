"""The check every compiled run passes before it is used: its peak and the bytes its outputs keep are
at most its eager twin's, and it is not slower (timed by `TUNABLES.clock`, which tests replace)."""
from __future__ import annotations
from typing import Any, Callable
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from memplan.measure.tracker import allocated_during
from memplan.core.storage import storage_key
from memplan.runtime.inductor.compiler import example_inputs
from memplan.core.config import TUNABLES




def _peak_of(fn: Callable[[], Any], device: torch.device, lay_out: bool = False) -> tuple[int, int, list[torch.Tensor]]:
    """(peak bytes allocated while ``fn`` runs, bytes its result keeps alive, with ``lay_out`` fake
    tensors laid out as its result is, else []), from the allocator."""
    kept: list[int] = []
    layouts: list[torch.Tensor] = []

    def call() -> None:
        result = fn()
        kept.append(sum({storage_key(t): t.untyped_storage().nbytes()
                         for t in result if isinstance(t, torch.Tensor)}.values()))
        if lay_out:
            with FakeTensorMode():
                layouts.extend(example_inputs(list(result), device, whole=True))

    return allocated_during(call, device), kept[0], layouts


def check_run(compiled: Callable[[list], Any], eager: fx.GraphModule, vals: list[torch.Tensor], keep: list[bool],
           device: torch.device, traced: list[torch.Tensor] | None = None) -> tuple[int, int, str, list[torch.Tensor]]:
    """Run both on zero inputs (those marked in ``keep`` stay referenced, as values read later
    do in the step), the compiled run laid out as ``vals``, its eager twin as ``traced`` (as the
    plan's eager step has them; default ``vals``): (compiled peak, eager peak, why the compiled
    run is refused, or "", the compiled run's outputs as laid out, fake)."""

    def call(fn: Callable[[list], Any], vals: list[torch.Tensor]) -> Callable[[], Any]:
        held: list[torch.Tensor] = []

        def run() -> Any:
            box = example_inputs(vals, device)
            held.extend(t for t, k in zip(box, keep) if k)
            return fn(box)
        return run

    c_peak, c_kept, layouts = _peak_of(call(compiled, vals), device, lay_out=True)
    e_peak, e_kept, _ = _peak_of(call(eager, vals if traced is None else traced), device)
    if c_kept > e_kept:
        return c_peak, e_peak, f"outputs keep {c_kept} B > eager {e_kept} B", layouts
    return c_peak, e_peak, "", layouts


def seconds_per_call(fn: Callable[[list], Any], vals: list[torch.Tensor], device: torch.device, reps: int = 2) -> float:
    """The best of ``reps`` timed calls of ``fn`` on zero inputs (the inputs made outside the timing)."""
    return best_times([(fn, vals)], device, reps)[0]


def best_times(calls: list[tuple[Callable[[list], Any], list[torch.Tensor]]], device: torch.device,
             reps: int) -> list[float]:
    """Each call's best of ``reps`` timings on zero inputs, the calls taken in turn each round, so
    that a burst of other work on the machine falls on all of them alike."""
    best = [float("inf")] * len(calls)
    for _ in range(reps):
        for i, (fn, vals) in enumerate(calls):
            box = example_inputs(vals, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = TUNABLES.clock()
            out = fn(box)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], TUNABLES.clock() - started)
            del out
    return best
