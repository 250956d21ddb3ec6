"""Smoke test of the benchmark harness: one tiny model, one budget, --quick."""
from __future__ import annotations

import json

import pytest

from benchmarks import cli
from benchmarks.readme import END, START, splice
from benchmarks.report import COLUMNS

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    readme = out / "PROJECT_README.md"
    readme.write_text("# project\n\nfirst lines\n")
    rc = cli.main(
        ["--quick", "--models", "unet", "--budgets", "0.5", "--reps", "2", "--no-plots",
         "--out", str(out), "--update-readme", "--readme", str(readme)]
    )
    assert rc == 0
    return out, readme


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


def test_table_has_expected_columns(quick_run):
    out, _ = quick_run
    rows = _table_rows((out / "unet.md").read_text())
    assert tuple(rows[0]) == COLUMNS
    methods = {r[1] for r in rows[2:]}
    assert {"eager", "checkpoint per block", "compile + act. budget", "memplan remat"} <= methods
    budgets = {r[0].split(" ")[0] for r in rows[2:]}
    assert budgets == {"50%", "own"}


def test_met_budget_claims_agree_with_measured_peaks(quick_run):
    out, _ = quick_run
    data = json.loads((out / "results.json").read_text())
    cells = data["models"][0]["cells"]
    assert cells
    for c in cells:
        if c["peak"] is None:
            assert c["met"] is None
            continue
        assert c["met"] == (c["peak"] <= c["budget"]), c
        assert c["time_ratio"] is not None and c["time_ratio"] > 0
        assert c["grads_ok"] is not None
    # the Markdown says the same thing
    for row in _table_rows((out / "unet.md").read_text())[2:]:
        peak, met = row[3], row[5]
        if peak == "—":
            continue
        budget_mb = float(row[0].split("(")[1].split(" MB")[0])
        # the table rounds to 0.1 MB: only check claims that rounding cannot flip
        if abs(float(peak) - budget_mb) > 0.05:
            assert (met == "yes") == (float(peak) <= budget_mb), row


def test_readme_summary_between_markers(quick_run):
    _, readme = quick_run
    text = readme.read_text()
    assert text.startswith("# project\n\nfirst lines\n")
    inner = text[text.index(START) + len(START) : text.index(END)]
    assert "| unet |" in inner


def test_splice_replaces_only_between_markers():
    text = f"head\n{START}\nold\n{END}\ntail\n"
    assert splice(text, "new") == f"head\n{START}\nnew\n{END}\ntail\n"
