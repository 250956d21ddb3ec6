"""Registry of solve methods and strategies: name -> `MethodInfo` (and `METHODS`: name -> solve).

Methods come from `methods.catalog`; the strategies that combine them are
added here, at the top of the layers. A new method is one module plus one
entry in `methods.catalog`; a new strategy, one module plus one entry here.
"""
from __future__ import annotations

from .core.method import MethodInfo, SolveFn
from .methods.catalog import METHOD_INFOS
from .methods.offload_milp import MAX_COMPUTE as OFFLOAD_MILP_MAX_COMPUTE
from .strategies.auto import solve_auto
from .strategies.hierarchical import solve_hierarchical
from .strategies.joint import solve_joint
from .strategies.offload import solve_offload

STRATEGY_INFOS: tuple[MethodInfo, ...] = (
    MethodInfo("auto", solve_auto, "strategy", host_link=True,
               doc="the default: hierarchical (then the minimum-budget search); offload strategies with a host link"),
    MethodInfo("hierarchical", solve_hierarchical, "strategy", host_link=True,
               doc="coarsen, drop-set ILP, race the baselines and rotor, repair, polish, pin search"),
    MethodInfo("offload", solve_offload, "strategy", host_link=True,
               doc="paged store-all descents, hierarchical with paging rows, paging sweep over remat plans"),
    MethodInfo("offload_milp", solve_joint, "strategy", host_link=True, max_compute=OFFLOAD_MILP_MAX_COMPUTE,
               doc="the keep / recompute / offload MILP after the offload heuristic"),
    MethodInfo("joint", solve_joint, "strategy", host_link=True, max_compute=OFFLOAD_MILP_MAX_COMPUTE,
               doc="former name of offload_milp"),
)

REGISTRY: dict[str, MethodInfo] = {m.name: m for m in STRATEGY_INFOS[:1] + METHOD_INFOS + STRATEGY_INFOS[1:]}
METHODS: dict[str, SolveFn] = {name: info.solve for name, info in REGISTRY.items()}
