"""Every solve method of this layer as a registry entry (`core.method.MethodInfo`).

A new method is one module exporting ``solve_<name>(problem, time_limit)``
plus one entry here; the strategies' portfolios (`core.method.portfolio`)
and the public registry (`solvers.registry`) are derived from this tuple.
"""
from __future__ import annotations

from ..core.method import RACE, MethodInfo
from .baselines import BASELINE_METHODS
from .checkmate import (
    solve_checkmate_cpsat,
    solve_checkmate_default,
    solve_checkmate_highs,
    solve_checkmate_scip,
)
from .exhaustive import MAX_NODES as EXHAUSTIVE_MAX_NODES
from .exhaustive import (
    solve_exhaustive,
    solve_exhaustive_fixed,
    solve_exhaustive_stages,
)
from .moccasin import solve_moccasin, solve_moccasin_free
from .revolve import solve_revolve
from .rotor import solve_rotor

METHOD_INFOS: tuple[MethodInfo, ...] = BASELINE_METHODS + (
    MethodInfo("rotor", solve_rotor, "chain", portfolios=frozenset({RACE}),
               doc="rotor's dynamic program over the graph's main chain (strong near a chain: ResNet, U-Net)"),
    MethodInfo("revolve", solve_revolve, "chain", doc="Griewank's binomial checkpointing on the main chain"),
    MethodInfo("checkmate", solve_checkmate_default, "exact",
               doc="Checkmate's MILP over stages (default backend); falls back to the best baseline"),
    MethodInfo("checkmate_cpsat", solve_checkmate_cpsat, "exact", doc="Checkmate's MILP with CP-SAT"),
    MethodInfo("checkmate_mip", solve_checkmate_highs, "exact", doc="Checkmate's MILP, the faster MathOpt MIP backend"),
    MethodInfo("checkmate_highs", solve_checkmate_highs, "exact", doc="Checkmate's MILP with HiGHS"),
    MethodInfo("checkmate_scip", solve_checkmate_scip, "exact", doc="Checkmate's MILP with SCIP"),
    MethodInfo("moccasin", solve_moccasin, "exact", doc="Moccasin's CP-SAT interval model (bounded copies)"),
    MethodInfo("moccasin_free", solve_moccasin_free, "exact", doc="Moccasin's model, any order of computations"),
    MethodInfo("exhaustive", solve_exhaustive, "exact", max_compute=EXHAUSTIVE_MAX_NODES,
               doc="exhaustive search over schedules (tiny graphs)"),
    MethodInfo("exhaustive_fixed", solve_exhaustive_fixed, "exact", max_compute=EXHAUSTIVE_MAX_NODES,
               doc="exhaustive search in the problem's order"),
    MethodInfo("exhaustive_stages", solve_exhaustive_stages, "exact", max_compute=EXHAUSTIVE_MAX_NODES,
               doc="exhaustive search over Checkmate's stage space"),
)
