"""Layouts across compiled runs: values a run returns in another layout than traced, and the guard
that copies them back where eager code needs the traced one."""
from __future__ import annotations
import warnings
from typing import Any, Callable
import torch
from memplan.runtime.inductor.reports import CompileWarning


class Restrided:
    """A Python step: its inputs copied into the given strides, the originals let go."""

    def __init__(self, strides: list[tuple[int, ...]]):
        self.strides = strides

    def __call__(self, box: list) -> tuple[torch.Tensor, ...]:
        values = list(box)
        box.clear()
        out = []
        while values:  # each original is freed once its copy is made
            t = values.pop(0)
            out.append(torch.empty_strided(t.shape, self.strides[len(out)], dtype=t.dtype,
                                           device=t.device).copy_(t))
            del t
        return tuple(out)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill the span they reach, each place once (in some order of dimensions)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def layout_of(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that matter: those of dimensions longer than 1 (others never move an index)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


class LayoutGuard:
    """A compiled run that runs only on inputs laid out as it was compiled for.

    Inductor's code asserts its inputs' strides. The layouts come from the capture's fake
    tensors, and an eager kernel may lay out its output otherwise (a CPU convolution choosing
    channels-last, or not): the first call whose inputs differ switches the run to its eager
    twin for good, with a `CompileWarning`."""

    def __init__(self, compiled: Callable[[list], Any], eager: Callable[[list], Any], vals: list[torch.Tensor],
                 where: str):
        self.compiled: Callable[[list], Any] | None = compiled
        self.eager, self.where = eager, where
        self.layouts = [layout_of(v) for v in vals]

    def __call__(self, box: list) -> Any:
        if self.compiled is not None:
            if all(layout_of(t) == lay for t, lay in zip(box, self.layouts)):
                return self.compiled(box)
            warnings.warn(f"memplan: {self.where} was compiled for other input strides than the step gives it "
                          f"(an eager kernel chose another layout); it runs eagerly from now on", CompileWarning,
                          stacklevel=2)
            self.compiled = None
        return self.eager(box)
