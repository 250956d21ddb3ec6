"""Keep MILP solvers single-threaded in tests: the suite shares a small machine."""
import pytest

import solvers.checkmate


@pytest.fixture(autouse=True)
def _single_threaded_milp(monkeypatch):
    monkeypatch.setattr(solvers.checkmate, "THREADS", 1)
