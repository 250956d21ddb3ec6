"""notebooks/tour.ipynb runs top to bottom (so it cannot rot) and draws every plot it promises."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "tour.ipynb"


def test_tour_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure
    seconds = time.perf_counter() - start

    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    images = sum(1 for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
    assert images == 4  # memory over time, R/S matrices, per-module bars, budget curve
    text = "".join(o.get("text", "") for c in code for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "memplan plan" in text and "rejected:" in text and "same schedule: True" in text
    print(f"tour.ipynb executed in {seconds:.1f} s")
