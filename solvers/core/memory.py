"""Memory of a resident set under the alias rule: the one place in `solvers`
where bytes are added up.

A value ``v`` with ``alias_of = a`` lives inside ``a``'s storage: it adds no
memory while any value on its alias chain (``a``, ``alias_of(a)``, ...) is
resident, and counts its own ``mem`` when none is. Values linked by
``alias_of`` form trees ("alias trees"); the memory of a tree is the sum of
``mem`` over its resident members that have no resident alias ancestor, except
that members holding one and the same storage count it once: a view marked
``same_storage`` holds its parent's whole storage, so sibling views made from
one instance (the outputs of ``unbind`` or ``split`` after the parent is
freed) are one storage, not one each.

"The same storage" means the same *instance*: computing (or prefetching) a
value that owns its storage again makes a new storage, so a view made from an
earlier instance of its base no longer lives inside the resident one and
counts on its own. Each add of a storage owner gets a fresh instance number;
a view takes its base's current one.

`Residency` tracks a resident set incrementally. Values outside any alias
tree (the common case) cost O(1) per change; a change inside a tree
re-evaluates that tree only, which is O(tree size).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from .problem import Problem


class AliasTrees:
    """Alias-tree structure of a problem, computed once per problem and cached."""

    def __init__(self, problem: Problem) -> None:
        n = problem.n
        alias_of = problem.alias_of
        root = np.arange(n, dtype=np.int64)
        # Parents precede children in the order, so one forward pass finds roots.
        for v in range(n):
            a = alias_of[v]
            if a >= 0:
                root[v] = root[a]
        members: dict[int, list[int]] = {}
        for v in range(n):
            if alias_of[v] >= 0:
                members.setdefault(int(root[v]), [int(root[v])]).append(v)
        self.root = root
        # Members listed in topological order, so a parent is seen before its children.
        self.members = {r: tuple(ms) for r, ms in members.items()}
        self.in_tree = np.zeros(n, dtype=bool)
        for ms in self.members.values():
            self.in_tree[list(ms)] = True
        self.in_tree_list: list[bool] = self.in_tree.tolist()
        # storage[v]: the topmost member whose storage v holds whole (v itself unless
        # same_storage). Two members with one storage and one instance are one storage.
        storage = list(range(n))
        whole_views = np.flatnonzero(problem.same_storage).tolist()
        for v in whole_views:  # parents precede children
            storage[v] = storage[int(alias_of[v])]
        self.storage = storage
        self.shared_roots = {int(root[v]) for v in whole_views}
        # descendants[v]: every value made from v's storage (views of views included), in order.
        descendants: dict[int, list[int]] = {}
        for w in range(n):
            a = int(alias_of[w])
            while a >= 0:
                descendants.setdefault(a, []).append(w)
                a = int(alias_of[a])
        self.descendants = {v: tuple(ws) for v, ws in descendants.items()}


def alias_trees(problem: Problem) -> AliasTrees:
    cached = problem.__dict__.get("_alias_trees")
    if cached is None:
        cached = AliasTrees(problem)
        object.__setattr__(problem, "_alias_trees", cached)
    return cached


class Residency:
    """A resident set with its memory total. Sources are resident from the start.

    ``resident`` is a bytearray (fast element access); ``mask`` is a numpy
    bool view of the same bytes for vectorised queries."""

    def __init__(self, problem: Problem, resident: Iterable[int] = ()) -> None:
        self.problem = problem
        self._trees = alias_trees(problem)
        self._in_tree = self._trees.in_tree_list
        lists = problem.lists()
        self._mem = lists.mem
        self._alias_of = lists.alias_of
        self.resident = bytearray(problem.n)
        self.mask = np.frombuffer(self.resident, dtype=bool)
        self._instance = [0] * problem.n  # storage instance of each value's latest add (0: never added)
        self._instances_made = 0
        self._tree_total: dict[int, int] = {r: 0 for r in self._trees.members}
        self.total = 0
        for v in problem.sources:
            self.add(v)
        for v in resident:
            if not self.resident[v]:
                self.add(v)

    def __contains__(self, v: int) -> bool:
        return bool(self.resident[v])

    def _tree_holders(self, r: int) -> Iterator[tuple[int, int]]:
        """The members of tree ``r`` whose bytes count now, with those bytes: the alias rule."""
        # Walk members parent-first; `covered` = v lives in the storage of a resident
        # alias ancestor (the instance it was made from).
        resident, alias_of, mem = self.resident, self._alias_of, self._mem
        instance = self._instance
        covered: dict[int, bool] = {}
        # Storages already counted, as (whole-storage member, instance); only trees with
        # same_storage views can count one storage from two members.
        counted = set() if r in self._trees.shared_roots else None
        storage = self._trees.storage
        for v in self._trees.members[r]:
            a = int(alias_of[v])
            cov = a >= 0 and instance[v] == instance[a] and bool(resident[a] or covered[a])
            covered[v] = cov
            if resident[v] and not cov:
                if counted is not None:
                    key = (storage[v], instance[v])
                    if key in counted:
                        continue
                    counted.add(key)
                yield v, mem[v]

    def _tree_memory(self, r: int) -> int:
        return sum(nbytes for _, nbytes in self._tree_holders(r))

    def related(self, v: int) -> list[int]:
        """The values whose counted bytes a change to ``v`` can move: its alias tree, or ``v`` alone."""
        return list(self._trees.members[int(self._trees.root[v])]) if self._in_tree[v] else [v]

    def holders(self, v: int) -> dict[int, int]:
        """Which of `related` (v) hold bytes now, and how many: each storage counted once, against
        the member the alias rule charges it to (so a breakdown of the total by value adds up)."""
        if not self._in_tree[v]:
            return {v: self._mem[v]} if self.resident[v] else {}
        return dict(self._tree_holders(int(self._trees.root[v])))

    def _set(self, v: int, value: bool) -> None:
        self.resident[v] = value
        if value:
            a = self._alias_of[v]
            if a >= 0:
                if not self._instance[a]:
                    # Only a set given outright (no schedule made it) holds a view whose base
                    # was never added: its views are taken to come from one instance of it.
                    self._instances_made += 1
                    self._instance[a] = self._instances_made
                self._instance[v] = self._instance[a]  # a view lives in its base's current storage
            else:
                self._instances_made += 1
                self._instance[v] = self._instances_made
        if not self._in_tree[v]:
            self.total += self._mem[v] if value else -self._mem[v]
            return
        r = int(self._trees.root[v])
        new = self._tree_memory(r)
        self.total += new - self._tree_total[r]
        self._tree_total[r] = new

    def add(self, v: int) -> None:
        if self.resident[v]:
            raise ValueError(f"value {v} is already resident")
        self._set(v, True)

    def remove(self, v: int) -> None:
        if not self.resident[v]:
            raise ValueError(f"value {v} is not resident")
        self._set(v, False)

    def total_if_added(self, v: int) -> int:
        """Memory after adding ``v``, without changing the set."""
        if not self._in_tree[v]:
            return self.total + self._mem[v]
        instance = self._instance[v]
        self._set(v, True)
        after = self.total
        self._set(v, False)
        self._instance[v] = instance
        self._refresh(v)
        return after

    def total_if_removed(self, v: int) -> int:
        """Memory after removing ``v``, without changing the set."""
        if not self._in_tree[v]:
            return self.total - self._mem[v]
        instance = self._instance[v]
        self._set(v, False)
        after = self.total
        self._set(v, True)
        self._instance[v] = instance
        self._refresh(v)
        return after

    def _refresh(self, v: int) -> None:
        """Recount v's tree after its generation was restored by hand."""
        r = int(self._trees.root[v])
        new = self._tree_memory(r)
        self.total += new - self._tree_total[r]
        self._tree_total[r] = new

    def copy(self) -> "Residency":
        other = object.__new__(Residency)
        other.problem, other._trees, other._mem, other._alias_of = self.problem, self._trees, self._mem, self._alias_of
        other._in_tree = self._in_tree
        other.resident = bytearray(self.resident)
        other.mask = np.frombuffer(other.resident, dtype=bool)
        other._instance = list(self._instance)
        other._instances_made = self._instances_made
        other._tree_total = dict(self._tree_total)
        other.total = self.total
        return other


