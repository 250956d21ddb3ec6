"""benchmarks/studies/cuda_check.py, the device script of issue #48, kept from rotting between GPU runs.

Its dry run (``--device cpu --size tiny``) runs every part at toy sizes on the CPU; an error there is
the script's own (an API it calls that changed, a row that no longer builds), as nothing it measures
is a finding. Nothing here asserts on times.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.harness.device_rows import markdown
from benchmarks.studies import cuda_check

ROOT = Path(__file__).resolve().parents[1]


def _parts(results: dict) -> dict[str, dict]:
    return {k: v for k, v in results.items() if k in cuda_check.PARTS}


def test_a_run_out_of_time_records_every_part_as_skipped(tmp_path):
    threads = torch.get_num_threads()
    try:  # the deadline counts from the module's import: long past
        cuda_check.main(["--device", "cpu", "--size", "tiny", "--deadline", "0", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "cuda.json").read_text())
    parts = _parts(results)
    assert list(parts) == list(cuda_check.PARTS)
    assert all(part["skipped"].startswith("deadline") for part in parts.values())
    md = (tmp_path / "cuda.md").read_text()
    assert all(cuda_check.TITLES[key] in md for key in parts)


def test_the_tables_show_every_figure_a_row_has():
    row = {"method": "memplan 50%", "key": "memplan", "budget": 10**6, "predicted": 990_000,
           "measured": [1_100_000], "reserved": [1_200_000], "grad_error": 0.5, "optimizer_calls": [3, 3],
           "time_ratio": 1.5, "step_ms": 2.0, "spread": [1.4, 1.6], "predicted_time_ratio": 1.2, "time_error": 0.3}
    results = {"device": "a GPU", "torch": "x", "wall_s": 1.0,
               "activations_gpt": {"model": "gpt", "rows": [row, {"method": "eager", "error": "Traceback\nBoom: no"}]}}
    md = markdown(results, cuda_check.TITLES)
    line = next(ln for ln in md.splitlines() if ln.startswith("| memplan 50%"))
    for cell in ("1.00 MB", "0.99 MB", "1.10 MB (over by 10.0%)", "1.20 MB (over by 20.0%)", "5.0e-01", "3 / 3",
                 "1.50x (2.00 ms)", "1.40-1.60", "1.20x", "0.30"):
        assert cell in line, (cell, line)
    assert "error: Boom: no" in md


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_dry_run_runs_every_part_without_an_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.cuda_check", "--device", "cpu", "--size", "tiny",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "cuda.md").is_file()
    results = json.loads((tmp_path / "cuda.json").read_text())
    parts = _parts(results)
    assert list(parts) == list(cuda_check.PARTS)
    for key, part in parts.items():
        assert not part.get("error") and not part.get("cut_off"), (key, part.get("error") or part.get("cut_off"))
        assert part.get("rows") or part.get("skipped"), key
        for row in part.get("rows", []):
            assert not row.get("error"), (key, row["method"], row["error"])
            assert row.get("skipped") or "time_ratio" in row, (key, row)
            if row.get("budget") and not row.get("skipped") and "memplan" in row["method"]:
                assert row["measured"] and row["reserved"] == [None] * len(row["measured"]), (key, row)
                assert "grad_error" in row or "param_error_after_3" in row, (key, row)
    # the whole step's rows count the optimizer's calls; the planned ones predict their step time
    planned = [r for r in parts["whole_step"]["rows"] if "optimizer_calls" in r and r["method"] != "eager loop"]
    assert planned and all(r["predicted_time_ratio"] is not None and "time_error" in r for r in planned)
    md = (tmp_path / "cuda.md").read_text()
    assert all(cuda_check.TITLES[key] in md for key in parts)
