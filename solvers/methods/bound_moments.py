"""The moments `solvers.methods.lower_bounds` reasons about: for each value, the instant of its first
compute, what must be resident then or recomputed after, and the knapsack that prices it (see that
module's docstring for why the bound holds)."""
from __future__ import annotations
import math
import time
from dataclasses import dataclass
from typing import Optional
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


def to_mask(bits: int, n: int) -> np.ndarray:
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


def forced_memory(problem: Problem, st: _Storage, base: int, present: list[int]) -> tuple[int, set[int]]:
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
class KnapsackItems:
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

    def items(self, w: int) -> tuple[int, Optional[KnapsackItems]]:
        """Forced bytes at w's first compute, and the knapsack items (None: nothing needed after)."""
        p, st, n = self.p, self.st, self.p.n
        preds = p.preds[w]
        # Needed after the moment and not a descendant of w (nor w, nor an input of w).
        k_bits = (self.read_after[w] | self.sink_bits) & ~self.desc[w] & ~self.drop_bits & ~(1 << w)
        for q in preds:
            k_bits &= ~(1 << q)
        forced, touched = forced_memory(p, st, self.base, list(preds) + [w])
        if k_bits == 0:
            return forced, None
        K = np.flatnonzero(to_mask(k_bits, n))
        before = to_mask(self.anc[w], n)  # computed before the moment in every schedule
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
        return forced_all, KnapsackItems(W, M, np.concatenate(items), np.concatenate(values), deficit)


def moments(problem: Problem, time_limit: Optional[float] = None, keep_items: bool = False,
            ctx: Optional[BoundContext] = None) -> list[tuple[Moment, Optional[KnapsackItems]]] | list[Moment]:
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
