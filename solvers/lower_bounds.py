"""Lower bounds on the compute cost of rematerialization schedules.

Two bounds, with different scopes:

* `lower_bound(problem)`: valid for EVERY schedule the simulator accepts
  (any order of computations, any number of recomputations, any frees), and
  cheap: bit-set reachability plus one fractional knapsack per "moment";
  about a second on graphs of thousands of values.
* `lp_lower_bound(problem, time_limit)`: the LP relaxation of Checkmate's
  MILP (`solvers.checkmate`). It is a bound only for Checkmate's restricted
  space (first computations in the problem's fixed order, stage structure,
  memory rounded up to units); a schedule outside that space may cost less.

Why `lower_bound` holds (the argument, for any valid schedule):

Fix a non-source value w and look at the instant of w's FIRST compute.

1. Every ancestor of w has been computed at least once before that instant
   (w needs its inputs resident, recursively).
2. Every strict descendant x of w is computed (at least once: every value is
   computed) and every compute of x comes after w's first compute. So a value
   u read by such an x is resident at some instant after the moment; and a
   sink must be resident at the end, also after the moment.
3. Let K(w) = non-source values other than w, w's inputs and w's
   descendants that are read by a strict descendant of w or are sinks. Each
   u in K(w) is resident at the moment or computed after it (by 2). If u is
   also an ancestor of w, computing it after the moment is a second compute
   (by 1), which costs at least cost[u] on top of ``total_cost()`` (which
   counts every value once). For a u that is not an ancestor, computing it
   after the moment may be its first compute: it costs nothing extra.
4. Recomputing a view needs its alias parent resident at that later time,
   so (induction up the alias chain) if no value on the alias chain of u is
   resident at the moment, every value on that chain is computed after it.
   Hence we reason per storage (alias tree) T rooted at a non-source r: let
   K_T = K(w) ∩ T and CU = the union of the alias chains of K_T. Either some
   member of CU is resident at the moment, and then T occupies at least
   W_T = min over CU of mem (a resident member's topmost resident alias
   ancestor lies on its chain and counts its full size), or every member of
   CU is computed after the moment, costing at least C_T = the sum of cost
   over the ancestors of w in K_T ∪ {r}. A non-recomputable ancestor of w in
   K_T ∪ {r} forces the first branch. (This is what catches the backward
   pass reading a saved activation through a view that it takes late: the
   view is not an ancestor of w, but its storage is.) Values whose alias
   chain reaches a source never add memory and are ignored. A value in no
   alias tree is the tree {u}: W = mem[u], C = cost[u], used only when u is
   an ancestor of w (otherwise C would be 0).
5. At the moment w and its inputs are resident (and the sources). Their
   memory is at least: sources' memory + mem of each that is in no alias
   tree + for each alias tree they touch, the least W over their chains
   (argument of 4). Trees they touch are left out of the knapsack (their
   K members are treated as free to keep, which only weakens the bound).
   Trees are disjoint storages, so these lower bounds add up.
6. So, with cap = budget - (memory of 5), the trees kept at the moment have
   sum of W_T <= cap, and the cost is at least total_cost() + sum of C_T over
   the trees not kept. Relaxing to a fractional knapsack (weights capped at
   the deficit D = sum W_T - cap, which is valid for 0/1 choices: dropping
   any one item of weight >= D already suffices) gives a number every
   schedule's cost is at least, solved greedily by C/W.

The bound is the maximum over all moments w. Moments are not added up:
one recomputation of u after both moments serves both. When the forced
memory alone exceeds the budget, or not enough can be dropped, no schedule
fits and the bound is ``math.inf``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .memory import memory_of
from .problem import Problem


@dataclass(frozen=True)
class _Storage:
    """Per-value alias-tree facts shared by every moment."""

    root: np.ndarray  # int64: root of the alias tree (the value itself outside trees)
    treed: np.ndarray  # bool: member of a tree with a non-source root and more than one member
    covered: np.ndarray  # bool: alias chain reaches a source (never adds memory)
    chain_min: np.ndarray  # int64: least mem on the alias chain from the value to its root


def _storage(problem: Problem) -> _Storage:
    n = problem.n
    alias_of = problem.alias_of
    mem = problem.mem
    root = np.arange(n, dtype=np.int64)
    covered = np.zeros(n, dtype=bool)
    chain_min = mem.astype(np.int64).copy()
    for v in range(n):  # parents precede children
        a = int(alias_of[v])
        if a >= 0:
            root[v] = root[a]
            covered[v] = bool(problem.is_source[a] or covered[a])
            chain_min[v] = min(chain_min[v], chain_min[a])
    tree_size = np.bincount(root, minlength=n)
    treed = (tree_size[root] > 1) & ~covered & ~problem.is_source
    return _Storage(root=root, treed=treed, covered=covered, chain_min=chain_min)


def _to_mask(bits: int, n: int) -> np.ndarray:
    raw = np.frombuffer(bits.to_bytes((n + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def _reach(problem: Problem) -> tuple[list[int], list[int], list[int]]:
    """Per value, as bit sets: its ancestors, its strict descendants, and the
    values read by its strict descendants."""
    n = problem.n
    anc = [0] * n
    for v in range(n):
        a = 0
        for p in problem.preds[v]:
            a |= anc[p] | (1 << p)
        anc[v] = a
    read_after = [0] * n
    desc = [0] * n
    pred_bits = [sum(1 << p for p in ps) for ps in problem.preds]
    for v in range(n - 1, -1, -1):
        r = d = 0
        for s in problem.succs[v]:
            r |= pred_bits[s] | read_after[s]
            d |= desc[s] | (1 << s)
        read_after[v] = r
        desc[v] = d
    return anc, desc, read_after


@dataclass(frozen=True)
class Moment:
    """One moment's knapsack: the bound it gives and what it is made of."""

    node: int  # w: the moment is w's first compute
    extra: float  # recomputation cost every schedule pays beyond total_cost() (inf: nothing fits)
    forced: int  # bytes resident at the moment no matter what (sources, w, w's inputs)
    demand: int  # bytes of the storages that are read after the moment (sum of W_T)


