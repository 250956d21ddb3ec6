"""`make test-fast` (``-m "not slow"``) keeps a test of every test file."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _marked_slow(decorators: list[ast.expr]) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def test_every_test_file_has_a_test_in_the_fast_tier():
    without = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        whole_file_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                              and "mark.slow" in ast.unparse(n.value) for n in tree.body)
        fast = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
                and not _marked_slow(n.decorator_list)]
        if whole_file_slow or not fast:
            without.append(str(path.relative_to(TESTS)))
    assert not without, f"no test of these files runs in make test-fast: {without}"


def test_the_files_make_test_runs_first_exist():
    """`tests/conftest.py` orders the files it names first: a name left behind by a rename would
    quietly send that file back to pytest's order."""
    from tests.conftest import LONGEST_FIRST

    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    assert not missing and len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), missing
