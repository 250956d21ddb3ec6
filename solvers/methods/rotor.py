"""Method "rotor": optimal checkpointing of a heterogeneous chain (Beaumont,
Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for
heterogeneous chains: how to train deep neural networks with limited memory").

The joint graph is read as a chain of stages (`solvers.methods.chain`). A dynamic
program over sub-chains ``s..t`` and free memory ``m`` (discretised into
slots) chooses, for the first stage of every sub-chain, between

* ``F_all``: run stage ``s`` keeping everything its backward needs, solve
  ``s+1..t``, then run ``B[s]``;
* ``F_ck``: keep the stage input, advance (``F_n``) through ``s..s'-1``
  keeping only the output of ``s'-1``, solve ``s'..t``, then solve
  ``s..s'-1`` again from the kept input.

Each sub-chain comes in two variants: its input either belongs to the
caller (kept for the caller's backward) or is a checkpoint the sub-chain may
free once stage ``s`` no longer needs it, which is what lets a checkpoint
die as soon as the next stage has run when nothing else reads it.

The resulting operations become a compute order of the problem's values and,
through `plan.schedule_from_sequence`, a Schedule. The program's memory model
(stage sizes measured by running each stage alone, gradients and gradient
sinks accumulating during the backward, pinned values reserved up front) is
not the simulator's, so the free memory handed to the program is searched:
the table is built once for every amount of memory up to a top, and its
solutions are simulated, bisecting for the cheapest that fits (the top is
widened when even it fits). When the graph also has a chain with its long
skips pinned (`chain.extract_chain`), rotor runs on both and keeps the better.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..core.problem import Problem
from ..core.schedule import Schedule, simulate
from ..core.sequence import schedule_from_sequence
from ..core.solution import MethodFailed, Solution, finish
from .chain import DEFAULT_MAX_STAGES, Chain, SequenceBuilder, extract_chain

DEFAULT_SLOTS = 400
# The program's memory axis spans this multiple of the free memory: its model may be
# pessimistic, and a schedule planned for more memory than the budget may still fit.
HEADROOM = 1.5
MAX_TRIES = 16  # simulations in the search over the program's free memory
PROBES = 6  # of those, at most this many probe above the bisection's boundary


@dataclass(frozen=True)
class ChainSizes:
    """Per-stage numbers of a chain in slots (sizes rounded up) and costs."""

    a: np.ndarray  # output size
    x: np.ndarray  # kept set
    pa: np.ndarray  # advance peak
    pall: np.ndarray  # F_all peak
    pb: np.ndarray  # backward peak
    delta: np.ndarray  # delta[s, t]: memory left behind by solving s..t (sinks and gradient change)
    ca: np.ndarray  # advance cost
    call: np.ndarray
    cb: np.ndarray
    release: np.ndarray  # slots freed after F_all[s] when the input is not read by B[s] (0 otherwise)
    reads_output: np.ndarray  # bool: B[s] reads the stage output


def chain_sizes(chain: Chain, slot: float) -> ChainSizes:
    st = chain.stages
    L = len(st)

    def slots(values: list[float]) -> np.ndarray:
        return np.ceil(np.asarray(values, dtype=np.float64) / slot).astype(np.int64)

    g = np.array([s.sink_size for s in st], dtype=np.float64)
    h = np.array([s.grad_size for s in st] + [0], dtype=np.float64)  # h[k]: resident after B[k]; h[L] = 0
    gsum = np.concatenate([[0.0], np.cumsum(g)])
    delta = np.zeros((L + 1, L), dtype=np.int64)
    for s in range(L):
        for t in range(s, L):
            delta[s, t] = math.ceil((gsum[t + 1] - gsum[s] + h[s] - h[t + 1]) / slot)
    a = slots([s.out_size for s in st])
    # Rounded down: the program must not count on more than the input frees.
    release = np.array([0] + [int(math.floor(st[k - 1].out_size / slot)) if not st[k].reads_input else 0
                              for k in range(1, L)], dtype=np.int64)
    return ChainSizes(
        a=a, x=slots([s.kept_size for s in st]),
        pa=slots([s.peak_advance for s in st]), pall=slots([s.peak_all for s in st]),
        pb=slots([s.peak_backward for s in st]), delta=delta,
        ca=np.array([s.cost_advance for s in st]), call=np.array([s.cost_all for s in st]),
        cb=np.array([s.cost_backward for s in st]), release=release,
        reads_output=np.array([s.reads_output for s in st], dtype=bool))


# Variants of a sub-chain: KEEP when its input belongs to the caller (kept for the
# caller's backward), DROP when the sub-chain may free it once stage s is done with it
# (a checkpoint, recomputed by the caller if it needs it again).
KEEP, DROP = 0, 1


def rotor_table(z: ChainSizes, S: int) -> tuple[np.ndarray, np.ndarray]:
    """``C[v, s, t, m]``: least cost of solving stages ``s..t`` in variant ``v`` with ``m``
    free slots (inf when impossible); ``choice[v, s, t, m]``: -1 for F_all, else the
    ``s'`` of F_ck (-2: impossible)."""
    L = len(z.a)
    inf = np.inf
    m_axis = np.arange(S + 1)
    C = np.full((2, L, L, S + 1), inf)
    choice = np.full((2, L, L, S + 1), -2, dtype=np.int16)
    for k in range(L):
        for v in (KEEP, DROP):
            rel = z.release[k] if v == DROP else 0
            ok = (m_axis >= z.pall[k]) & (m_axis + rel >= z.x[k] + z.pb[k])
            C[v, k, k, ok] = z.call[k] + z.cb[k]
            choice[v, k, k, ok] = -1
    # need[s, s']: memory to advance from the input of s to the output of s'-1.
    need = np.zeros((L, L + 1), dtype=np.int64)
    for s in range(L):
        worst = z.pa[s]
        for s2 in range(s + 1, L + 1):
            need[s, s2] = worst
            if s2 < L:
                worst = max(worst, z.a[s2 - 1] + z.pa[s2])
    ca_cum = np.concatenate([[0.0], np.cumsum(z.ca)])
    rows = np.arange(L)
    # t ascending, s descending: C[., s2, t] (s2 > s) and C[., s, s2 - 1] (s2 - 1 < t) are ready.
    for t in range(1, L):
        # right[s2]: C[DROP, s2, t, m - a[s2 - 1]] once row s2 is done; ib[s2]: the left part's slots.
        right = np.full((t + 1, S + 1), inf)
        ia = m_axis[None, :] - z.a[np.maximum(rows[:t + 1] - 1, 0)][:, None]
        ib_raw = m_axis[None, :] - z.delta[:t + 1, t][:, None]
        ib = np.clip(ib_raw, 0, S)
        ib_bad = ib_raw < 0

        def shift_right(s2: int) -> None:
            right[s2] = np.where(ia[s2] >= 0, C[DROP, s2, t, np.clip(ia[s2], 0, S)], inf)

        shift_right(t)
        for s in range(t - 1, -1, -1):
            s2 = np.arange(s + 1, t + 1)
            bad = ib_bad[s + 1:t + 1] | (m_axis[None, :] < need[s, s2][:, None])
            base = right[s + 1:t + 1] + (ca_cum[s2] - ca_cum[s])[:, None]
            child = KEEP if z.reads_output[s] else DROP  # after F_all at s, who owns a[s]
            for v in (KEEP, DROP):
                # F_ck at s, advancing to s2 = s+1..t: the right part owns the checkpoint a[s2-1].
                vals = base + np.take_along_axis(C[v, s, s:t, :], ib[s + 1:t + 1], axis=1)
                vals[bad] = inf
                r = np.argmin(vals, axis=0)
                best = vals[r, m_axis]
                arg = np.where(np.isfinite(best), s + 1 + r, -2).astype(np.int16)
                # F_all at s.
                rel = z.release[s] if v == DROP else 0
                idx = m_axis - z.x[s] + rel
                ok = (idx >= 0) & (m_axis >= z.pall[s]) & (m_axis + rel >= z.x[s] + z.delta[s + 1, t] + z.pb[s])
                val = np.where(ok, C[child, s + 1, t, np.clip(idx, 0, S)], inf) + (z.call[s] + z.cb[s])
                better = val < best
                best[better], arg[better] = val[better], -1
                C[v, s, t], choice[v, s, t] = best, arg
            shift_right(s)
    return C, choice


