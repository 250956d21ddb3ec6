"""``optimize(..., parameters="host")``: what it refuses, and the parameters put in host memory.

Paged parameters (`memplan.passes.paging`) are built for one process, a model captured whole,
on the CPU, where host memory is simulated: the storages of the parameters are marked as host
memory (`memplan.core.host`), so no measurement counts them, and each fetch's copy is device
memory. What is not built yet is refused here with what to do, before anything is planned.

A model built on the meta device is planned as it is, then `materialize` gives each parameter
storage where the plan keeps it, filled from a state dict or a file one tensor at a time: the
whole model is never on the device.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.nn as nn

from memplan.core.host import is_host, mark_host, unmark_host
from memplan.frontend.distributed import engines_in, process_group_size

_WHERE = "memplan.optimize(..., parameters=\"host\")"


def paging_refusal(model: nn.Module, *, distributed: bool, compile: Any, saved_plan: Any) -> str | None:
    """Why ``model``'s parameters cannot be paged as built (None: they can), with the route to take."""
    devices = {p.device.type for p in model.parameters()} - {"meta"}  # (a meta model is materialized later)
    if devices - {"cpu"}:
        return (f"{_WHERE} on {', '.join(sorted(devices - {'cpu'}))}: paging parameters runs on the CPU, where host "
                "memory is simulated, in this release; on a GPU, give the budget room for the parameters and put "
                "the optimizer's state on the host (optimizer_state=\"host\")")
    if distributed or engines_in(model) or process_group_size() is not None:
        return (f"{_WHERE} under DDP, FSDP or a process group is not built: train one process, "
                "or leave the parameters on the device")
    if compile:
        return f"{_WHERE} with compile= is not built: leave compile off"
    if saved_plan is not None:
        return f"{_WHERE} with plan= is not built: plan the step again (leave plan= out)"
    return None


def put_parameters_on_host(model: nn.Module, *, distributed: bool, compile: Any, saved_plan: Any) -> None:
    """Check that ``model``'s parameters can be paged as built, and mark them as host memory.
    Raises `NotImplementedError` naming the route for what is not built yet (`paging_refusal`)."""
    refusal = paging_refusal(model, distributed=distributed, compile=compile, saved_plan=saved_plan)
    if refusal is not None:
        raise NotImplementedError(refusal)
    mark_host(*(p for p in model.parameters() if not p.is_meta))


def put_paged_on_host(model: nn.Module, names: Collection[str]) -> bool:
    """``parameters="auto"``: mark the parameters a plan pages (named ``names``) as host memory,
    once it is made; whether any was not marked yet. (A parameter an earlier plan of the model
    paged stays there.)"""
    new = [p for name, p in model.named_parameters() if name in names and not p.is_meta and not is_host(p)]
    mark_host(*new)
    return bool(new)


def keep_parameters_on_device(model: nn.Module) -> None:
    """``parameters`` "device" or "auto": a model an earlier paging call marked as in host memory
    (one that then failed to plan, say) is device memory again, counted as such. (One model is
    trained by one memplan module: another module still paging it would find its marks gone.)"""
    marked = [p for p in model.parameters() if not p.is_meta and is_host(p)]
    if marked:
        unmark_host(*marked)