def _forced_memory(problem: Problem, st: _Storage, base: int, present: list[int]) -> tuple[int, set[int]]:
    """Lower bound on the memory of sources + ``present`` (argument 5) and the trees they touch."""
    total = base
    tree_min: dict[int, int] = {}
    for v in present:
        if problem.is_source[v] or st.covered[v]:
            continue
        if st.treed[v]:
            r = int(st.root[v])
            tree_min[r] = min(tree_min.get(r, 1 << 62), int(st.chain_min[v]))
        else:
            total += int(problem.mem[v])
    return total + sum(tree_min.values()), set(tree_min)


def _knapsack(weights: np.ndarray, costs: np.ndarray, deficit: float) -> float:
    """Least cost of dropping items (fractionally) whose weight adds up to ``deficit``."""
    if deficit <= 0:
        return 0.0
    w = np.minimum(weights.astype(np.float64), deficit)
    if w.sum() < deficit:
        return math.inf
    order = np.lexsort((-w, costs / np.maximum(w, 1e-300)))
    w, c = w[order], costs[order]
    cum = np.cumsum(w)
    k = int(np.searchsorted(cum, deficit))  # first item that completes the deficit
    before = float(cum[k - 1]) if k else 0.0
    return float(c[:k].sum() + c[k] * (deficit - before) / w[k]) if w[k] > 0 else float(c[:k].sum())


