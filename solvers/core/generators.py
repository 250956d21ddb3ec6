"""Seeded random DAGs for tests and benchmarks.

Every generator returns an ``nx.DiGraph`` whose nodes are inserted in a
topological order and carry ``mem`` (int) and ``cost`` (float); sources are
the inputs (and, for training-like graphs, the parameters). Options add
non-recomputable values (``nonrecomputable_prob``) and views
(``view_prob``: a node that reads one value and aliases it), of which a
share (``same_storage_prob``) hold their base's whole storage, as the
outputs of ``unbind`` or ``split`` do (same ``mem``, marked ``same_storage``).
"""
from __future__ import annotations

import random
from typing import Callable, Optional

import networkx as nx


class _Builder:
    """Adds nodes with random sizes and costs; names are consecutive ints."""

    def __init__(self, seed: int, mem_range: tuple[int, int] = (1, 10), cost_range: tuple[float, float] = (0.5, 2.0),
                 nonrecomputable_prob: float = 0.0, same_storage_prob: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.G = nx.DiGraph()
        self.mem_range, self.cost_range = mem_range, cost_range
        self.nonrecomputable_prob = nonrecomputable_prob
        self.same_storage_prob = same_storage_prob

    def source(self, mem: Optional[int] = None) -> int:
        v = self.G.number_of_nodes()
        self.G.add_node(v, mem=self.rng.randint(*self.mem_range) if mem is None else mem, cost=0.0)
        return v

    def node(self, preds: list[int], mem: Optional[int] = None, cost: Optional[float] = None,
             alias_of: Optional[int] = None, same_storage: Optional[bool] = None) -> int:
        rng = self.rng
        v = self.G.number_of_nodes()
        attrs = {
            "mem": rng.randint(*self.mem_range) if mem is None else mem,
            "cost": round(rng.uniform(*self.cost_range), 3) if cost is None else cost,
        }
        if alias_of is not None:
            attrs["alias_of"] = alias_of
            if same_storage is None:
                same_storage = bool(self.same_storage_prob) and rng.random() < self.same_storage_prob
            if same_storage:
                attrs.update(mem=self.G.nodes[alias_of]["mem"], same_storage=True)
        elif self.nonrecomputable_prob and rng.random() < self.nonrecomputable_prob:
            attrs["recomputable"] = False
        self.G.add_node(v, **attrs)
        for p in dict.fromkeys(preds):
            self.G.add_edge(p, v)
        return v

    def maybe_view(self, v: int, prob: float) -> int:
        """With probability ``prob``, return a cheap view of v (same storage) instead of v."""
        if prob and self.rng.random() < prob:
            size = self.G.nodes[v]["mem"]
            return self.node([v], mem=self.rng.randint(1, max(1, size)), cost=0.01, alias_of=v)
        return v


def chain(n: int, seed: int = 0, **options) -> nx.DiGraph:
    """An input followed by ``n`` values, each reading the previous one."""
    view_prob = options.pop("view_prob", 0.0)
    b = _Builder(seed, **options)
    prev = b.source()
    for _ in range(n):
        prev = b.maybe_view(b.node([prev]), view_prob) if view_prob else b.node([prev])
    return b.G


def random_dag(n: int, seed: int = 0, n_sources: int = 1, edge_prob: float = 0.35, max_preds: int = 3,
               **options) -> nx.DiGraph:
    """``n`` values after ``n_sources`` inputs; each reads 1..max_preds earlier values,
    preferring recent ones. Mostly used for tiny exhaustive comparisons."""
    view_prob = options.pop("view_prob", 0.0)
    b = _Builder(seed, **options)
    rng = b.rng
    nodes = [b.source() for _ in range(n_sources)]
    made = 0
    while made < n:
        k = 1 + sum(rng.random() < edge_prob for _ in range(max_preds - 1))
        recent = nodes[-4:]
        preds = {rng.choice(recent)}
        while len(preds) < min(k, len(nodes)):
            preds.add(rng.choice(nodes))
        if view_prob and len(preds) == 1 and rng.random() < view_prob:
            (a,) = preds
            v = b.node([a], mem=rng.randint(1, max(1, b.G.nodes[a]["mem"])), cost=0.01, alias_of=a)
            if b.G.nodes[v].get("same_storage") and made + 1 < n:
                # a split: the next value is another piece of the same storage
                nodes.append(v)
                made += 1
                v = b.node([a], mem=b.G.nodes[a]["mem"], cost=0.01, alias_of=a, same_storage=True)
        else:
            v = b.node(sorted(preds))
        nodes.append(v)
        made += 1
    return b.G


def layered(n: int, seed: int = 0, width: int = 4, fan_in: int = 2, **options) -> nx.DiGraph:
    """Random layers of up to ``width`` values, each reading ``fan_in`` values of the previous
    two layers; the last layer is joined into one output."""
    view_prob = options.pop("view_prob", 0.0)
    b = _Builder(seed, **options)
    rng = b.rng
    layers = [[b.source() for _ in range(rng.randint(1, 2))]]
    made = 0
    while made < n - 1:
        w = min(rng.randint(1, width), n - 1 - made)
        pool = layers[-1] + (layers[-2] if len(layers) > 1 else [])
        layer = []
        for _ in range(w):
            preds = rng.sample(pool, min(len(pool), rng.randint(1, fan_in)))
            if not any(p in layers[-1] for p in preds):
                preds.append(rng.choice(layers[-1]))
            v = b.node(sorted(preds))
            layer.append(b.maybe_view(v, view_prob) if view_prob else v)
            made += 1
        layers.append(layer)
    b.node(layers[-1])
    return b.G


def unet(depth: int, seed: int = 0, **options) -> nx.DiGraph:
    """Encoder of ``depth`` levels (two values each), a bottleneck, and a decoder whose
    level i reads the previous decoder value and the encoder's level-i output (long skips)."""
    view_prob = options.pop("view_prob", 0.0)
    b = _Builder(seed, **options)
    x = b.source()
    skips = []
    prev = x
    for level in range(depth):
        a = b.node([prev])
        e = b.node([a])
        skips.append(b.maybe_view(e, view_prob) if view_prob else e)
        prev = b.node([e], mem=max(1, b.G.nodes[e]["mem"] // 2))  # downsample
    prev = b.node([prev])
    for level in reversed(range(depth)):
        up = b.node([prev])
        prev = b.node([up, skips[level]])
    b.node([prev])
    return b.G


def transformer(blocks: int, seed: int = 0, **options) -> nx.DiGraph:
    """Residual blocks: norm, q/k/v projections, scores, softmax, attention, projection,
    residual add, norm, two MLP layers, residual add (12 values per block)."""
    view_prob = options.pop("view_prob", 0.0)
    b = _Builder(seed, **options)
    x = b.source()
    for _ in range(blocks):
        h = b.node([x])
        q, k, v = (b.node([h]) for _ in range(3))
        if view_prob:
            q, k, v = (b.maybe_view(t, view_prob) for t in (q, k, v))
        scores = b.node([q, k], mem=b.rng.randint(8, 20))  # attention matrices are large
        probs = b.node([scores], mem=b.G.nodes[scores]["mem"])
        attn = b.node([probs, v])
        proj = b.node([attn])
        x = b.node([x, proj])
        h2 = b.node([x])
        up = b.node([h2], mem=b.rng.randint(10, 25))
        down = b.node([up])
        x = b.node([x, down])
    return b.G


def training(forward: nx.DiGraph, seed: int = 0, param_prob: float = 0.7) -> nx.DiGraph:
    """Mirror a forward graph into a joint forward+backward graph.

    A loss reads the forward outputs. Each forward value v gets a gradient node
    reading the gradients of v's consumers and v itself (the saved activation);
    forward values that read a parameter (a new source, with probability
    ``param_prob``) also get a parameter-gradient node reading the value's
    gradient and its inputs. Parameter gradients and the loss are the outputs."""
    rng = random.Random(seed)
    G = nx.DiGraph()
    next_id = 0

    def add(attrs: dict, preds: list) -> int:
        nonlocal next_id
        v = next_id
        next_id += 1
        G.add_node(v, **attrs)
        for p in dict.fromkeys(preds):
            G.add_edge(p, v)
        return v

    fmap: dict = {}
    params: dict = {}
    for v in forward.nodes:  # insertion order is topological
        attrs = dict(forward.nodes[v])
        preds = [fmap[p] for p in forward.predecessors(v)]
        if "alias_of" in attrs:
            attrs["alias_of"] = fmap[attrs["alias_of"]]  # a view keeps its base, renumbered
        elif preds and rng.random() < param_prob:
            p = add({"mem": max(1, attrs["mem"] // 4), "cost": 0.0}, [])
            params[v] = p
            preds.append(p)
        fmap[v] = add(attrs, preds)
    outputs = [v for v in forward.nodes if forward.out_degree(v) == 0 and forward.in_degree(v) > 0]
    loss = add({"mem": 1, "cost": 0.1}, [fmap[v] for v in outputs])
    grad: dict = {}
    for v in reversed(list(forward.nodes)):
        if forward.in_degree(v) == 0:
            continue  # inputs need no gradient
        attrs = forward.nodes[v]
        consumers = [grad[w] for w in forward.successors(v) if w in grad]
        preds = consumers or [loss]
        preds = preds + [fmap[v]]
        gattrs = {"mem": attrs["mem"], "cost": round(2 * attrs["cost"], 3)}
        grad[v] = add(gattrs, preds)
        if v in params:
            inputs = [fmap[p] for p in forward.predecessors(v) if forward.in_degree(p) > 0]
            add({"mem": G.nodes[params[v]]["mem"], "cost": attrs["cost"]}, [grad[v]] + inputs + [params[v]])
    return G


def training_like(n_nodes: int, seed: int = 0, base: str = "chain", **options) -> nx.DiGraph:
    """A joint forward+backward graph of about ``n_nodes`` values (sources included)
    built from a ``base`` forward graph: "chain", "layered" or "transformer"."""
    # Each forward value yields about 2.7 values in the joint graph (itself, its
    # gradient, a parameter and its gradient 70% of the time).
    n_forward = max(2, round(n_nodes / 3.4))
    makers: dict[str, Callable[[], nx.DiGraph]] = {
        "chain": lambda: chain(n_forward, seed, **options),
        "layered": lambda: layered(n_forward, seed, **options),
        "transformer": lambda: transformer(max(1, n_forward // 12), seed, **options),
    }
    return training(makers[base](), seed)


GENERATORS: dict[str, Callable[..., nx.DiGraph]] = {
    "chain": chain,
    "random": random_dag,
    "layered": layered,
    "unet": unet,
    "transformer": transformer,
}