def rotor_operations(z: ChainSizes, choice: np.ndarray, S: int, m: int) -> list[tuple[str, int]]:
    """The operations ("advance" / "all" / "backward", stage) of the table's solution at ``m`` slots."""
    ops: list[tuple[str, int]] = []
    L = choice.shape[1]
    # Explicit stack of pending work, last first: ("solve", v, s, t, m) or ("op", name, k).
    stack: list[tuple] = [("solve", DROP, 0, L - 1, m)]
    while stack:
        item = stack.pop()
        if item[0] == "op":
            ops.append((item[1], item[2]))
            continue
        _, v, s, t, m = item
        c = int(choice[v, s, t, m])
        if c == -2:
            raise AssertionError("backtracking into an infeasible state")
        if c == -1:
            ops.append(("all", s))
            stack.append(("op", "backward", s))
            if s < t:
                rel = int(z.release[s]) if v == DROP else 0
                stack.append(("solve", KEEP if z.reads_output[s] else DROP, s + 1, t, min(S, m - int(z.x[s]) + rel)))
            continue
        ops.extend(("advance", k) for k in range(s, c))
        stack.append(("solve", v, s, c - 1, min(S, m - int(z.delta[c, t]))))
        stack.append(("solve", DROP, c, t, m - int(z.a[c - 1])))
    return ops


