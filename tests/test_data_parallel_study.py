"""The DDP and FSDP2 study runs (so that it cannot rot between runs of it), and memplan inside DDP
meets a budget DDP's eager step does not. Timings are reported, never asserted."""
from __future__ import annotations

import pytest


def _rows(out) -> dict[str, str]:
    return {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.read_text().splitlines()
            if line.startswith("| DDP") or line.startswith("| FSDP2")}


@pytest.mark.slow
def test_the_study_runs_and_memplan_meets_a_budget_below_ddp_eager(tmp_path):
    from benchmarks.studies.data_parallel import main

    out = tmp_path / "data_parallel.md"
    main(["--size", "tiny", "--rounds", "1", "--shares", "100,65", "--engines", "DDP", "--out", str(out)])
    rows = _rows(out)
    assert rows["DDP eager"] == "100%"
    assert int(rows["DDP + memplan"].rstrip("%")) < 100
    # FSDP2's rows at the eager step's budget only (make test's time). The tiny GPT's step under FSDP2
    # is mostly parameters and optimizer state: memplan may find no plan at 100% here (said in the row).
    main(["--size", "tiny", "--rounds", "1", "--shares", "100", "--engines", "FSDP2", "--out", str(out)])
    rows = _rows(out)
    assert rows["FSDP2 eager"] == "100%"
    assert rows["FSDP2 + memplan"] in ("100%", "none of (100,)")


def test_the_table_has_a_row_per_method_and_says_what_was_not_met():
    from benchmarks.studies.data_parallel import SHARES, table

    text = table({"DDP": {"eager_peak": 1000, "DDP eager": (100, 1000, 1.0, 2.0), "DDP + memplan": (50, 480, 1.2, 1.5),
                          "DDP + checkpoint per block": None},
                  "FSDP2": {"eager_peak": 900, "FSDP2 eager": (100, 900, 1.0, None)}}, "tiny", 3, 12.0)
    assert "| DDP + memplan | 50% | 480 B | 1.20x | 1.50 |" in text
    assert f"| DDP + checkpoint per block | none of {SHARES} |" in text
    assert "| FSDP2 eager | 100% | 900 B | 1.00x | — |" in text
    assert "DDP eager 1,000 B, FSDP2 eager 900 B" in text
