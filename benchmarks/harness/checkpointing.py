"""The two ``torch.utils.checkpoint`` baselines people reach for first.

* :func:`checkpoint_blocks`: ``checkpoint(block, x, use_reentrant=False)``
  around every block of every stage (see :mod:`benchmarks.models.layouts`).
* :func:`checkpoint_chain`: ``checkpoint_sequential`` over each stage with
  round(sqrt(n)) segments, on models whose stages are pure chains.

Both rewire a deep copy of the step module; the original is untouched.
"""
from __future__ import annotations

import math

from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from benchmarks.models.layouts import BlockLayout


class Checkpointed(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


class CheckpointedChain(nn.Module):
    """Runs ``chain`` with ``checkpoint_sequential`` in ``segments`` segments."""

    def __init__(self, chain: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.chain = chain
        self.segments = segments

    def forward(self, x):
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)


def _groups(children: list[nn.Module], size: int) -> list[nn.Module]:
    out = []
    for i in range(0, len(children), size):
        group = children[i : i + size]
        out.append(group[0] if len(group) == 1 else nn.Sequential(*group))
    return out


def checkpoint_blocks(model: nn.Module, layout: BlockLayout) -> int:
    """Wrap every block of ``model`` (the zoo model, in place); returns the number of blocks."""
    count = 0
    for path in layout.stages:
        stage = model.get_submodule(path)
        children = list(stage.children())
        if isinstance(stage, nn.ModuleList):
            # Iterated by the model's forward one child at a time: keep one entry per child.
            if layout.group != 1:
                raise ValueError(f"{path}: a ModuleList's blocks cannot be grouped")
            _replace(model, path, nn.ModuleList(Checkpointed(c) for c in children))
        else:
            _replace(model, path, nn.Sequential(*(Checkpointed(b) for b in _groups(children, layout.group))))
        count += -(-len(children) // layout.group)
    for path in layout.singles:
        _replace(model, path, Checkpointed(model.get_submodule(path)))
        count += 1
    return count


def sqrt_segments(n: int) -> int:
    return max(1, round(math.sqrt(n)))


def checkpoint_chain(model: nn.Module, layout: BlockLayout) -> list[tuple[int, int]]:
    """``checkpoint_sequential`` over each stage; returns (children, segments) per stage."""
    if not layout.chain:
        raise ValueError(layout.why_not_chain or "the model has no sequential chain of blocks")
    shapes = []
    for path in layout.stages:
        stage = model.get_submodule(path)
        children = list(stage.children())
        segments = sqrt_segments(len(children))
        chain = CheckpointedChain(nn.Sequential(*children), segments)
        # A ModuleList is iterated by the model's forward: one entry runs the whole chain.
        _replace(model, path, nn.ModuleList([chain]) if isinstance(stage, nn.ModuleList) else chain)
        shapes.append((len(children), segments))
    return shapes
