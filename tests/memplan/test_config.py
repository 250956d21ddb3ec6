"""memplan's tunables: one module (`memplan.core.config`), one way for a test to change them."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from memplan.core.config import TUNABLES, Tunables, override

ROOT = Path(__file__).resolve().parents[2]


def test_override_sets_inside_the_block_and_restores_after_even_on_error():
    before = TUNABLES.slower_margin
    with pytest.raises(RuntimeError):
        with override(slower_margin=2.0, min_run_ops=7):
            assert (TUNABLES.slower_margin, TUNABLES.min_run_ops) == (2.0, 7)
            raise RuntimeError
    assert TUNABLES.slower_margin == before and TUNABLES.min_run_ops == Tunables().min_run_ops


def test_an_unknown_tunable_is_refused_by_name():
    with pytest.raises(TypeError, match="no tunable slower_margn"):
        with override(slower_margn=2.0):
            pass


def test_every_tunable_has_a_docstring():
    source = (ROOT / "memplan" / "core" / "config.py").read_text()
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Tunables").body
    documented = {prev.target.id for prev, nxt in zip(body, body[1:])
                  if isinstance(prev, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)}
    assert documented == {f.name for f in dataclasses.fields(Tunables)}


def test_no_test_monkeypatches_a_constant_of_memplan():
    """Tests change tunables through `override`; a module constant patched by name would be a
    second way, and one that code reading `TUNABLES` never sees."""
    patched = re.compile(r"monkeypatch\.setattr\(\s*memplan[\w.]*,\s*[\"'][A-Z][A-Z0-9_]+[\"']")
    found = [f"{path.relative_to(ROOT)}" for path in (ROOT / "tests").rglob("*.py") if patched.search(path.read_text())]
    assert not found, f"tests patching a memplan constant instead of using override: {found}"


def test_the_default_time_limit_grows_with_the_graph_and_a_chosen_one_does_not():
    """Without a ``time_limit`` the planning call's clock (`PlanningClock`) gives a joint graph
    `default_time_limit`, and `default_seconds_per_op` more per ATen op beyond `default_free_ops`; a
    limit the caller chose is kept whatever the graph. The clock is injected (its start 200 s ago):
    nothing here waits."""
    import time

    from memplan.pipeline.clock import PlanningClock

    started = time.perf_counter() - 200.0
    default = PlanningClock.begin(None, started)
    assert default.limit == TUNABLES.default_time_limit and default.gap == TUNABLES.default_gap
    assert default.sized_to(TUNABLES.default_free_ops).limit == TUNABLES.default_time_limit
    big = default.sized_to(TUNABLES.default_free_ops + 6_000)
    assert big.limit == pytest.approx(TUNABLES.default_time_limit + 6_000 * TUNABLES.default_seconds_per_op)
    assert big.spent()
    assert big.solve_limit() == TUNABLES.min_solve_time  # spent: the solver still gets its minimum
    chosen = PlanningClock.begin(300.0, started)
    assert chosen.sized_to(10_000).limit == 300.0 and not chosen.spent() and chosen.gap is None
    assert chosen.solve_limit() == pytest.approx(100.0, abs=1.0)
