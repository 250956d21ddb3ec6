"""Keep MILP solvers single-threaded in tests: the suite shares a small machine."""
import pytest

import solvers.methods.checkmate


@pytest.fixture(autouse=True)
def _single_threaded_milp(monkeypatch):
    monkeypatch.setattr(solvers.methods.checkmate, "THREADS", 1)
