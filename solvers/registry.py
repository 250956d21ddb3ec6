"""Registry of solve methods: name -> ``(problem, time_limit) -> Solution``.

A new solver is one module exporting such a function, plus one line here."""
from __future__ import annotations

from typing import Callable, Optional

from .auto import solve_auto
from .checkmate import solve_checkmate_cpsat, solve_checkmate_default, solve_checkmate_highs, solve_checkmate_scip
from .exhaustive import solve_exhaustive, solve_exhaustive_fixed, solve_exhaustive_stages
from .greedy import solve_greedy
from .hierarchical import solve_hierarchical
from .joint import solve_joint
from .moccasin import solve_moccasin, solve_moccasin_free
from .offload import solve_offload
from .problem import Problem
from .recompute_all import solve_recompute_all
from .revolve import solve_revolve
from .rotor import solve_rotor
from .select import solve_select
from .solution import Solution
from .sqrt_n import solve_sqrt_n
from .store_all import solve_store_all

SolveFn = Callable[[Problem, Optional[float]], Solution]

METHODS: dict[str, SolveFn] = {
    "auto": solve_auto,
    "checkmate": solve_checkmate_default,
    "checkmate_cpsat": solve_checkmate_cpsat,
    "checkmate_mip": solve_checkmate_highs,  # the faster MathOpt MIP backend
    "checkmate_highs": solve_checkmate_highs,
    "checkmate_scip": solve_checkmate_scip,
    "store_all": solve_store_all,
    "recompute_all": solve_recompute_all,
    "sqrt_n": solve_sqrt_n,
    "greedy": solve_greedy,
    "hierarchical": solve_hierarchical,
    "rotor": solve_rotor,
    "revolve": solve_revolve,
    "moccasin": solve_moccasin,
    "moccasin_free": solve_moccasin_free,
    "offload": solve_offload,
    "joint": solve_joint,
    "select": solve_select,
    "exhaustive": solve_exhaustive,
    "exhaustive_fixed": solve_exhaustive_fixed,
    "exhaustive_stages": solve_exhaustive_stages,
}
