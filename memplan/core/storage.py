"""Which storages hold a value's memory: the one definition every stage counts bytes by.

Memory is owned by storages, not tensors: views share their base's storage,
and a sparse tensor (``nn.Embedding(sparse=True)``'s gradient) has no storage
of its own, only the dense indices and values tensors it is built around.
Capture (`memplan.capture.trace`), its graph passes (`memplan.passes.compaction`), the
cost model (`memplan.costs.cost_model`) and the memory tracker (`memplan.measure.tracker`) all
read storages through these helpers, so they agree on what is one storage.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Node meta key: bytes the node's kernel allocates for itself while it runs, where the pass that
# made the node knows them (`memplan.passes.loss_fusion`); the cost model counts them as its scratch.
SCRATCH_BYTES = "memplan_scratch_bytes"

_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors a sparse tensor's memory lives in (indices and values); [] for strided ones.

    A sparse tensor (``nn.Embedding(sparse=True)``'s gradient) has no storage of
    its own: ``untyped_storage()`` raises. Its memory is its parts' storages.
    """
    names = _SPARSE_PARTS.get(t.layout, ())
    return [getattr(t, name)() for name in names]


def dense_tensors(val: object) -> list[torch.Tensor]:
    """The dense tensors holding ``val``'s memory (``val``: a tensor or a nest of them, e.g. an fx
    node's ``meta['val']``): a sparse tensor stands for its indices and values.

    A sparse tensor (``nn.Embedding(sparse=True)``'s gradient) has no storage of its
    own; it is built around (and aliases) dense indices and values tensors.
    """
    out: list[torch.Tensor] = []
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            out.extend(sparse_parts(t) if t.layout != torch.strided else [t])
    return out


def storage_key(t: torch.Tensor) -> int:
    """A key for ``t``'s storage, the same for every tensor (view, alias) that shares it.

    Stable while ``t`` lives (an ``id()`` of the storage object is not); works on
    real and fake tensors alike.
    """
    return t.untyped_storage()._cdata


def value_device(node: "torch.fx.Node") -> torch.device:
    """The device of a node's (first) tensor value; CPU for nodes without one."""
    tensors = dense_tensors(node.meta.get("val"))
    return tensors[0].device if tensors else torch.device("cpu")


PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def fake_tensor_types() -> tuple[type, ...]:
    # Imported lazily: fake_tensor pulls in a lot of torch._subclasses.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor, FakeTensorMode


FAKE_REACHED = (
    "memplan.measure.tracker: a FakeTensor reached the memory tracker; fake "
    "tensors have no memory to measure (plan with memplan.costs.cost_model, "
    "measure with real tensors)"
)


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, fake_tensor_types()[0])


def storages_of(t: torch.Tensor, allow_fake: bool = False) -> Iterator[torch.UntypedStorage]:
    """Yield the untyped storages backing ``t``; nothing for storage-less tensors.

    A sparse tensor yields its indices' and values' storages, a wrapper subclass
    (DTensor, ...) its inner tensors'. A fake tensor raises unless ``allow_fake``
    (then its fake storage is yielded): fake tensors have no memory to measure.
    """
    parts = sparse_parts(t) if t.layout != torch.strided else []
    if parts:
        for part in parts:
            yield from storages_of(part, allow_fake)
        return
    if type(t) not in PLAIN_TENSOR_TYPES:
        fake_tensor, _ = fake_tensor_types()
        if isinstance(t, fake_tensor) and allow_fake:
            yield t.untyped_storage()
            return
        if isinstance(t, fake_tensor):
            raise RuntimeError(FAKE_REACHED)
        if is_traceable_wrapper_subclass(t):
            # A wrapper subclass (DTensor, ...) owns no memory itself: its inner
            # tensors do.
            attrs, _ = t.__tensor_flatten__()
            for attr in attrs:
                inner = getattr(t, attr)
                if isinstance(inner, torch.Tensor):
                    yield from storages_of(inner, allow_fake)
            return
    try:
        yield t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        # Sparse, nested and other layouts without a single storage: skip.
        return


def tensors_in(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Collect the tensors in an op's (nested) args or results."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            tensors_in(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            tensors_in(item, out)
    return out
