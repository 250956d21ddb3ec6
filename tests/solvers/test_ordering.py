"""`solvers.transforms.ordering.after_last_reads`: writers moved after every read of what they overwrite.

Training graphs get one writer per parameter (an optimizer update: it reads the
parameter's gradient and the parameter, and overwrites the parameter), placed in
the problem's order right after the gradient. Recomputing baselines then read
parameters after their writer; the transform must leave no such read, keep
every compute, and keep the schedule valid."""
from __future__ import annotations

from collections import Counter

import networkx as nx
import pytest

from solvers import METHODS, MethodFailed, Op, Problem, simulate
from solvers.core.generators import chain, training, unet
from solvers.transforms.ordering import after_last_reads


def _with_writers(G: nx.DiGraph) -> tuple[nx.DiGraph, dict[str, str]]:
    """``G`` (nodes renamed to strings) with a writer after each parameter gradient."""
    sources = {v for v in G if G.in_degree(v) == 0}
    writes: dict[str, str] = {}
    order: list[str] = []
    extra: dict[str, tuple[dict, list[str]]] = {}
    for v in G.nodes:
        order.append(str(v))
        params = [p for p in G.predecessors(v) if p in sources and G.out_degree(v) == 0]
        for p in params:  # v is a parameter gradient: it reads the parameter and is a sink
            w = f"write{p}"
            order += [w, f"done{p}"]
            extra[w] = ({"mem": 1, "cost": 0.0, "recomputable": False}, [str(v), str(p)])
            extra[f"done{p}"] = ({"mem": 0, "cost": 0.0, "recomputable": False}, [w])
            writes[w] = str(p)
    H = nx.DiGraph()
    for name in order:
        if name in extra:
            attrs, preds = extra[name]
            H.add_node(name, **attrs)
            H.add_edges_from((q, name) for q in preds)
        else:
            H.add_node(name, **G.nodes[int(name)])
    H.add_edges_from((str(a), str(b)) for a, b in G.edges)
    for v in H.nodes:
        if "alias_of" in H.nodes[v]:
            H.nodes[v]["alias_of"] = str(H.nodes[v]["alias_of"])
    return H, writes


def _reads_after_writer(problem: Problem, schedule, writes) -> list[tuple[str, str]]:
    written: set[int] = set()
    bad = []
    target = {problem.index[w]: problem.index[t] for w, t in writes.items()}
    for op, node in schedule:
        if op is not Op.COMPUTE:
            continue
        v = problem.index[node]
        if v in target:
            written.add(target[v])
        elif written.intersection(problem.preds[v]):
            bad.append((str(node), sorted(written.intersection(problem.preds[v]))[0]))
    return bad


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("base", ["chain", "unet"])
def test_writers_follow_every_read_and_the_schedule_stays_valid(seed, base):
    forward = chain(14, seed=seed) if base == "chain" else unet(2, seed=seed)
    G, writes = _with_writers(training(forward, seed))
    assert writes
    p = Problem.from_networkx(G, 10**12)
    top = METHODS["store_all"](p, None).peak
    hazards = 0
    for method in ("store_all", "recompute_all", "sqrt_n", "greedy"):
        for fraction in (1.0, 0.6):
            q = p.with_budget(int(top * fraction))
            try:
                schedule = METHODS[method](q, None).schedule
            except MethodFailed:
                continue
            hazards += bool(_reads_after_writer(q, schedule, writes))
            fixed = after_last_reads(q, schedule, writes)
            assert _reads_after_writer(q, fixed, writes) == []
            assert Counter(n for o, n in fixed if o is Op.COMPUTE) == Counter(n for o, n in schedule if o is Op.COMPUTE)
            simulate(q, fixed)  # raises on a read of a value that is not resident
    if base == "chain":
        assert hazards, "no schedule read a parameter after its writer: the test tests nothing"


def test_a_read_of_a_view_of_the_source_counts_as_a_read():
    """A transposed weight shares the weight's storage: a writer must follow its readers too."""
    G = nx.DiGraph()
    G.add_node("w", mem=4, cost=0.0)
    G.add_node("x", mem=4, cost=0.0)
    G.add_node("wt", mem=4, cost=0.01, alias_of="w")  # the transpose: a view
    G.add_node("y", mem=4, cost=1.0)
    G.add_edges_from([("x", "y"), ("wt", "y"), ("w", "wt")])
    G.add_node("gw", mem=4, cost=1.0)
    G.add_edges_from([("y", "gw"), ("x", "gw")])
    G.add_node("update", mem=1, cost=0.0, recomputable=False)
    G.add_edges_from([("gw", "update"), ("w", "update")])
    G.add_node("done", mem=0, cost=0.0, recomputable=False)
    G.add_edge("update", "done")
    G.add_node("gx", mem=4, cost=1.0)  # reads the view after the weight's gradient is final
    G.add_edges_from([("y", "gx"), ("wt", "gx")])
    p = Problem.from_networkx(G, 10**6)
    schedule = METHODS["store_all"](p, None).schedule
    order = [str(n) for o, n in schedule if o is Op.COMPUTE]
    assert order.index("update") < order.index("gx")  # the problem's order puts the writer too early
    fixed = after_last_reads(p, schedule, {"update": "w"})
    order = [str(n) for o, n in fixed if o is Op.COMPUTE]
    assert order.index("update") > order.index("gx")
    simulate(p, fixed)
