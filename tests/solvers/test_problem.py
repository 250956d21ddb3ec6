"""Problem: lowering from networkx, order, validation of inputs, JSON round trip."""
import networkx as nx
import numpy as np
import pytest

from solvers import Problem
from solvers.core import generators as gen

from .helpers import graph


def test_insertion_order_kept_when_topological():
    G = graph({"x": (1, 0), "b": (1, 1), "a": (1, 1)}, [("x", "b"), ("x", "a"), ("b", "a")])
    p = Problem.from_networkx(G, 10)
    assert p.names == ("x", "b", "a")
    assert p.preds == ((), (0,), (0, 1))


def test_non_topological_insertion_is_sorted_deterministically():
    G = nx.DiGraph()
    for name in ["c", "a", "x", "b"]:
        G.add_node(name, mem=1, cost=1.0)
    G.add_edges_from([("x", "a"), ("a", "c"), ("x", "b")])
    p1 = Problem.from_networkx(G, 10)
    p2 = Problem.from_networkx(G.copy(), 10)
    assert p1.names == p2.names
    pos = {n: i for i, n in enumerate(p1.names)}
    assert all(pos[u] < pos[v] for u, v in G.edges)
    # Ties broken by insertion order: x before a before c; b after x.
    assert p1.names == ("x", "a", "c", "b")


def test_sources_sinks_and_arrays():
    G = graph({"x": (4, 0), "w": (2, 0), "a": (3, 1.5), "b": (5, 2.0, {"recomputable": False}),
               "c": (1, 0.5, {"alias_of": "a"})},
              [("x", "a"), ("w", "a"), ("a", "b"), ("a", "c")])
    p = Problem.from_networkx(G, 100)
    assert p.sources == (0, 1) and p.sinks == (3, 4) and p.non_sources == (2, 3, 4)
    assert p.mem.dtype == np.int64 and p.mem.tolist() == [4, 2, 3, 5, 1]
    assert p.recomputable.tolist() == [True, True, True, False, True]
    assert p.alias_of.tolist() == [-1, -1, -1, -1, 2]
    assert p.total_cost() == 4.0 and p.n_compute == 3


@pytest.mark.parametrize("nodes, edges, match", [
    ({"x": (1, 0), "a": (1, 1, {"alias_of": "x"}), "b": (1, 1, {"alias_of": "a"})}, [("x", "a")], "predecessor"),
    ({"x": (1, 0), "a": (-1, 1)}, [("x", "a")], "non-negative"),
    ({"x": (1, 0), "a": (1, -2.0)}, [("x", "a")], "non-negative"),
    ({"x": (1, 0), "a": (1.5, 1)}, [("x", "a")], "integer"),
])
def test_bad_inputs_rejected(nodes, edges, match):
    with pytest.raises(ValueError, match=match):
        Problem.from_networkx(graph(nodes, edges), 10)


def test_cycle_rejected():
    G = graph({"a": (1, 1), "b": (1, 1)}, [("a", "b"), ("b", "a")])
    with pytest.raises(ValueError, match="cycle"):
        Problem.from_networkx(G, 10)


def test_json_round_trip(tmp_path):
    G = gen.transformer(2, seed=3, view_prob=0.5, nonrecomputable_prob=0.2)
    p = Problem.from_networkx(G, 1234)
    q = Problem.from_json(p.to_json())
    assert q.to_dict() == p.to_dict()
    assert q.names == p.names and q.preds == p.preds and q.budget == 1234
    assert np.array_equal(q.mem, p.mem) and np.array_equal(q.cost, p.cost)
    assert np.array_equal(q.alias_of, p.alias_of) and np.array_equal(q.recomputable, p.recomputable)
    p.save(tmp_path / "p.json")
    assert Problem.load(tmp_path / "p.json").to_dict() == p.to_dict()
    # Back to networkx and again: same problem.
    assert Problem.from_networkx(p.to_networkx(), 1234).to_dict() == p.to_dict()


def test_string_and_int_names_survive_json():
    G = graph({"x": (1, 0), 7: (2, 1.0)}, [("x", 7)])
    p = Problem.from_json(Problem.from_networkx(G, 5).to_json())
    assert p.names == ("x", 7)


def test_with_budget_shares_graph():
    p = Problem.from_networkx(gen.chain(5, seed=1), 10)
    q = p.with_budget(3)
    assert q.budget == 3 and q.preds is p.preds and p.budget == 10
