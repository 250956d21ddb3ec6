"""Which storages hold a value's memory: the one definition every stage counts bytes by.

Memory is owned by storages, not tensors: views share their base's storage,
and a sparse tensor (``nn.Embedding(sparse=True)``'s gradient) has no storage
of its own, only the dense indices and values tensors it is built around.
Capture (`memplan.capture`), its graph passes (`memplan.compaction`), the
cost model (`memplan.costs`) and the memory tracker (`memplan.measure`) all
read storages through these helpers, so they agree on what is one storage.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

# Node meta key: bytes the node's kernel allocates for itself while it runs, where the pass that
# made the node knows them (`memplan.loss_fusion`); the cost model counts them as its scratch.
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
