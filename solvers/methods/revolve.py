"""Method "revolve": Griewank's binomial checkpointing (Griewank 1992; Griewank
and Walther, "Algorithm 799: revolve") over the chain of `solvers.methods.chain`.

Revolve treats the chain as homogeneous: every stage costs one step and every
stage input one snapshot. With ``c`` snapshots (the one holding the start of
the sub-chain included), reversing ``l`` steps takes

    T(1, c) = 0,  T(l, 0) = inf (l > 1),
    T(l, c) = min over 0 < j < l of  j + T(l - j, c - 1) + T(j, c)

advances (forward steps beyond the one that each reversal re-records), which
equals Griewank's closed form ``r*l - binom(c+r, r-1)`` with ``r`` the least
integer such that ``binom(c+r, r) >= l``. The schedule follows the
recursion: advance ``j`` stages, snapshot, reverse the right part with one
snapshot less, then reverse the left part. The number of snapshots is the
largest whose schedule the simulator finds within the budget; on
heterogeneous chains the result is valid but not optimal (rotor is).
"""
from __future__ import annotations

import math
import time
from math import comb
from typing import Optional

import numpy as np

from ..core.problem import Problem
from ..core.schedule import Schedule, simulate
from ..core.sequence import schedule_from_sequence
from ..core.solution import MethodFailed, Solution, finish
from .chain import DEFAULT_MAX_STAGES, Chain, extract_chain
from .rotor import search_memory, sequence_of, solve_on_chains


def binomial_table(L: int) -> tuple[np.ndarray, np.ndarray]:
    """``T[l, c]`` (least advances to reverse ``l`` steps with ``c`` snapshots) and the
    split ``J[l, c]`` reaching it, for ``1 <= l <= L`` and ``0 <= c <= L``."""
    T = np.full((L + 1, L + 1), np.inf)
    J = np.zeros((L + 1, L + 1), dtype=np.int64)
    T[1, :] = 0.0
    for c in range(1, L + 1):
        for l in range(2, L + 1):
            j = np.arange(1, l)
            vals = j + T[l - j, c - 1] + T[j, c]
            k = int(np.argmin(vals))
            T[l, c], J[l, c] = vals[k], k + 1
    return T, J


def griewank_advances(l: int, c: int) -> int:
    """Griewank's closed form for the least number of advances (see the module doc)."""
    if l <= 1:
        return 0
    if c < 1:
        raise ValueError("more than one step needs a snapshot")
    r = 0
    while comb(c + r, r) < l:
        r += 1
    return r * l - (comb(c + r, r - 1) if r >= 1 else 0)


def revolve_operations(J: np.ndarray, L: int, c: int) -> list[tuple[str, int]]:
    ops: list[tuple[str, int]] = []
    # Explicit stack: the recursion is as deep as the chain is long when snapshots are few.
    stack: list[tuple[int, int, int]] = [(0, L, c)]
    while stack:
        s, l, snaps = stack.pop()
        if l == 1:
            ops.append(("all", s))
            ops.append(("backward", s))
            continue
        j = int(J[l, snaps])
        ops.extend(("advance", k) for k in range(s, s + j))
        # The right part runs first, then the left: push in reverse.
        stack.append((s, j, snaps))
        stack.append((s + j, l - j, snaps - 1))
    return ops


def _revolve_on_chain(problem: Problem, chain: Chain, snapshots: Optional[int], deadline: float) -> tuple[tuple, dict]:
    """Revolve over ``chain`` with ``snapshots`` snapshots, or the most that fit:
    ``((fits, cost or peak, schedule), info)``."""
    L = chain.length
    T, J = binomial_table(L)

    def build(c: int) -> tuple[Schedule, float]:
        return schedule_from_sequence(problem, sequence_of(chain, revolve_operations(J, L, c))), float(T[L, c])

    if snapshots is not None:
        c = min(snapshots, L)
        schedule, advances = build(c)
        result = simulate(problem, schedule)
        fits, score, tries = result.fits, (result.cost if result.fits else result.peak), 1
    else:
        # c >= L - 1 already stores every stage input: more changes nothing.
        best_fit, best_over, tries = search_memory(problem, list(range(1, max(2, L))), build, deadline)
        fits = best_fit is not None
        score, c, schedule, advances = best_fit if fits else best_over
    info = {"stages": L, "snapshots": c, "advances": advances, "pinned": len(chain.pinned), "tries": tries}
    return (fits, score, schedule), info


def solve_revolve(problem: Problem, time_limit: Optional[float] = None, *, max_stages: int = DEFAULT_MAX_STAGES,
                  snapshots: Optional[int] = None) -> Solution:
    """``snapshots`` fixes the number of snapshots instead of searching for the largest that fits."""
    started = time.perf_counter()
    deadline = started + (time_limit if time_limit is not None else math.inf)
    if snapshots is not None and snapshots < 1:
        raise MethodFailed("revolve needs at least one snapshot")
    if snapshots is not None:
        (fits, score, schedule), info = _revolve_on_chain(problem, extract_chain(problem, max_stages), snapshots,
                                                          deadline)
    else:
        (fits, score, schedule), info = solve_on_chains(
            problem, max_stages, deadline, lambda chain, until: _revolve_on_chain(problem, chain, None, until))
    return finish(problem, schedule, "revolve", started, lower_bound=problem.total_cost(), info=info)