def memory_of(problem: Problem, resident: Iterable[int]) -> int:
    """Memory of ``resident`` plus the sources (always resident)."""
    return Residency(problem, resident).total


def least_memory_holding(problem: Problem, required: Iterable[int]) -> int:
    """The least memory of any resident set that holds ``required`` (and the sources).

    Not `memory_of(required)`: holding more can cost less. Views held without their base
    count on their own, so the three outputs of a ``split`` (each counting the whole
    storage) cost three times what they cost with the split's result resident. Per alias
    tree, a member is either held (its subtree is then covered at its ``mem``) or not (its
    children's subtrees are covered on their own), the cheaper of the two where it is not
    required; storage instances are taken as shared, the cheapest case. Every resident set
    holding ``required`` costs at least this (`memory_of` of it)."""
    trees = alias_trees(problem)
    alias_of, mem, in_tree = problem.alias_of, problem.mem, trees.in_tree
    needed = set(int(v) for v in required) | set(problem.sources)
    total = sum(int(mem[v]) for v in needed if not in_tree[v])
    for r in {int(trees.root[v]) for v in needed if in_tree[v]}:
        members = trees.members[r]
        cover = dict.fromkeys(members, 0)  # least memory covering the required members below each
        for v in reversed(members):  # children before parents
            if v in needed:
                cover[v] = int(mem[v])
            elif cover[v]:
                cover[v] = min(int(mem[v]), cover[v])
            if v != r:
                cover[int(alias_of[v])] += cover[v]
        total += cover[r]
    return total
