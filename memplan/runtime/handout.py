"""Hand parameters' gradients to a distributed engine as the planned backward makes them final.

DistributedDataParallel learns that a parameter's gradient is ready from a hook on the
parameter's gradient accumulator, which autograd runs when it accumulates into ``.grad``. The
planned backward is one ``autograd.Function``: returned from it, every gradient would reach
autograd at its end, and DDP could start no all-reduce while backward still runs. So the
backward segment calls a `GradientHandout` right after the step that makes the last
gradient of each group (`handout_groups`): it sets each parameter's ``.grad`` to its gradient
(the same tensor: no copy), then runs autograd from the parameters with zero gradients (a
scalar expanded to the parameter's shape: nothing allocated), which adds nothing and runs the
engine's hooks. A gradient added to one already held (``.grad`` kept from an earlier backward)
goes in as autograd adds it, in place.

DDP launches a bucket's all-reduce once each gradient in it is marked, and finishes the
reduction (the averaged gradients written back to ``.grad``) at the end of the autograd call
that marked the last one: after the last group, every ``.grad`` holds the averaged gradient.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn


def handout_groups(order: Sequence[tuple[int, int]], cap: int) -> list[tuple[int, ...]]:
    """Groups of ``order``'s primal indices (``(index, gradient bytes)`` in the order the schedule
    makes the gradients final), each cut when it reaches ``cap`` bytes (one gradient always fits):
    one autograd call per group hands them out."""
    groups: list[list[int]] = []
    size = cap  # start a group with the first gradient
    for index, nbytes in order:
        if size >= cap or not groups:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += nbytes
    return [tuple(g) for g in groups]


class GradientHandout(nn.Module):
    """Called by the backward segment with one group's gradients (`handout_groups`); the step's
    parameters are bound by `begin` before the segment runs."""

    def __init__(self, groups: list[tuple[int, ...]]):
        super().__init__()
        self.groups = groups
        self.primals: tuple[int, ...] = tuple(i for g in groups for i in g)  # every index handed out
        # Per index of `primals`: the tangents its gradient depends on (`memplan.runtime.program.tangents_reaching`).
        self.tangents: list[frozenset[int]] = [frozenset()] * len(self.primals)
        self._params: dict[int, torch.Tensor] = {}
        self._skipped: frozenset[int] = frozenset()
        self._handed = 0

    def begin(self, params: Sequence[torch.Tensor], skipped: frozenset[int] = frozenset()) -> None:
        """A backward starts; ``params`` are the step's parameters at `primals`, in that order;
        those in ``skipped`` get no gradient from it (the loss reached none of the outputs theirs
        depends on): as eager autograd, nothing is handed out for them."""
        self._params = dict(zip(self.primals, params, strict=True))
        self._skipped = skipped
        self._handed = 0

    def finish(self) -> None:
        """The backward segment returned: every group must have gone out (else the engine waits forever)."""
        handed, self._params = self._handed, {}
        if handed != len(self.groups):
            raise RuntimeError(f"memplan runtime: the planned backward handed out {handed} of "
                               f"{len(self.groups)} gradient groups")

    def forward(self, group: int, grads: list[torch.Tensor]) -> None:
        kept = [(i, g) for i, g in zip(self.groups[group], grads, strict=True) if i not in self._skipped]
        params = [self._params[i] for i, _ in kept]
        grads = [g for _, g in kept]
        given: list[torch.Tensor] = []
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
                given.append(torch.zeros((), dtype=g.dtype, device=g.device).expand(p.shape))
            else:
                given.append(g)
        if params:
            torch.autograd.backward(params, given)
        self._handed += 1
