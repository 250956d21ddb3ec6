"""Lower bounds on the compute cost of rematerialization schedules.

Two bounds, with different scopes:

* `lower_bound(problem)`: valid for EVERY schedule the simulator accepts
  (any order of computations, any number of recomputations, any frees), and
  cheap: bit-set reachability, one fractional knapsack per "moment", and
  two small LPs; a few seconds on graphs of thousands of values.
* `lp_lower_bound(problem, time_limit)`: the LP relaxation of Checkmate's
  MILP (`solvers.methods.checkmate`). It is a bound only for Checkmate's restricted
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

The bound is the largest of these relaxations:

* the fractional knapsack of each moment (above);
* an LP over the moments with the largest knapsack bounds that share one
  variable per value, y_u = "u is computed twice or more" (`_combined`):
  moments cannot simply be added up, since one recomputation of u after
  both moments serves both, but an LP with shared y is exact about that;
* a cascade LP on a few of those moments (`_cascade_rows`): a value
  computed after the moment needs its inputs resident then, so each input
  is resident at the moment or computed after it too, and so on up the
  graph. This charges recomputing a cheap value whose expensive input was
  not kept;
* the best moment's cascade as a MILP (the same rows with 0/1 variables),
  solved with the time left: its dual bound is at least the LP's;
* an interval model over a chain of moments (`_interval_rows`), as a MILP:
  residency at each moment and computes in each interval between two
  moments, so that a value no budget lets stay across several tight
  moments is charged once per recomputation, not once in all.

Every schedule gives an integer solution of each LP, so their optima and the
MILP's optimum (dual bounds, with costs scaled to at most 1 and shaved by 1e-6 against solver
tolerances) are bounds too.
When the forced memory alone exceeds the budget, or not enough can be
dropped, no schedule fits and the bound is ``math.inf``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..core.memory import memory_of
from ..core.problem import Problem


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


@dataclass(frozen=True)
class _Items:
    """A moment's knapsack items. Item i weighs ``weight[i]`` bytes; dropping it means
    recomputing every value ``value[j]`` with ``item[j] == i`` (the ancestors of w in
    its storage's K_T ∪ {r}); ``must[i]``: it cannot be dropped."""

    weight: np.ndarray
    must: np.ndarray
    item: np.ndarray
    value: np.ndarray
    deficit: int  # bytes that must be dropped (<= 0: none)


class BoundContext:
    """Per-problem data shared by all moments and bound models (alias trees, reachability bit
    sets): built once per problem and passed to `moments`, `main_chain` and `interval_bound`."""

    def __init__(self, problem: Problem) -> None:
        self.p = problem
        self.st = _storage(problem)
        self.anc, self.desc, self.read_after = _reach(problem)
        self.sink_bits = sum(1 << v for v in problem.sinks)
        self.skip = problem.is_source | self.st.covered  # never add memory: sources and views of them
        self.drop_bits = sum(1 << v for v in np.flatnonzero(self.skip).tolist())
        self.base = memory_of(problem, ())
        self.mem = problem.mem.astype(np.int64)

    def items(self, w: int) -> tuple[int, Optional[_Items]]:
        """Forced bytes at w's first compute, and the knapsack items (None: nothing needed after)."""
        p, st, n = self.p, self.st, self.p.n
        preds = p.preds[w]
        # Needed after the moment and not a descendant of w (nor w, nor an input of w).
        k_bits = (self.read_after[w] | self.sink_bits) & ~self.desc[w] & ~self.drop_bits & ~(1 << w)
        for q in preds:
            k_bits &= ~(1 << q)
        forced, touched = _forced_memory(p, st, self.base, list(preds) + [w])
        if k_bits == 0:
            return forced, None
        K = np.flatnonzero(_to_mask(k_bits, n))
        before = _to_mask(self.anc[w], n)  # computed before the moment in every schedule
        rec = p.recomputable
        tre = st.treed[K]
        # Values in no alias tree: one item each, when computed before the moment
        # (otherwise dropping them may cost nothing).
        plain = K[~tre & before[K]]
        weights, must = [self.mem[plain]], [~rec[plain]]
        items, values = [np.arange(len(plain))], [plain]
        # Alias trees: one item per tree not touched by the forced set.
        members = K[tre]
        if len(members) and touched:
            members = members[~np.isin(st.root[members], np.fromiter(touched, dtype=np.int64))]
        if len(members):
            roots = st.root[members]
            uniq, inv = np.unique(roots, return_inverse=True)
            w_t = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(w_t, inv, st.chain_min[members])
            old = before[members]  # only recomputing what was computed before costs extra
            root_in_k = np.zeros(len(uniq), dtype=bool)
            root_in_k[inv[members == roots]] = True
            root_old = ~root_in_k & before[uniq]
            m_t = ~rec[uniq] & before[uniq]
            np.logical_or.at(m_t, inv, ~rec[members] & old)
            offset = len(plain)
            weights.append(w_t)
            must.append(m_t)
            items += [offset + inv[old], offset + np.flatnonzero(root_old)]
            values += [members[old], uniq[root_old]]
        W = np.concatenate(weights)
        M = np.concatenate(must)
        forced_all = forced + int(W[M].sum())
        deficit = forced_all + int(W[~M].sum()) - p.budget
        return forced_all, _Items(W, M, np.concatenate(items), np.concatenate(values), deficit)


def moments(problem: Problem, time_limit: Optional[float] = None, keep_items: bool = False,
            ctx: Optional[BoundContext] = None) -> list[tuple[Moment, Optional[_Items]]] | list[Moment]:
    """The knapsack bound of every moment (argument 1-6 of the module docstring)."""
    started = time.perf_counter()
    ctx = ctx or BoundContext(problem)
    cost = problem.cost
    out: list = []
    for w in problem.non_sources:
        if time_limit is not None and time.perf_counter() - started > time_limit:
            break
        forced, its = ctx.items(w)
        if its is None:
            m = Moment(w, 0.0 if forced <= problem.budget else math.inf, forced, 0)
        else:
            C = np.bincount(its.item, weights=cost[its.value], minlength=len(its.weight))
            extra = math.inf if forced > problem.budget else \
                _knapsack(its.weight[~its.must], C[~its.must], float(its.deficit))
            m = Moment(w, extra, forced, int(its.weight.sum()))
        out.append((m, its) if keep_items else m)
    return out


def _combined(problem: Problem, chosen: list[_Items], time_limit: Optional[float]) -> float:
    """LP over several moments sharing one "recomputed at least twice" variable per
    value: y_u in [0, 1] costs cost[u]; at moment m, dropping item i (d_mi in [0, 1])
    needs d_mi <= y_u for each value u of the item, and the dropped (capped) weight
    covers the deficit. Every schedule gives an integer solution (y_u = u computed
    twice or more, d_mi = item i not resident at moment m), so the LP optimum is a
    bound on its extra cost. Returns the LP's dual bound (0 when it fails)."""
    from ortools.math_opt.python import mathopt

    from .milp_backends import MathOptBuilder

    b = MathOptBuilder(mathopt.SolverType.HIGHS)
    y: dict[int, int] = {}
    for its in chosen:
        D = float(its.deficit)
        drop = np.flatnonzero(~its.must)
        d = {int(i): b.num_var(0.0, 1.0) for i in drop}
        row = [(d[i], min(float(its.weight[i]), D) / D) for i in d]
        b.add(row, 1.0, math.inf)
        for i, u in zip(its.item.tolist(), its.value.tolist()):
            if i not in d:
                continue
            if u not in y:
                y[u] = b.num_var(0.0, 1.0 if problem.recomputable[u] else 0.0)
            b.add([(d[i], 1.0), (y[u], -1.0)], -math.inf, 0.0)
    return _solve_lp(problem, b, y, time_limit)


def _cascade_rows(ctx: BoundContext, w: int, b, y: dict[int, int], integer: bool = False) -> bool:
    """Add one moment's cascade LP to builder ``b`` (shared y: "computed twice"); with
    ``integer`` the res, a and y variables are 0/1 (the MILP whose LP relaxation it is).

    Extends argument 3-6 of the module docstring: a value computed after the
    moment needs each input resident at that later time, so each input is
    resident at the moment or computed after it too. Per value x in L (the
    values needed after the moment, closed under inputs): res_x (resident at
    the moment) and a_x (computed after it), in [0, 1]:

    * x needed after the moment (the set K):   res_x + a_x >= 1;
    * x computed after needs each input q in L: res_q + a_q >= a_x;
    * a_x <= y_x when x is an ancestor of w (a second compute), a_x = 0 when
      x is moreover not recomputable; a_x costs nothing otherwise;
    * memory: a value in no alias tree weighs mem[x] when resident; an alias
      tree T weighs at least chain_min[x] for each resident member x (that
      member's topmost resident alias ancestor is on its chain), so a
      variable tree_w_T >= chain_min[x] * res_x; trees touched by w and its
      inputs are already in the forced memory and free. With D = forced +
      all maximal weights - budget, the dropped weight is >= D, where the
      coefficients of plain values (0/1 in any schedule) are capped at D;
      tree terms are not capped (fractional in real schedules). Also, a
      member x needed after the moment (in K, or computed after it) whose
      root is not computed after it has a resident value on its alias chain
      (argument 4): tree_w_T >= chain_min[x] * (1 - a_root), resp.
      chain_min[x] * (a_x - a_root).

    Any schedule gives an integer solution (res, a, y read off the schedule),
    so the LP optimum bounds its extra cost. Returns False when the moment
    needs nothing dropped."""
    p, st, n = ctx.p, ctx.st, ctx.p.n
    preds = p.preds[w]
    forced_bits = sum(1 << q for q in preds) | (1 << w)
    k_bits = (ctx.read_after[w] | ctx.sink_bits) & ~ctx.desc[w] & ~ctx.drop_bits & ~forced_bits
    if not k_bits:
        return False
    forced, touched = _forced_memory(p, st, ctx.base, list(preds) + [w])
    K = np.flatnonzero(_to_mask(k_bits, n))
    closure = k_bits
    for x in K.tolist():
        closure |= ctx.anc[x]
    closure &= ~ctx.drop_bits & ~forced_bits
    L = np.flatnonzero(_to_mask(closure, n))
    before = _to_mask(ctx.anc[w], n)
    in_k = _to_mask(k_bits, n)
    # Memory items: plain values, and alias trees not touched by the forced set.
    treed = st.treed[L]
    roots = st.root[L]
    free_tree = treed & np.isin(roots, np.fromiter(touched, dtype=np.int64)) if touched else np.zeros(len(L), bool)
    plain = L[~treed]
    tree_members = L[treed & ~free_tree]
    uniq, inv = np.unique(st.root[tree_members], return_inverse=True)
    w_t = np.zeros(len(uniq), dtype=np.int64)  # the most a tree can be made to weigh
    if len(uniq):
        np.maximum.at(w_t, inv, st.chain_min[tree_members])
    demand = int(ctx.mem[plain].sum()) + int(w_t.sum())
    D = float(forced + demand - p.budget)
    if D <= 0:
        return False
    def unit() -> int:
        return b.bool_var() if integer else b.num_var(0.0, 1.0)

    res = {int(x): unit() for x in L}
    act = {}
    for x in L.tolist():
        ancestor = bool(before[x])
        act[x] = b.num_var(0.0, 0.0) if ancestor and not p.recomputable[x] else unit()
        if in_k[x]:
            b.add([(res[x], 1.0), (act[x], 1.0)], 1.0, math.inf)
        if ancestor:
            if x not in y:
                y[x] = unit() if p.recomputable[x] else b.num_var(0.0, 0.0)
            b.add([(act[x], 1.0), (y[x], -1.0)], -math.inf, 0.0)
    for x in L.tolist():
        for q in p.preds[x]:
            if q in res:
                b.add([(res[q], 1.0), (act[q], 1.0), (act[x], -1.0)], 0.0, math.inf)
    row = []
    for x in plain.tolist():
        c = min(float(ctx.mem[x]), D) / D
        if c:
            row.append((res[x], -c))
    const = sum(-c for _, c in row)  # sum of capped weights
    # A tree weighs at least chain_min[x] for each resident member x (in units of D).
    # Its term is not capped: its weight takes fractional values in real schedules.
    tree_w = [b.num_var(0.0, float(wt) / D) for wt in w_t.tolist()]
    for x, t in zip(tree_members.tolist(), inv.tolist()):
        cm = float(st.chain_min[x]) / D
        b.add([(tree_w[t], 1.0), (res[x], -cm)], 0.0, math.inf)
        # If x is needed after the moment (or computed after it: its alias parent is
        # then needed) and the root is not computed after it, some value on x's
        # alias chain is resident at the moment: the tree weighs chain_min[x].
        # (Without these rows the LP spreads res thinly along a chain of views.)
        r = int(st.root[x])
        if r == x or r not in act:
            continue
        if in_k[x]:
            b.add([(tree_w[t], 1.0), (act[r], cm)], cm, math.inf)
        b.add([(tree_w[t], 1.0), (act[x], -cm), (act[r], cm)], 0.0, math.inf)
    row += [(h, -1.0) for h in tree_w]
    const += float(w_t.sum()) / D
    b.add(row, 1.0 - const, math.inf)  # sum c (1 - res) + sum (W_T - tree_w) >= 1
    return True


def _left(time_limit: Optional[float], started: float) -> Optional[float]:
    """What is left of ``time_limit`` seconds counted from ``started`` (at least 0.1 s)."""
    return None if time_limit is None else max(0.1, time_limit - (time.perf_counter() - started))


def _cascade(problem: Problem, ctx: BoundContext, ws: list[int], time_limit: Optional[float],
             integer: bool = False) -> float:
    """Optimum of the cascade LPs of moments ``ws`` sharing y (a bound on the extra cost); with
    ``integer``, the dual bound of their MILP reached within ``time_limit`` (which includes
    building the model)."""
    from ortools.math_opt.python import mathopt

    from .milp_backends import MathOptBuilder

    started = time.perf_counter()
    b = MathOptBuilder(mathopt.SolverType.HIGHS)
    y: dict[int, int] = {}
    if not any([_cascade_rows(ctx, w, b, y, integer) for w in ws]):
        return 0.0
    return _solve_lp(problem, b, y, _left(time_limit, started))


def _solve_lp(problem: Problem, b, y: dict[int, int], time_limit: Optional[float]) -> float:
    """Minimise sum cost[u] * y_u; return a safe lower bound on the optimum (0 if none).

    Costs are scaled to at most 1 first: with costs of 1e-5 (seconds), the
    solver's absolute tolerances (1e-7) would be large relative errors. The
    dual bound is shaved by 1e-6 (scaled) against the remaining tolerances.
    An "infeasible" LP gives 0, not infinity: a tolerance call must never
    claim that no schedule exists."""
    from .milp_backends import RAW_INFEASIBLE

    if not y:
        return 0.0
    scale = max((float(problem.cost[u]) for u in y), default=0.0)
    if scale <= 0:
        return 0.0
    b.minimize([(h, float(problem.cost[u]) / scale) for u, h in y.items()], 0.0)
    raw = b.solve(time_limit, 1)
    if raw.status == RAW_INFEASIBLE or not math.isfinite(raw.bound):
        return 0.0
    return max(0.0, raw.bound - 1e-6 * max(1.0, abs(raw.bound))) * scale


def main_chain(problem: Problem, ctx: BoundContext) -> list[int]:
    """A longest path, in values, through the non-source values that can add memory (not views
    of sources): each is an ancestor of the next, so their first computes come in this order."""
    skip = ctx.skip
    length = np.zeros(problem.n, dtype=np.int64)
    prev = np.full(problem.n, -1, dtype=np.int64)
    for v in range(problem.n):
        if skip[v]:
            continue
        for q in problem.preds[v]:
            if not skip[q] and length[q] > length[v]:
                length[v], prev[v] = length[q], q
        length[v] += 1
    path = []
    v = int(np.argmax(length)) if problem.n else -1
    while v >= 0 and length[v] > 0:
        path.append(v)
        v = int(prev[v])
    return path[::-1]


def interval_moments(chain: list[int], by_node: dict[int, Moment], k: int) -> list[int]:
    """Up to ``k`` moments on ``chain`` for `_interval_rows`: the one with the largest knapsack
    bound, then those with the most memory forced at them (the tightest instants: where a
    value held across them has to be recomputed once more), at least ``len(chain) / 2k``
    chain positions apart, in chain order."""
    ranked = [w for w in chain if w in by_node]
    if not ranked or k < 1:
        return []
    pos = {w: i for i, w in enumerate(chain)}
    spacing = max(1, len(chain) // (2 * k))
    chosen = [max(ranked, key=lambda w: by_node[w].extra)]
    for w in sorted(ranked, key=lambda w: (-by_node[w].forced, -by_node[w].extra)):
        if len(chosen) >= k:
            break
        if all(abs(pos[w] - pos[c]) >= spacing for c in chosen):
            chosen.append(w)
    return sorted(chosen, key=pos.__getitem__)


def _interval_rows(ctx: BoundContext, ws: list[int], b, integer: bool) -> dict[int, int]:
    """The interval model over moments ``ws`` (a chain: each an ancestor of the next) in builder
    ``b``; returns the extra-compute variable of each value (``e_v``, cost ``cost[v]``).

    Moment i is the first compute of ``ws[i]``; interval i is the open time between moments i
    and i+1 (the last one runs to the end). Unlike the cascade, which asks only whether a value
    is computed again after one moment, this model counts recomputations per interval, so a
    value that no budget lets stay across two tight moments pays twice. For every value x that
    adds memory, and every value v that owns its storage (the root of its alias tree), 0/1 in
    any schedule:

    * ``r[x,i]``: some value on x's alias chain (x, its alias parent, ... the root) is resident
      at moment i; 0 when the root is a descendant of ``ws[i]`` (not computed yet); 1 for
      ``ws[i]`` and its inputs;
    * ``c[v,i]``: v is computed in interval i; 0 when v is ``ws[i+1]`` or a descendant of it,
      and for a value that cannot be recomputed once computed.

    Rows (each argued for any schedule):

    * a value x is first computed after moment lo and before moment hi (lo: the last moment
      it descends from; hi: the first it is an ancestor of): each input q of x is then resident,
      so r[q,lo] + sum of c[root(q), lo..hi-1] >= 1 (if no value on q's chain is resident at
      moment lo, the first one to become resident after it was computed, and a view's compute
      reads its parent, which is on the chain: so the root was computed); a sink likewise at
      the end;
    * v computed in interval i reads each input q there: r[q,i] + c[root(q),i] >= c[v,i];
    * residency carries over: r[x,i+1] <= r[x,i] + c[root(x),i] (except for the root
      ``ws[i+1]`` itself, computed at the moment);
    * memory at moment i: sources + mem[x] * r[x,i] for values in no alias tree + a weight per
      alias tree, at least chain_min[x] * r[x,i] for each member x (a resident value on x's
      chain counts a size on that chain), within the budget;
    * computes after the first: e_v >= sum of c[v,j] over the intervals after the first moment
      v is an ancestor of (or is), and e_v >= sum of all c[v,j] - 1.
    """
    from .milp_backends import ONE, ZERO

    p, st, n, k = ctx.p, ctx.st, ctx.p.n, len(ws)
    skip = ctx.skip
    vals = [x for x in range(n) if not skip[x]]
    root = st.root.tolist()
    roots = sorted({root[x] for x in vals})
    unit = b.bool_var if integer else (lambda: b.num_var(0.0, 1.0))
    desc = [_to_mask(ctx.desc[w], n) for w in ws]
    upto = [_to_mask(ctx.anc[w] | (1 << w), n) for w in ws]  # ancestors of ws[i], and ws[i]
    r: list[dict[int, int]] = []
    c: list[dict[int, int]] = []
    for i, w in enumerate(ws):
        forced = {q for q in p.preds[w] if not skip[q]} | {w}
        r.append({x: ONE if x in forced else ZERO if desc[i][root[x]] and root[x] != w else unit()
                  for x in vals})
        later = desc[i + 1] if i + 1 < k else None
        c.append({v: ZERO if (later is not None and (later[v] or v == ws[i + 1]))
                  or (not p.recomputable[v] and upto[i][v]) else unit() for v in roots})
    add = b.add_folded
    # Inputs read between two moments (or after the last), and sinks at the end.
    lo_of = np.full(n, -1, dtype=np.int64)
    hi_of = np.full(n, k, dtype=np.int64)
    for i in range(k):
        lo_of[desc[i]] = i
    for i in range(k - 1, -1, -1):
        hi_of[upto[i]] = i
    seen: set[tuple[int, int, int]] = set()
    for x in range(n):
        lo, hi = int(lo_of[x]), int(hi_of[x])
        if lo < 0 or p.is_source[x]:
            continue
        for q in p.preds[x]:
            if skip[q] or (q, lo, hi) in seen:
                continue
            seen.add((q, lo, hi))
            add([r[lo][q]] + [c[j][root[q]] for j in range(lo, hi)], [], 1.0, math.inf)
    for s in p.sinks:
        if not skip[s]:
            add([r[k - 1][s], c[k - 1][root[s]]], [], 1.0, math.inf)
    scale = float(p.budget)  # memory in budgets: byte-sized coefficients wreck the LP's tolerances
    cap = (p.budget - ctx.base) / scale
    trees: dict[int, list[int]] = {}
    for x in vals:
        if st.treed[x]:
            trees.setdefault(root[x], []).append(x)
    plain = [x for x in vals if not st.treed[x]]
    for i in range(k):
        ri, ci = r[i], c[i]
        for v in roots:
            if ci[v] == ZERO:
                continue
            for q in p.preds[v]:
                if not skip[q]:
                    add([ri[q], ci[root[q]]], [ci[v]], 0.0, math.inf)
        if i + 1 < k:
            nxt = ws[i + 1]
            for x in vals:
                if root[x] != nxt:
                    add([r[i + 1][x]], [ri[x], ci[root[x]]], -math.inf, 0.0)
        row: dict[int, float] = {}
        fixed = 0.0
        for x in plain:
            if ri[x] == ONE:
                fixed += float(p.mem[x]) / scale
            elif ri[x] != ZERO:
                row[ri[x]] = float(p.mem[x]) / scale
        for members in trees.values():
            heavy = max(float(st.chain_min[m]) for m in members) / scale
            least = max((float(st.chain_min[m]) / scale for m in members if ri[m] == ONE), default=0.0)
            live = [m for m in members if ri[m] not in (ONE, ZERO)]
            if not live:
                fixed += least
                continue
            weight = b.num_var(least, heavy)
            for m in live:
                b.add([(weight, 1.0), (ri[m], -float(st.chain_min[m]) / scale)], 0.0, math.inf)
            row[weight] = 1.0
        if fixed > cap + 1e-12:
            raise ValueError("the memory forced at a moment exceeds the budget")
        if row:
            b.add(list(row.items()), -math.inf, cap - fixed)
    extra: dict[int, int] = {}
    for v in roots:
        if p.cost[v] <= 0:
            continue
        first = next((i for i in range(k) if upto[i][v]), k)
        late = [c[j][v] for j in range(first, k)]
        early = [c[j][v] for j in range(first)]
        if all(h == ZERO for h in late + early):
            continue
        e = b.num_var(0.0, math.inf)
        extra[v] = e
        add([e], late, 0.0, math.inf)
        if early:
            add([e], late + early, -1.0, math.inf)
    return extra


def interval_bound(problem: Problem, ctx: BoundContext, ws: list[int], time_limit: Optional[float],
                   integer: bool = True) -> float:
    """The interval model's bound on the extra cost over moments ``ws`` (`_interval_rows`): its
    LP optimum, or with ``integer`` its MILP's dual bound reached within ``time_limit`` (which
    includes building the model)."""
    from ortools.math_opt.python import mathopt

    from .milp_backends import MathOptBuilder

    if not ws:
        return 0.0
    started = time.perf_counter()
    b = MathOptBuilder(mathopt.SolverType.HIGHS)
    try:
        extra = _interval_rows(ctx, ws, b, integer)
    except (ValueError, AssertionError):  # no schedule fits (`moments` reports that): no bound here
        return 0.0
    return _solve_lp(problem, b, extra, _left(time_limit, started))  # building took seconds on gpt48


def pruned_interval(problem: Problem, ctx: BoundContext, ws: list[int], time_limit: Optional[float],
                    progress: Optional[Callable[[float], None]] = None) -> float:
    """The interval model's bound on moments chosen from ``ws`` by their LP: moments are left out,
    one at a time, while leaving one out raises the LP optimum (within `PRUNE_SHARE` of the time),
    then the MILP runs on what is left in the rest, and, if it closes with time to spare, the MILP
    on all of ``ws``. Returns the largest of those MILPs' dual bounds and the LP optima seen (every
    subset of a chain of moments is a chain, so each is a bound); ``progress`` is called with each
    bound on the way.

    Why leave moments out: the LP is not monotone in its moments. Between two moments more, a
    fractional recomputation can be split over two intervals that each read the same fractional
    residency, where one interval would have needed it whole. Fewer moments also make a MILP that
    HiGHS closes (unet at 30%: 9 moments, LP 1.2856 of the total and a MILP still open after
    60 s at 1.3341; leaving out two, LP 1.3109 and the MILP 1.3492 in 5.6 s)."""
    started = time.perf_counter()
    if time_limit is not None and time_limit < PRUNE_MIN:
        return interval_bound(problem, ctx, ws, time_limit)
    prune_end = None if time_limit is None else started + PRUNE_SHARE * time_limit

    def out_of_time() -> bool:
        return prune_end is not None and time.perf_counter() >= prune_end

    best = interval_bound(problem, ctx, ws, _left(time_limit, started), integer=False)
    if progress is not None:
        progress(best)
    chosen = ws
    while len(chosen) > 2 and not out_of_time():
        trials = []
        for w in chosen:
            if out_of_time():
                break
            fewer = [x for x in chosen if x != w]
            trials.append((interval_bound(problem, ctx, fewer, _left(time_limit, started), integer=False), fewer))
        if not trials or max(t[0] for t in trials) <= best * (1 + 1e-9):
            break
        best, chosen = max(trials, key=lambda t: t[0])
        if progress is not None:
            progress(best)
    best = max(best, interval_bound(problem, ctx, chosen, _left(time_limit, started)))
    if chosen != ws and (time_limit is None or time_limit - (time.perf_counter() - started) >= MILP_MIN):
        # Fewer moments make a weaker integer model: where the MILP on all of them closes in the
        # time left (unet at 50%), it is the better bound.
        if progress is not None:
            progress(best)
        best = max(best, interval_bound(problem, ctx, ws, _left(time_limit, started)))
    return best


COMBINE = 24  # moments combined in the knapsack LP (the ones with the largest single bounds)
# The MILPs (the best moment's cascade, the interval model on one and on INTERVAL_MOMENTS
# moments) share the time left, each at most MILP_TIME seconds, and only when at least MILP_MIN
# are left: their dual bounds after HiGHS's root cuts and some branching are above the LPs'
# (gpt12 at 30%: extra cost 0.1730 -> 0.1751 of the total in 3 s for the cascade).
MILP_TIME = 15.0
MILP_MIN = 0.5
MILP_END = 0.97  # share of the time limit by which the MILPs end (loading a model into HiGHS is not timed by it)
INTERVAL_MOMENTS = 9  # moments of the interval model's larger run (`interval_moments`), before pruning
PRUNE_SHARE = 0.4  # of that run's time, at most, for leaving moments out by their LP (`pruned_interval`)
# With less time than this the run keeps its moments: the LPs would leave the MILP too little
# (unet at 30% with a 2 s bound: 1.3093 of the total pruned against 1.3256 without).
PRUNE_MIN = 4.0
CASCADE_SIZE = 12_000  # values (summed over moments) in the cascade LP
CASCADE_MOMENTS = 4  # at most this many moments in it


def lower_bound(problem: Problem, time_limit: Optional[float] = None, combine: int = COMBINE,
                cascade: bool = True, milp: bool = True, interval: bool = True,
                progress: Optional[Callable[[float], None]] = None) -> float:
    """A lower bound on the cost of every schedule of ``problem`` (see the module
    docstring), at least ``problem.total_cost()``; ``math.inf`` when no schedule
    can fit the budget. With ``time_limit``, moments not reached in time are skipped
    (the bound stays valid, only weaker). ``combine`` > 1 also solves the LP that
    combines that many moments (`_combined`); ``cascade`` the LP that follows the
    inputs of recomputed values (`_cascade_rows`) on the best moments; with it, ``milp``
    the best moment's cascade with 0/1 variables, then (``interval``) the interval model
    (`_interval_rows`) on that moment and on `INTERVAL_MOMENTS` moments, as MILPs, in the
    time left (`MILP_TIME` at most each). The largest of these bounds is returned; ``progress`` is
    called with the bound so far each time it rises (a caller that must stop it early keeps that)."""
    started = time.perf_counter()
    total = problem.total_cost()
    if memory_of(problem, ()) > problem.budget:
        return math.inf
    if problem.has_host:
        return total  # the bounds below price recomputation; a host copy can stand in for any of it
    ctx = BoundContext(problem)
    found = moments(problem, time_limit, keep_items=True, ctx=ctx)
    best = 0.0

    def improve(extra: float) -> None:
        nonlocal best
        if extra > best:
            best = extra
            if progress is not None:
                progress(total + best)

    improve(max((m.extra for m, _ in found), default=0.0))
    if not math.isfinite(best):
        return math.inf
    ranked = sorted((pair for pair in found if pair[0].extra > 0 and pair[1] is not None),
                    key=lambda pair: -pair[0].extra)

    if combine > 1 and len(ranked) > 1:
        improve(_combined(problem, [its for _, its in ranked[:combine]], _left(time_limit, started)))
    late = time_limit is not None and time.perf_counter() - started > time_limit / 2
    if cascade and ranked and not late:  # building the cascade LP takes as long as everything before
        chosen, size = [], 0
        for m, _ in ranked:
            size += bin(ctx.anc[m.node]).count("1")
            if chosen and (size > CASCADE_SIZE or len(chosen) >= CASCADE_MOMENTS):
                break
            chosen.append(m.node)
        improve(_cascade(problem, ctx, chosen, _left(time_limit, started)))
    if cascade and milp and ranked:
        # Three MILPs share the time left: the interval model on the best moment alone (stronger
        # where the tree rows bind, and quick: gpt2 12 layers at 50%, 1.0444 of the total in 1.3 s
        # against the cascade MILP's 1.0408 in 3 s, which matters to a search that stops at a
        # bound proved early), then the best moment's cascade, then the interval model on
        # INTERVAL_MOMENTS moments, pruned by their LP (stronger where values must be recomputed
        # more than once: unet at 30% with 18 s, 1.3269 of the total unpruned, 1.3492 pruned).
        cascade_milp = lambda t: _cascade(problem, ctx, [ranked[0][0].node], t, integer=True)  # noqa: E731
        runs = [cascade_milp]
        if interval:
            by_node = {m.node: m for m, _ in found}
            chain = main_chain(problem, ctx)
            runs = [lambda t: interval_bound(problem, ctx, interval_moments(chain, by_node, 1), t), cascade_milp,
                    lambda t: pruned_interval(problem, ctx, interval_moments(chain, by_node, INTERVAL_MOMENTS), t,
                                              improve)]
        for i, run in enumerate(runs):
            share = len(runs) - i  # each run has its share of the time the ones before it leave
            spare = MILP_TIME if time_limit is None else \
                (MILP_END * time_limit - (time.perf_counter() - started)) / share
            if spare < MILP_MIN:
                break
            try:
                improve(run(min(spare, MILP_TIME)))
            except RuntimeError:  # the solver gave up (numerics): the other bounds stand
                pass
    return total + best


def lp_lower_bound(problem: Problem, time_limit: Optional[float] = None) -> float:
    """Optimum of the LP relaxation of Checkmate's MILP, plus nothing else.

    VALID ONLY FOR CHECKMATE'S SPACE AS ITS MILP MODELS IT: schedules whose
    first computations follow the problem's fixed order, in Checkmate's stage
    structure, with memory rounded up to the MILP's units and views counted
    conservatively (see `solvers.methods.checkmate`). It is not a bound on schedules
    outside that space, not even on ``exhaustive_stages`` (exact alias
    accounting admits schedules the MILP does not). Returns at least ``total_cost()``;
    ``math.inf`` when even the relaxation is infeasible. Builds the MILP's
    formulation through `checkmate.Formulation` with every Boolean relaxed to
    [0, 1] and solves the LP with HiGHS; the dual bound is reported, so a time
    limit that stops the solve early still gives a valid (weaker) number."""
    from ortools.math_opt.python import mathopt

    from .checkmate import MEMORY_UNITS_LIMIT, Formulation, memory_scale
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
    # Costs scaled to at most 1, so that the solver's absolute tolerances stay small
    # relative to them (costs in seconds are around 1e-5).
    top = float(problem.cost.max()) if problem.n else 0.0
    factor = 1.0 / top if top > 0 else 1.0
    Formulation(problem, builder, scale, factor)
    raw = builder.solve(time_limit, None)
    if raw.status == RAW_INFEASIBLE:
        return math.inf
    if not math.isfinite(raw.bound):
        return total
    # LP tolerances: shave 1e-6 (scaled) so a rounding error never overstates the bound.
    return max(total, (raw.bound - 1e-6 * max(1.0, abs(raw.bound))) / factor)