def sequence_of(chain: Chain, ops: list[tuple[str, int]]) -> list[int]:
    b = SequenceBuilder(chain)
    run = {"advance": b.advance, "all": b.forward_all, "backward": b.backward}
    for op, k in ops:
        run[op](k)
    return b.seq


def _least_over(over: list[tuple]) -> Optional[tuple]:
    """Among over-budget results ``(peak, cost, c, schedule, extra)``, the cheapest of those
    within 0.1% of the least peak, as ``(peak, c, schedule, extra)``."""
    if not over:
        return None
    least = min(o[0] for o in over)
    peak, _, c, schedule, extra = min((o for o in over if o[0] <= least * 1.001), key=lambda o: o[1])
    return peak, c, schedule, extra


def search_memory(problem: Problem, candidates: list[int], build: Callable[[int], tuple[Schedule, float]],
                  deadline: float) -> tuple[Optional[tuple], Optional[tuple], int]:
    """Bisect over ``candidates`` (increasing) for the largest one whose schedule fits.
    ``build(c)`` returns ``(schedule, extra)``. Returns the cheapest fitting result
    ``(cost, c, schedule, extra)``, the over-budget one of least peak (`_least_over`),
    and the number of simulations."""
    best_fit = None
    over: list[tuple] = []
    tries = 0
    cache: dict[int, bool] = {}

    def attempt(i: int) -> bool:
        nonlocal best_fit, tries
        if i in cache:
            return cache[i]
        tries += 1
        c = candidates[i]
        schedule, extra = build(c)
        result = simulate(problem, schedule)
        fits = result.fits
        if fits:
            if best_fit is None or result.cost < best_fit[0]:
                best_fit = (result.cost, c, schedule, extra)
        else:
            over.append((result.peak, result.cost, c, schedule, extra))
        cache[i] = fits
        return fits

    lo, hi = -1, len(candidates)  # candidates[lo] fits (or lo = -1), candidates[hi] does not (or hi = len)
    # Start at the top (the most memory): when that fits there is nothing to search.
    if attempt(len(candidates) - 1):
        return best_fit, _least_over(over), tries
    hi = len(candidates) - 1
    while hi - lo > 1 and tries < MAX_TRIES and time.perf_counter() < deadline:
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    # The simulated peak is not monotone in the program's memory: probe the untried
    # candidates above the boundary, nearest first, while tries and time remain.
    probes = 0
    for i in range(lo + 1, len(candidates)):
        if tries >= MAX_TRIES or probes >= PROBES or time.perf_counter() >= deadline:
            break
        if i not in cache:
            probes += 1
            attempt(i)
    return best_fit, _least_over(over), tries