def moments(problem: Problem, time_limit: Optional[float] = None) -> list[Moment]:
    """The knapsack bound of every moment (argument 1-6 of the module docstring)."""
    started = time.perf_counter()
    n = problem.n
    st = _storage(problem)
    anc, desc, read_after = _reach(problem)
    sink_bits = sum(1 << v for v in problem.sinks)
    drop_bits = sum(1 << v for v in range(n) if problem.is_source[v] or st.covered[v])
    base = memory_of(problem, ())
    mem, cost = problem.mem.astype(np.int64), problem.cost
    rec = problem.recomputable
    out: list[Moment] = []
    for w in problem.non_sources:
        if time_limit is not None and time.perf_counter() - started > time_limit:
            break
        preds = problem.preds[w]
        # Needed after the moment and not a descendant of w (nor w, nor an input of w).
        k_bits = (read_after[w] | sink_bits) & ~desc[w] & ~drop_bits & ~(1 << w)
        for p in preds:
            k_bits &= ~(1 << p)
        forced, touched = _forced_memory(problem, st, base, list(preds) + [w])
        cap = problem.budget - forced
        if k_bits == 0:
            out.append(Moment(w, 0.0 if cap >= 0 else math.inf, forced, 0))
            continue
        K = np.flatnonzero(_to_mask(k_bits, n))
        before = _to_mask(anc[w], n)  # computed before the moment in every schedule
        tre = st.treed[K]
        # Values in no alias tree: one item each, when computed before the moment
        # (otherwise dropping them may cost nothing).
        plain = K[~tre & before[K]]
        weights = [mem[plain]]
        costs = [cost[plain]]
        must = [~rec[plain]]
        # Alias trees: one item per tree not touched by the forced set.
        members = K[tre]
        if len(members):
            roots = st.root[members]
            if touched:
                keep = ~np.isin(roots, np.fromiter(touched, dtype=np.int64))
                members, roots = members[keep], roots[keep]
        if len(members):
            uniq, inv = np.unique(roots, return_inverse=True)
            w_t = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(w_t, inv, st.chain_min[members])
            old = before[members]  # only recomputing what was computed before costs extra
            c_t = np.bincount(inv, weights=np.where(old, cost[members], 0.0), minlength=len(uniq))
            root_in_k = np.zeros(len(uniq), dtype=bool)
            root_in_k[inv[members == roots]] = True
            c_t = c_t + np.where(~root_in_k & before[uniq], cost[uniq], 0.0)
            m_t = ~rec[uniq] & before[uniq]
            np.logical_or.at(m_t, inv, ~rec[members] & old)
            weights.append(w_t)
            costs.append(c_t)
            must.append(m_t)
        W = np.concatenate(weights)
        C = np.concatenate(costs)
        M = np.concatenate(must)
        forced_all = forced + int(W[M].sum())
        demand = int(W.sum())
        deficit = forced_all + int(W[~M].sum()) - problem.budget
        extra = math.inf if forced_all > problem.budget else _knapsack(W[~M], C[~M], float(deficit))
        out.append(Moment(w, extra, forced_all, demand))
    return out


def lower_bound(problem: Problem, time_limit: Optional[float] = None) -> float:
    """A lower bound on the cost of every schedule of ``problem`` (see the module
    docstring), at least ``problem.total_cost()``; ``math.inf`` when no schedule
    can fit the budget. With ``time_limit``, moments not reached in time are skipped
    (the bound stays valid, only weaker)."""
    total = problem.total_cost()
    if memory_of(problem, ()) > problem.budget:
        return math.inf
    best = max((m.extra for m in moments(problem, time_limit)), default=0.0)
    return total + best


def lp_lower_bound(problem: Problem, time_limit: Optional[float] = None) -> float:
    """Optimum of the LP relaxation of Checkmate's MILP, plus nothing else.

    VALID ONLY FOR CHECKMATE'S SPACE AS ITS MILP MODELS IT: schedules whose
    first computations follow the problem's fixed order, in Checkmate's stage
    structure, with memory rounded up to the MILP's units and views counted
    conservatively (see `solvers.checkmate`). It is not a bound on schedules
    outside that space, not even on ``exhaustive_stages`` (exact alias
    accounting admits schedules the MILP does not). Returns at least ``total_cost()``;
    ``math.inf`` when even the relaxation is infeasible. Builds the MILP's
    formulation through `checkmate._Formulation` with every Boolean relaxed to
    [0, 1] and solves the LP with HiGHS; the dual bound is reported, so a time
    limit that stops the solve early still gives a valid (weaker) number."""
    from ortools.math_opt.python import mathopt

    from .checkmate import MEMORY_UNITS_LIMIT, _Formulation, memory_scale
    from .milp_backends import RAW_INFEASIBLE, MathOptBuilder

    class _Relaxed(MathOptBuilder):
        def bool_var(self) -> int:
            return self.num_var(0.0, 1.0)

    total = problem.total_cost()
    if problem.n_compute == 0:
        return total
    scale = memory_scale(problem, MEMORY_UNITS_LIMIT["highs"])
    if scale is None:
        return math.inf
    builder = _Relaxed(mathopt.SolverType.HIGHS)
    _Formulation(problem, builder, scale, 1.0)
    raw = builder.solve(time_limit, None)
    if raw.status == RAW_INFEASIBLE:
        return math.inf
    bound = raw.bound if math.isfinite(raw.bound) else total
    # LP tolerances: shave a relative 1e-7 so a rounding error never overstates the bound.
    return max(total, bound - 1e-7 * max(1.0, abs(bound)))
