"""The planning problem: a DAG of values with sizes, compute costs and a budget.

A `Problem` is the only input every solver sees. It is torch-free and stores
the graph as index arrays in a fixed topological order, so that simulation
and the constructive baselines stay linear in the graph size:

* node ``i`` has name ``names[i]``, predecessors ``preds[i]`` (indices < i),
  size ``mem[i]`` in bytes, compute time ``cost[i]``,
  ``recomputable[i]`` (False: must be computed exactly once) and
  ``alias_of[i]`` (index of the predecessor whose storage it lives in, or -1)
  and ``offloadable[i]`` (False: may not be copied to the host, e.g. a
  bookkeeping value with no tensor behind it; default True);
* ``same_storage[i]`` (default False) says that view ``i`` holds all of its
  alias parent's storage and nothing else (``mem`` equal): views made from one
  instance of a storage then count its bytes once (``unbind``/``split``/
  ``chunk`` outputs kept after their parent is freed). False means the view
  may hold a part (one output of a multi-output op) and counts on its own;
* ``host_work[i]`` (default 0) is time spent off the compute stream once ``i``
  is computed: host-side work it starts (an optimizer update computed in host
  memory, with its copies), which runs on a host stream of its own, one piece
  after another, overlapping compute; the step ends when it is done too;
* sources (no predecessors) are inputs, resident for the whole schedule;
* sinks (no successors) must be resident when the schedule ends.

A problem may also have a host link (``host_bandwidth`` bytes per time unit
each way, 0 when there is none) and a ``host_capacity`` in bytes (None:
unlimited): values can then be offloaded to host memory and prefetched back
(see `schedule`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Hashable, Iterable, Optional

import networkx as nx
import numpy as np

JSON_FORMAT = "memplan.solvers.Problem"
JSON_VERSION = 1


@dataclass(frozen=True)
class ProblemLists:
    mem: list[int]
    cost: list[float]
    is_source: list[bool]
    recomputable: list[bool]
    alias_of: list[int]
    offloadable: list[bool]


@dataclass(frozen=True, eq=False)
class Problem:
    names: tuple[Hashable, ...]
    preds: tuple[tuple[int, ...], ...]
    mem: np.ndarray  # int64, bytes
    cost: np.ndarray  # float64, time units
    recomputable: np.ndarray  # bool
    alias_of: np.ndarray  # int64, -1 when the value owns its storage
    budget: int
    host_bandwidth: float = 0.0  # bytes per time unit each way; 0: no host link, no offload
    host_capacity: Optional[int] = None  # bytes of host memory for offloaded values; None: unlimited
    offloadable: Optional[np.ndarray] = None  # bool; None: every value (sources and views never are)
    same_storage: Optional[np.ndarray] = None  # bool; None: no view is known to hold its parent's whole storage
    host_work: Optional[np.ndarray] = None  # float64, time units on the host stream; None: none
    # Derived in __post_init__; never passed by callers.
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False)
    index: dict[Hashable, int] = field(init=False, repr=False)
    is_source: np.ndarray = field(init=False, repr=False)
    is_sink: np.ndarray = field(init=False, repr=False)
    sources: tuple[int, ...] = field(init=False, repr=False)
    sinks: tuple[int, ...] = field(init=False, repr=False)
    non_sources: tuple[int, ...] = field(init=False, repr=False)
    budget_free_cache: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.names)
        mem = np.asarray(self.mem, dtype=np.int64)
        cost = np.asarray(self.cost, dtype=np.float64)
        recomputable = np.asarray(self.recomputable, dtype=bool)
        alias_of = np.asarray(self.alias_of, dtype=np.int64)
        offloadable = np.ones(n, dtype=bool) if self.offloadable is None else np.asarray(self.offloadable, dtype=bool)
        same_storage = np.zeros(n, dtype=bool) if self.same_storage is None else np.asarray(self.same_storage, dtype=bool)
        host_work = np.zeros(n, dtype=np.float64) if self.host_work is None else np.asarray(self.host_work,
                                                                                          dtype=np.float64)
        for name, arr in (("mem", mem), ("cost", cost), ("recomputable", recomputable), ("alias_of", alias_of),
                          ("offloadable", offloadable), ("same_storage", same_storage), ("host_work", host_work)):
            if arr.shape != (n,):
                raise ValueError(f"{name} has shape {arr.shape}, expected ({n},)")
        if len(self.preds) != n:
            raise ValueError(f"preds has {len(self.preds)} entries, expected {n}")
        if (mem < 0).any():
            raise ValueError("mem must be non-negative")
        if not math.isfinite(self.host_bandwidth) or self.host_bandwidth < 0:
            raise ValueError("host_bandwidth must be finite and non-negative")
        if self.host_capacity is not None and self.host_capacity < 0:
            raise ValueError("host_capacity must be non-negative")
        if not np.isfinite(cost).all() or (cost < 0).any():
            # Negative costs would break every lower bound (sum of costs, MILP bounds).
            raise ValueError("cost must be finite and non-negative")
        if not np.isfinite(host_work).all() or (host_work < 0).any():
            raise ValueError("host_work must be finite and non-negative")
        preds = tuple(tuple(int(p) for p in ps) for ps in self.preds)
        succs: list[list[int]] = [[] for _ in range(n)]
        for v, ps in enumerate(preds):
            if len(set(ps)) != len(ps):
                raise ValueError(f"node {self.names[v]!r} lists a predecessor twice")
            for p in ps:
                if not 0 <= p < v:
                    raise ValueError(f"node {self.names[v]!r}: predecessor index {p} is not earlier in the order")
                succs[p].append(v)
            a = int(alias_of[v])
            if a != -1 and a not in ps:
                raise ValueError(f"node {self.names[v]!r}: alias_of must be one of its predecessors")
            if same_storage[v] and (a == -1 or mem[v] != mem[a]):
                raise ValueError(f"node {self.names[v]!r}: same_storage needs alias_of and the alias parent's mem")
        index = {name: i for i, name in enumerate(self.names)}
        if len(index) != n:
            raise ValueError("node names must be unique")
        is_source = np.array([len(ps) == 0 for ps in preds], dtype=bool)
        is_sink = np.array([len(s) == 0 for s in succs], dtype=bool)
        # Frozen dataclass: normalised arrays and derived views go in via object.__setattr__.
        offloadable = offloadable & ~is_source & (alias_of < 0)  # the simulator's rule, in one array
        for arr in (mem, cost, recomputable, alias_of, offloadable, same_storage, host_work, is_source, is_sink):
            arr.setflags(write=False)
        setattr_ = object.__setattr__
        setattr_(self, "names", tuple(self.names))
        setattr_(self, "preds", preds)
        setattr_(self, "mem", mem)
        setattr_(self, "cost", cost)
        setattr_(self, "recomputable", recomputable)
        setattr_(self, "alias_of", alias_of)
        setattr_(self, "offloadable", offloadable)
        setattr_(self, "same_storage", same_storage)
        setattr_(self, "host_work", host_work)
        setattr_(self, "budget", int(self.budget))
        setattr_(self, "host_bandwidth", float(self.host_bandwidth))
        setattr_(self, "host_capacity", None if self.host_capacity is None else int(self.host_capacity))
        setattr_(self, "succs", tuple(tuple(s) for s in succs))
        setattr_(self, "index", index)
        setattr_(self, "is_source", is_source)
        setattr_(self, "is_sink", is_sink)
        setattr_(self, "sources", tuple(int(i) for i in np.flatnonzero(is_source)))
        setattr_(self, "sinks", tuple(int(i) for i in np.flatnonzero(is_sink & ~is_source)))
        setattr_(self, "non_sources", tuple(int(i) for i in np.flatnonzero(~is_source)))
        # Results that do not depend on the budget, shared by every `with_budget` variant.
        setattr_(self, "budget_free_cache", {})

    # ------------------------------------------------------------------ sizes
    @property
    def n(self) -> int:
        """Number of values, sources included."""
        return len(self.names)

    @property
    def n_compute(self) -> int:
        """Number of values a schedule must compute (non-sources)."""
        return len(self.non_sources)

    def with_budget(self, budget: int) -> "Problem":
        """The same graph under another budget. Everything else, derived data and
        budget-independent caches included, is shared (the arrays are read-only)."""
        other = object.__new__(Problem)
        other.__dict__.update(self.__dict__)
        object.__setattr__(other, "budget", int(budget))
        return other

    def with_views_apart(self) -> "Problem":
        """The same problem with no view marked ``same_storage``: every view held without its base
        counts on its own. It never counts fewer bytes than this one at any step, so a schedule
        that fits it fits this problem too, at the same cost."""
        if not self.same_storage.any():
            return self
        apart = self.budget_free_cache.get("views_apart")
        if apart is None:
            apart = self.budget_free_cache["views_apart"] = replace(self, same_storage=None)
        return apart.with_budget(self.budget)

    def with_host(self, bandwidth: float, capacity: Optional[int] = None) -> "Problem":
        """The same graph and budget with a host link of ``bandwidth`` bytes per
        time unit (0 removes it) and ``capacity`` bytes of host memory. The same link shares this
        problem's budget-free results (`with_budget`)."""
        if float(bandwidth) == self.host_bandwidth and capacity == self.host_capacity:
            return self.with_budget(self.budget)
        return replace(self, host_bandwidth=bandwidth, host_capacity=capacity)

    @property
    def has_host(self) -> bool:
        """Whether values can be offloaded (there is a host link)."""
        return self.host_bandwidth > 0

    def transfer_time(self, v: int) -> float:
        """Time to copy value ``v`` across the host link one way."""
        if not self.has_host:
            return math.inf
        return float(self.mem[v]) / self.host_bandwidth

    # ------------------------------------------------------------ networkx I/O
    @classmethod
    def from_networkx(cls, G: nx.DiGraph, budget: int, host_bandwidth: float = 0.0,
                      host_capacity: Optional[int] = None) -> "Problem":
        """Lower a DiGraph whose nodes carry ``mem``/``cost`` (and optionally
        ``recomputable``, ``alias_of``, ``offloadable``, ``same_storage``, ``host_work``). Node order is G's insertion order when
        that is topological (fx graphs arrive in execution order), else a
        deterministic topological sort that breaks ties by insertion order."""
        if not nx.is_directed_acyclic_graph(G):
            raise ValueError("graph has a cycle")
        order = list(G.nodes)
        position = {v: i for i, v in enumerate(order)}
        if not all(position[u] < position[v] for u, v in G.edges):
            order = list(nx.lexicographical_topological_sort(G, key=position.__getitem__))
        index = {v: i for i, v in enumerate(order)}
        preds, mem, cost, recomputable, alias_of, offloadable, same_storage = [], [], [], [], [], [], []
        host_work: list[float] = []
        for v in order:
            attrs = G.nodes[v]
            if "mem" not in attrs or "cost" not in attrs:
                raise ValueError(f"node {v!r} needs 'mem' and 'cost' attributes")
            m = attrs["mem"]
            if int(m) != m:
                raise ValueError(f"node {v!r}: mem must be an integer number of bytes")
            # Predecessors sorted by position keep the arrays deterministic.
            preds.append(tuple(sorted(index[u] for u in G.predecessors(v))))
            mem.append(int(m))
            cost.append(float(attrs["cost"]))
            recomputable.append(bool(attrs.get("recomputable", True)))
            offloadable.append(bool(attrs.get("offloadable", True)))
            same_storage.append(bool(attrs.get("same_storage", False)))
            host_work.append(float(attrs.get("host_work", 0.0)))
            a = attrs.get("alias_of")
            if a is not None and a not in index:
                raise ValueError(f"node {v!r}: alias_of {a!r} is not a node")
            alias_of.append(-1 if a is None else index[a])
        return cls(tuple(order), tuple(preds), np.array(mem, dtype=np.int64), np.array(cost, dtype=np.float64),
                   np.array(recomputable, dtype=bool), np.array(alias_of, dtype=np.int64), int(budget),
                   host_bandwidth, host_capacity, np.array(offloadable, dtype=bool), np.array(same_storage, dtype=bool),
                   np.array(host_work, dtype=np.float64))

    def to_networkx(self) -> nx.DiGraph:
        G = nx.DiGraph()
        for i, name in enumerate(self.names):
            attrs: dict[str, Any] = {"mem": int(self.mem[i]), "cost": float(self.cost[i])}
            if not self.recomputable[i]:
                attrs["recomputable"] = False
            if self.alias_of[i] >= 0:
                attrs["alias_of"] = self.names[self.alias_of[i]]
            if self._pinned_to_device(i):
                attrs["offloadable"] = False
            if self.same_storage[i]:
                attrs["same_storage"] = True
            if self.host_work[i] > 0:
                attrs["host_work"] = float(self.host_work[i])
            G.add_node(name, **attrs)
        for v, ps in enumerate(self.preds):
            for p in ps:
                G.add_edge(self.names[p], self.names[v])
        return G

    # ---------------------------------------------------------------- JSON I/O
    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for i, name in enumerate(self.names):
            nodes.append({
                "name": name,
                "preds": [self.names[p] for p in self.preds[i]],
                "mem": int(self.mem[i]),
                "cost": float(self.cost[i]),
                "recomputable": bool(self.recomputable[i]),
                "alias_of": None if self.alias_of[i] < 0 else self.names[self.alias_of[i]],
            })
            if self._pinned_to_device(i):
                nodes[-1]["offloadable"] = False
            if self.same_storage[i]:
                nodes[-1]["same_storage"] = True
            if self.host_work[i] > 0:
                nodes[-1]["host_work"] = float(self.host_work[i])
        data = {"format": JSON_FORMAT, "version": JSON_VERSION, "budget": self.budget, "nodes": nodes}
        if self.has_host:
            data["host_bandwidth"] = self.host_bandwidth
            data["host_capacity"] = self.host_capacity
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Problem":
        if data.get("format") != JSON_FORMAT:
            raise ValueError(f"not a {JSON_FORMAT} document")
        nodes = data["nodes"]
        index = {node["name"]: i for i, node in enumerate(nodes)}
        return cls(
            names=tuple(node["name"] for node in nodes),
            preds=tuple(tuple(index[p] for p in node["preds"]) for node in nodes),
            mem=np.array([node["mem"] for node in nodes], dtype=np.int64),
            cost=np.array([node["cost"] for node in nodes], dtype=np.float64),
            recomputable=np.array([node.get("recomputable", True) for node in nodes], dtype=bool),
            alias_of=np.array([-1 if node.get("alias_of") is None else index[node["alias_of"]] for node in nodes],
                              dtype=np.int64),
            offloadable=np.array([node.get("offloadable", True) for node in nodes], dtype=bool),
            same_storage=np.array([node.get("same_storage", False) for node in nodes], dtype=bool),
            host_work=np.array([node.get("host_work", 0.0) for node in nodes], dtype=np.float64),
            budget=int(data["budget"]),
            host_bandwidth=float(data.get("host_bandwidth", 0.0)),
            host_capacity=data.get("host_capacity"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Problem":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Problem":
        """A Problem saved as JSON, gzipped when the name ends in ``.gz`` (the exported graphs)."""
        path = Path(path)
        if path.suffix == ".gz":
            import gzip

            with gzip.open(path, "rt") as f:
                return cls.from_json(f.read())
        return cls.from_json(path.read_text())

    # --------------------------------------------------------------- helpers
    def _pinned_to_device(self, i: int) -> bool:
        """Marked not offloadable although the simulator's rule would allow it (what I/O must record)."""
        return not self.offloadable[i] and not self.is_source[i] and self.alias_of[i] < 0

    def lists(self) -> "ProblemLists":
        """The per-node arrays as plain Python lists (cached): element access on
        lists is several times faster than on numpy arrays in the hot loops."""
        cached = self.__dict__.get("_lists")
        if cached is None:
            cached = ProblemLists(mem=self.mem.tolist(), cost=self.cost.tolist(), is_source=self.is_source.tolist(),
                                  recomputable=self.recomputable.tolist(), alias_of=self.alias_of.tolist(),
                                  offloadable=self.offloadable.tolist())
            object.__setattr__(self, "_lists", cached)
        return cached

    def names_of(self, indices: Iterable[int]) -> list[Hashable]:
        return [self.names[i] for i in indices]

    def total_cost(self) -> float:
        """Cost of computing every non-source exactly once: a lower bound for any schedule."""
        return float(self.cost[list(self.non_sources)].sum()) if self.non_sources else 0.0

    def __repr__(self) -> str:
        host = f", host_bandwidth={self.host_bandwidth:g}" if self.has_host else ""
        return (f"Problem(n={self.n}, sources={len(self.sources)}, sinks={len(self.sinks)}, "
                f"edges={sum(map(len, self.preds))}, budget={self.budget}{host})")