def _table_search(problem: Problem, chain: Chain, slots: int, top: float,
                  deadline: float) -> Optional[tuple[Optional[tuple], Optional[tuple], int, float, bool]]:
    """Rotor table with ``slots`` slots up to ``top`` bytes, searched for the schedule that fits:
    ``(best_fit, best_over, tries, slot, top_fits)``, or None when nothing on the axis is feasible."""
    L = chain.length
    slot = max(1.0, top) / slots
    z = chain_sizes(chain, slot)
    C, choice = rotor_table(z, slots)
    values = C[DROP, 0, L - 1]
    feasible = [m for m in range(slots + 1) if math.isfinite(values[m])]
    if not feasible:
        return None
    # Distinct solutions only: the table's value changes at these slots.
    candidates = [m for m in feasible if m == feasible[0] or values[m] < values[m - 1]]

    def build(m: int) -> tuple[Schedule, float]:
        seq = sequence_of(chain, rotor_operations(z, choice, slots, m))
        return schedule_from_sequence(problem, seq), float(values[m])

    best_fit, best_over, tries = search_memory(problem, candidates, build, deadline)
    top_fits = best_fit is not None and best_fit[1] == candidates[-1]
    return best_fit, best_over, tries, slot, top_fits


def rotor_on_chain(problem: Problem, chain: Chain, slots: int, deadline: float) -> tuple[tuple, dict]:
    """Best schedule of the rotor table over ``chain``: ``((fits, cost or peak, schedule), info)``."""
    free = problem.budget - chain.base - chain.pinned_size
    st = chain.stages
    # Keeping everything bounds the memory any chain schedule needs.
    keep_all = sum(s.kept_size + s.sink_size + s.grad_size for s in st) + max(s.peak_backward + s.peak_all for s in st)
    top = min(HEADROOM * free, keep_all) if free > 0 else keep_all
    found = _table_search(problem, chain, slots, top, deadline)
    if found is None and top < keep_all:
        top = keep_all
        found = _table_search(problem, chain, slots, top, deadline)
    if found is None:
        raise MethodFailed("rotor: no chain schedule within the memory of keeping everything")
    # The program's model is pessimistic: when even the top of its axis fits, widen the axis.
    while found[4] and top < keep_all and time.perf_counter() < deadline:
        top = min(2 * top, keep_all)
        wider = _table_search(problem, chain, slots, top, deadline)
        if wider is None or wider[0] is None or wider[0][0] >= found[0][0]:
            break
        found = wider
    best_fit, best_over, tries, slot, _ = found
    fits = best_fit is not None
    score, m, schedule, dp_value = best_fit if fits else best_over
    info = {"stages": chain.length, "slots": slots, "slot_bytes": slot, "dp_slots": m, "dp_value": dp_value,
            "pinned": len(chain.pinned), "pinned_bytes": chain.pinned_size, "tries": tries}
    return (fits, score, schedule), info


def better(a: tuple, b: tuple) -> bool:
    """Whether result ``a = (fits, cost or peak, ...)`` beats ``b``: fitting first, then the score."""
    return (a[0], -a[1]) > (b[0], -b[1])


def solve_on_chains(problem: Problem, max_stages: int, deadline: float,
                    solve_chain: Callable[[Chain, float], tuple[tuple, dict]]) -> tuple[tuple, dict]:
    """``solve_chain`` on the chain of ``problem`` and, when it pins anything more, on the chain
    with long skips pinned (U-Nets leave few cuts otherwise): the better result. The second
    chain is tried when the first result does not fit, or when time remains for it."""
    t0 = time.perf_counter()
    chain = extract_chain(problem, max_stages)
    result, info = solve_chain(chain, deadline)
    took = time.perf_counter() - t0
    try:
        other_chain = extract_chain(problem, max_stages, pin_skips=True)
    except MethodFailed:
        return result, info
    if other_chain.pinned == chain.pinned or (result[0] and time.perf_counter() + took > deadline):
        return result, info
    other, other_info = solve_chain(other_chain, deadline if result[0] else math.inf)
    if better(other, result):
        return other, {**other_info, "pin_skips": True}
    return result, info


def solve_rotor(problem: Problem, time_limit: Optional[float] = None, *, max_stages: int = DEFAULT_MAX_STAGES,
                slots: int = DEFAULT_SLOTS) -> Solution:
    started = time.perf_counter()
    deadline = started + (time_limit if time_limit is not None else math.inf)
    (fits, score, schedule), info = solve_on_chains(
        problem, max_stages, deadline, lambda chain, until: rotor_on_chain(problem, chain, slots, until))
    return finish(problem, schedule, "rotor", started, lower_bound=problem.total_cost(), info=info)
