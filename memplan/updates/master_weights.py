"""fp32 master weights of low-precision paged parameters (ZeRO-Offload's mixed precision).

With ``master_weights=True`` a bf16 (or fp16) parameter paged to host memory
(`memplan.passes.paging`) is fetched, read and differentiated in its own dtype, and
updated in float32: its host update steps an fp32 master copy, with fp32 optimizer state,
and then writes the master back into the parameter, rounded. The master is made from the
parameter at its first update and kept in the optimizer's state under `MASTER`, so an
optimizer ``state_dict()`` carries it; ``load_state_dict`` would cast it and the rest of that
parameter's state to the parameter's dtype, so the state is restored in float32 after a load
(`use_master_weights`'s hooks). Only bf16 and fp16 parameters get masters (`has_master`).
"""
from __future__ import annotations

import weakref

import torch

from memplan.core.host import host_storage, is_host

MASTER = "memplan_master"  # the optimizer state's key for a parameter's fp32 master


class _Switch:
    """Master weights on or off for one optimizer, and the state dict it is loading (before torch casts it)."""

    def __init__(self) -> None:
        self.on = False
        self.loading: dict | None = None


_SWITCHES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Switch]" = weakref.WeakKeyDictionary()


def use_master_weights(optimizer: torch.optim.Optimizer, on: bool = True) -> None:
    """Give ``optimizer``'s low-precision paged parameters fp32 masters from their next update on
    (``on``), or not: the last ``optimize`` call over the optimizer says."""
    switch = _SWITCHES.get(optimizer)
    if switch is None:
        if not on:
            return
        switch = _SWITCHES[optimizer] = _Switch()
        optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: setattr(switch, "loading", state_dict))
        optimizer.register_load_state_dict_post_hook(_restore_in_float32)
    switch.on = on


def uses_master_weights(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer``'s low-precision paged parameters are updated through fp32 masters."""
    switch = _SWITCHES.get(optimizer) if optimizer is not None else None
    return switch is not None and switch.on


def has_master(p: torch.Tensor) -> bool:
    """Whether ``p`` is of a dtype that master weights widen (bf16, fp16), not fp32 or fp64."""
    return p.is_floating_point() and p.element_size() < 4


def master_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s fp32 master in host memory: the one in the optimizer's state, or a new copy of ``p``
    before its first update through one (its state so far, if any, widened to fp32 with it); None
    where ``p`` has none (master weights off, or ``p`` in fp32 or fp64)."""
    if not uses_master_weights(optimizer) or not has_master(p):
        return None
    state = optimizer.state.get(p, {})
    held = state.get(MASTER)
    if held is not None:
        return held
    with host_storage(), torch.no_grad():
        for key, value in list(state.items()):  # (state made without a master: a step in bf16 before)
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                state[key] = value.float()
        return p.detach().float()


def keep_master(optimizer: torch.optim.Optimizer, p: torch.Tensor, master: torch.Tensor) -> None:
    """After ``p``'s update: its master stays in the optimizer's state (made there at the first,
    which the optimizer must find empty to make its own state)."""
    optimizer.state[p][MASTER] = master


def _restore_in_float32(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: each low-precision parameter's loaded state as it was saved (its
    master and state in float32), or widened to it, not cast to the parameter's dtype."""
    switch = _SWITCHES[optimizer]
    loaded, switch.loading = switch.loading, None
    if loaded is None or not switch.on:
        return
    # The saved ids of the parameters, group by group, as torch's load maps them.
    saved_ids = [i for group in loaded["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, p in zip(saved_ids, params):
        saved = loaded["state"].get(index)
        if saved is None or not has_master(p) or not (MASTER in saved or is_host(p)):
            continue  # (a parameter updated without a master keeps its state in its own dtype)
        with host_storage(), torch.no_grad():
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                    optimizer.state[p][key] = value.to(device=optimizer.state[p][key].device, dtype=torch.float32,
                                                       copy=True)