def materialize(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | str | os.PathLike, *,
                paged: Collection[str], device: torch.device | str = "cpu") -> list[str]:
    """Give each of ``model``'s parameters and buffers left on the meta device storage where the plan
    keeps it (host memory for a parameter of those named ``paged``, else ``device``), filled from ``state_dict`` one
    tensor at a time: a mapping of names to tensors, the path of a safetensors file (read tensor
    by tensor) or of a ``torch.save`` file (memory-mapped), or a checkpoint directory as Hugging Face's
    ``save_pretrained`` writes it (``model.safetensors``, or shards listed by
    ``model.safetensors.index.json``; the ``pytorch_model.bin`` forms too), each shard opened when
    first read. Names may lack a leading module path the model has and the checkpoint does not (a
    ``memplan.WithLoss``'s ``model.``). The parameters stay the same objects, so an optimizer made over
    them keeps them. Returns the names filled. Raises `KeyError` naming the tensors ``state_dict``
    lacks, and `ValueError` for a shape that differs, before any is filled."""
    source = _tensors_of(state_dict)
    # Each tensor once, under whichever of its names the state dict has (a tied weight may be saved
    # under its second name only, as safetensors files drop the others).
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if t.is_meta:
            names.setdefault(id(t), []).append(name)
            tensors[id(t)] = t
    source = _without_wrapper_prefix(source, [n for group in names.values() for n in group])
    wanted = [(next((n for n in names[key] if n in source), names[key][0]), t) for key, t in tensors.items()]
    missing = [name for name, _ in wanted if name not in source]
    if missing:
        unsaved = set(missing) - set(model.state_dict(keep_vars=True))  # (buffers a module does not persist)
        hint = (f"; {', '.join(sorted(unsaved)[:2])} {'is' if len(unsaved) == 1 else 'are'} in no checkpoint (a "
                "buffer its module does not persist): build the model with its parameters alone on the meta "
                "device (accelerate.init_empty_weights() does), or give it in the mapping" if unsaved else "")
        raise KeyError(f"memplan: the state dict has no {', '.join(missing[:3])}"
                       f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}: it cannot fill the model"
                       + hint)
    for name, t in wanted:
        shape = tuple(source.shape_of(name))
        if shape != tuple(t.shape):
            raise ValueError(f"memplan: {name} is {tuple(t.shape)} in the model and {shape} in the state dict")
    for name, t in wanted:
        host = isinstance(t, nn.Parameter) and any(n in paged for n in names[id(t)])
        filled = torch.empty(t.shape, dtype=t.dtype, device="cpu" if host else device)
        with torch.no_grad():
            filled.copy_(source.tensor(name))
        if host:
            mark_host(filled)
        if isinstance(t, nn.Parameter):  # (of its own class, its attributes kept: swap_tensors swaps them)
            filled = type(t)(filled, requires_grad=t.requires_grad)
            filled.__dict__.update(t.__dict__)
        torch.utils.swap_tensors(t, filled)
    return [name for name, _ in wanted]


class _Tensors:
    """Named tensors read one at a time, with their shapes known before any is read."""

    def __init__(self, shape_of: Callable[[str], Any], tensor: Callable[[str], torch.Tensor], names: set[str]):
        self.shape_of, self.tensor, self.names = shape_of, tensor, names

    def __contains__(self, name: str) -> bool:
        return name in self.names


def _tensors_of(state_dict: Mapping[str, torch.Tensor] | str | os.PathLike) -> _Tensors:
    if isinstance(state_dict, Mapping):
        return _Tensors(lambda n: state_dict[n].shape, state_dict.__getitem__, set(state_dict))
    path = os.fspath(state_dict)
    if os.path.isdir(path):
        return _checkpoint_directory(path)
    if path.endswith(".safetensors"):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ImportError("memplan: reading a .safetensors file needs the safetensors package "
                              "(pip install safetensors)") from None
        handle = safe_open(path, framework="pt", device="cpu")
        return _Tensors(lambda n: handle.get_slice(n).get_shape(), handle.get_tensor, set(handle.keys()))
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return _tensors_of(loaded)


# What a checkpoint directory holds, as Hugging Face's save_pretrained writes it: one file, or shards
# listed by an index ({"weight_map": {name: shard file}}).
_CHECKPOINT_FILES = ("model.safetensors", "pytorch_model.bin")


def _checkpoint_directory(path: str) -> _Tensors:
    """The tensors of a checkpoint directory, each shard opened when one of its tensors is first asked for."""
    for single in _CHECKPOINT_FILES:
        index = os.path.join(path, single + ".index.json")
        if os.path.exists(index):
            with open(index) as f:
                shard_of: dict[str, str] = json.load(f)["weight_map"]
            opened: dict[str, _Tensors] = {}

            def shard(name: str) -> _Tensors:
                file = shard_of[name]
                if file not in opened:
                    opened[file] = _tensors_of(os.path.join(path, file))
                return opened[file]

            return _Tensors(lambda n: shard(n).shape_of(n), lambda n: shard(n).tensor(n), set(shard_of))
        if os.path.exists(os.path.join(path, single)):
            return _tensors_of(os.path.join(path, single))
    raise FileNotFoundError(f"memplan: {path} holds no checkpoint memplan reads: none of "
                            f"{', '.join(f + ext for f in _CHECKPOINT_FILES for ext in ('', '.index.json'))}")


def _without_wrapper_prefix(source: _Tensors, model_names: list[str]) -> _Tensors:
    """``source`` read under the model's names, those it lacks found past a leading module path the
    checkpoint's names do not have (a model saved alone, loaded into the wrapper planned around it:
    ``memplan.WithLoss``'s ``model.``): the shortest path that finds any; the other names as they are."""
    absent = [n for n in model_names if n not in source]
    if not absent:
        return source
    parts = absent[0].split(".")
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth]) + "."
        found = {n: n[len(prefix):] for n in absent if n.startswith(prefix) and n[len(prefix):] in source}
        if found:
            return _Tensors(lambda n: source.shape_of(found.get(n, n)), lambda n: source.tensor(found.get(n, n)),
                            source.names | set(found))
    return source
