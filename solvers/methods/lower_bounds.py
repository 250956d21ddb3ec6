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
from typing import Callable, Optional

import numpy as np

from ..core.memory import memory_of
from ..core.problem import Problem
from solvers.methods.bound_moments import BoundContext, KnapsackItems, forced_memory, moments, to_mask
from solvers.methods.interval_bound import MILP_MIN, interval_bound, interval_moments, main_chain, pruned_interval, solve_lp, time_left


def _combined(problem: Problem, chosen: list[KnapsackItems], time_limit: Optional[float]) -> float:
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
    return solve_lp(problem, b, y, time_limit)


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
    forced, touched = forced_memory(p, st, ctx.base, list(preds) + [w])
    K = np.flatnonzero(to_mask(k_bits, n))
    closure = k_bits
    for x in K.tolist():
        closure |= ctx.anc[x]
    closure &= ~ctx.drop_bits & ~forced_bits
    L = np.flatnonzero(to_mask(closure, n))
    before = to_mask(ctx.anc[w], n)
    in_k = to_mask(k_bits, n)
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
    return solve_lp(problem, b, y, time_left(time_limit, started))


COMBINE = 24  # moments combined in the knapsack LP (the ones with the largest single bounds)
# The MILPs (the best moment's cascade, the interval model on one and on INTERVAL_MOMENTS
# moments) share the time left, each at most MILP_TIME seconds, and only when at least MILP_MIN
# are left: their dual bounds after HiGHS's root cuts and some branching are above the LPs'
# (gpt12 at 30%: extra cost 0.1730 -> 0.1751 of the total in 3 s for the cascade).
MILP_TIME = 15.0
MILP_END = 0.97  # share of the time limit by which the MILPs end (loading a model into HiGHS is not timed by it)
INTERVAL_MOMENTS = 9  # moments of the interval model's larger run (`interval_moments`), before pruning
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
        improve(_combined(problem, [its for _, its in ranked[:combine]], time_left(time_limit, started)))
    late = time_limit is not None and time.perf_counter() - started > time_limit / 2
    if cascade and ranked and not late:  # building the cascade LP takes as long as everything before
        chosen, size = [], 0
        for m, _ in ranked:
            size += bin(ctx.anc[m.node]).count("1")
            if chosen and (size > CASCADE_SIZE or len(chosen) >= CASCADE_MOMENTS):
                break
            chosen.append(m.node)
        improve(_cascade(problem, ctx, chosen, time_left(time_limit, started)))
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
