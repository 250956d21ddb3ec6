"""What a plan may assume about how the step uses the model's outputs.

A model that computes its own loss often returns more than the loss: Hugging
Face models return ``(loss, logits)``, others their hidden states. The step
then calls ``out.loss.backward()``, and two things follow in eager PyTorch:

* **no gradient** is ever made for the logits;
* a caller that keeps only the loss (``model(**batch).loss.backward()``, or
  Hugging Face's Trainer, whose ``compute_loss`` returns the loss alone) has
  **dropped** the logits before backward starts, and unless autograd saved
  them they are freed there.

The first plan for an input signature cannot know either and plans for the
safe case: a gradient for every output, every output held by the caller to
the end. :class:`OutputUse` records what a backward showed instead
(``memplan.frontend.module`` learns it from the first backward and plans again).

No gradient: the joint graph has a tangent for every differentiable output,
and in the common case that tangent is only an addend (the logits feed the
loss inside the model, so their gradient is ``add(tangent, gradient_through_
the_loss)``). :func:`make_tangents_optional` rewrites such an add into
:func:`add_if_given`, which returns the other addend itself when the tangent is
``None``, and gives the tangent a zero-byte value. The schedule is the same
whether the gradient comes or not, so a step whose loss does use the output
still computes exact gradients; it only holds more than was planned (the
tangent and the sum). Only addend-only tangents are rewritten: a tangent that
flows through other ops (an output the model does not use itself) would leave
the schedule without the activations those ops read if it ever arrived.

Dropped: the Problem then ends the caller's reference to the output at the
backward barrier instead of at the step's end (``memplan.planning.lowering``), and the
runtime keeps no reference to it that the plan does not count.

Inputs dropped: the same for the step's *input* tensors. A caller that hands a tensor in and
keeps no reference once the call returns (``memplan.WithLoss`` calling its loss function on
the logits) lets it go when the forward ends; unless the backward reads it, the plan frees
it there instead of holding it as a source to the step's end. Only the caller knows this,
so it is declared (`inputs_dropped_after_call`), never guessed; a backward that finds one still
held says so and plans hold it again (`memplan.frontend.graphs`).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.fx as fx

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memplan.core.storage import storage_key


@dataclass(frozen=True)
class OutputUse:
    """How a step used the model's output tensors (indices among the model outputs the joint graph
    returns: `OutputTree.sources` maps the output's tensor leaves to them)."""

    no_grad: frozenset[int] = frozenset()  # the loss sent them no gradient (each must be addend-only)
    dropped: frozenset[int] = frozenset()  # the caller no longer held them when backward began
    # Input tensors (positions among the step's flat input tensors, `PrimalInfo.index` of kind
    # "input") the caller holds no reference to once the forward has returned.
    inputs_dropped: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.no_grad or self.dropped or self.inputs_dropped)

    @property
    def learned(self) -> bool:
        """Whether it says anything a backward showed (about the outputs), beyond what the caller declared."""
        return bool(self.no_grad or self.dropped)

    def key(self) -> tuple:
        """A hashable, ordered form, for plan keys and saved plans."""
        base = (tuple(sorted(self.no_grad)), tuple(sorted(self.dropped)))
        return (*base, tuple(sorted(self.inputs_dropped))) if self.inputs_dropped else base

    def describe(self) -> str:
        """One line for ``Plan.report``."""
        parts = []
        if self.no_grad:
            parts.append(f"no gradient for output tensor(s) {', '.join(map(str, sorted(self.no_grad)))}")
        if self.dropped:
            parts.append(f"output tensor(s) {', '.join(map(str, sorted(self.dropped)))} dropped by the caller "
                         "before backward")
        if self.inputs_dropped:
            parts.append(f"input tensor(s) {', '.join(map(str, sorted(self.inputs_dropped)))} let go by the caller "
                         "when forward returns")
        return "; ".join(parts)


_ADD = torch.ops.aten.add.Tensor

_DROPPING: contextvars.ContextVar[frozenset] = contextvars.ContextVar("memplan_inputs_dropped_after_call",
                                                                     default=frozenset())


@contextlib.contextmanager
def inputs_dropped_after_call(handed: object, kept: object = ()):
    """Declare that the caller keeps no reference to the tensors in ``handed`` (any nesting) once the
    call inside returns, but to those sharing storage with a tensor in ``kept`` (what it holds on to:
    the step's inputs, the model's parameters and buffers, which ``handed`` may hold views of): a
    planned graph called inside may let those of its inputs go when its forward returns
    (`OutputUse.inputs_dropped`); its other inputs (a closure's tensors) are held."""
    def storages(tree: object) -> frozenset:
        # (a distributed tensor, FSDP2's sharded parameter, has no storage of its own to compare)
        return frozenset(storage_key(t) for t in torch.utils._pytree.tree_leaves(tree)
                         if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t))

    keys = storages(handed) - storages(kept)
    token = _DROPPING.set(keys)
    try:
        yield
    finally:
        _DROPPING.reset(token)


def inputs_let_go() -> frozenset:
    """The storages (`memplan.core.storage.storage_key`) the running call's caller lets go when it
    returns (`inputs_dropped_after_call`); empty where none was declared."""
    return _DROPPING.get()


def add_if_given(tangent: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """``tangent + grad``, or ``grad`` itself when no gradient came for the output (``None``).

    An empty tangent also stands for "none": it is what the planner's fake value
    of an optional tangent looks like (``measure_op_times`` runs nodes on
    tensors made from those values), and a real output with no elements has an
    empty gradient too, for which ``grad`` is the sum.
    """
    if tangent is None or tangent.numel() == 0:
        return grad
    return _ADD(tangent, grad)


def _addend_of(add: fx.Node, tangent: fx.Node) -> fx.Node | None:
    """The other addend of ``add(tangent, x)`` when dropping the tangent leaves ``x`` as the sum."""
    if add.op != "call_function" or add.target is not _ADD or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    a, b = add.args
    other = b if a is tangent else a if b is tangent else None
    if not isinstance(other, fx.Node) or other is tangent:
        return None
    out, val = add.meta.get("val"), other.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor):
        return None
    # without the tangent the sum is `other` as it is: no broadcast, no type promotion
    if val.shape != out.shape or val.dtype != out.dtype or val.layout != torch.strided:
        return None
    return other


def addend_only(tangent: fx.Node) -> bool:
    """Whether every use of ``tangent`` is a plain add that :func:`make_tangents_optional` can rewrite."""
    return bool(tangent.users) and all(_addend_of(user, tangent) is not None for user in tangent.users)


def make_tangents_optional(tangents: list[fx.Node]) -> None:
    """Rewrite, in place, each tangent's adds into :func:`add_if_given` and make the tangent zero bytes.

    Every tangent in ``tangents`` must be :func:`addend_only`. The rewritten add
    keeps its name and takes the other addend's fake value, so the cost model
    sees it as an alias of that addend, which is what it is when the gradient
    does not come.
    """
    for tangent in tangents:
        if not addend_only(tangent):
            raise ValueError(f"{tangent.name} is not only an addend; its gradient cannot be made optional")
        for add in list(tangent.users):
            other = _addend_of(add, tangent)
            add.target = add_if_given
            add.args = (tangent, other)
            add.kwargs = {}
            add.meta["val"] = other.meta["val"]
        tangent.meta["val"] = tangent.meta["val"].new_empty((0,))
