"""fp32 master weights of low-precision paged parameters (ZeRO-Offload's mixed precision).

With ``master_weights=True`` a bf16 (or fp16) parameter paged to host memory
(`memplan.passes.paging`) is fetched, read and differentiated in its own dtype, and
updated in float32: its host update steps an fp32 master copy, with fp32 optimizer state,
and then writes the master back into the parameter, rounded. The master is made from the
parameter at its first update and kept in the optimizer's state under `MASTER`, so an
optimizer ``state_dict()`` carries it; ``load_state_dict`` would cast it and the rest of that
parameter's state to the parameter's dtype, so the state is restored in float32 after a load
(`use_master_weights`'s hooks).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from memplan.core.host import host_storage

MASTER = "memplan_master"  # the optimizer state's key for a parameter's fp32 master
_ENABLED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]]" = weakref.WeakKeyDictionary()


def use_master_weights(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer``'s low-precision paged parameters fp32 masters from their next update on."""
    if optimizer in _ENABLED:
        return
    stash: list[Any] = [None]  # the state dict being loaded, before torch casts it
    _ENABLED[optimizer] = stash
    optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: stash.__setitem__(0, state_dict))
    optimizer.register_load_state_dict_post_hook(_restore_in_float32)


def uses_master_weights(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer``'s low-precision paged parameters are updated through fp32 masters."""
    return optimizer is not None and optimizer in _ENABLED


def master_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s fp32 master in host memory: the one in the optimizer's state, or a new copy of ``p``
    before its first update; None where ``p`` has none (master weights off, or ``p`` in fp32)."""
    if not uses_master_weights(optimizer) or not p.is_floating_point() or p.dtype == torch.float32:
        return None
    held = optimizer.state.get(p, {}).get(MASTER)
    if held is not None:
        return held
    with host_storage(), torch.no_grad():
        return p.detach().float()


def keep_master(optimizer: torch.optim.Optimizer, p: torch.Tensor, master: torch.Tensor) -> None:
    """After ``p``'s update: its master stays in the optimizer's state (made there at the first,
    which the optimizer must find empty to make its own state)."""
    optimizer.state[p][MASTER] = master


def _restore_in_float32(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: the loaded state of each parameter with a master, as it was saved
    (float32), not cast to the parameter's dtype."""
    stash = _ENABLED[optimizer]
    loaded, stash[0] = stash[0], None
    if loaded is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved in loaded["state"].items():
        if MASTER not in saved:
            continue
        p = params[index]
        with host_storage(), torch.no_grad():
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                    optimizer.state[p][key] = value.to(device=optimizer.state[p][key].device, copy=True)
