"""Smoke test of the benchmark harness: one tiny model, one budget, --quick."""
from __future__ import annotations

import json

import pytest

from benchmarks.harness import cli
from benchmarks.harness.methods import ALIASES, DEFAULT_METHODS, MEMPLAN_COMPILED
from benchmarks.harness.readme import END, START, splice
from benchmarks.harness.report import COLUMNS

# The run compiles with Inductor (memplan compiled): minutes on a shared 2-core machine.
pytestmark = pytest.mark.timeout(600)

# Every default method but the Inductor peer, whose own compile would add about a minute to
# `make test`: the compiled rows' path through the harness is the same for both.
QUICK_METHODS = ("eager", "ckpt", "ckpt_seq", "memplan", "memplan_compiled")
# The MLP: every method's path through the harness in a fraction of the U-Net's compile and solve
# time (the run was the slowest setup of `make test`); the real tables come from the full runs.
MODEL = "mlp"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    readme = out / "PROJECT_README.md"
    readme.write_text("# project\n\nfirst lines\n")
    rc = cli.main(
        ["--quick", "--models", MODEL, "--budgets", "0.5", "--reps", "2", "--no-plots", "--methods", ",".join(QUICK_METHODS),
         "--out", str(out), "--update-readme", "--readme", str(readme)]
    )
    assert rc == 0
    return out, readme


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [ln for ln in markdown.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]


@pytest.mark.slow
def test_table_has_expected_columns(quick_run):
    out, _ = quick_run
    rows = _table_rows((out / f"{MODEL}.md").read_text())
    assert tuple(rows[0]) == COLUMNS
    methods = {r[1] for r in rows[2:]}
    # issue #28's rows, from the default selection
    assert methods == {ALIASES[m] for m in QUICK_METHODS} and methods <= set(DEFAULT_METHODS)
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
        lo, hi = c["ratio_spread"]
        assert lo <= c["time_ratio"] <= hi
        assert c["grads_ok"] is not None
    # the Markdown says the same thing
    for row in _table_rows((out / f"{MODEL}.md").read_text())[2:]:
        peak, met = row[3], row[5]
        if peak == "—":
            continue
        budget_mb = float(row[0].split("(")[1].split(" MB")[0])
        # the table rounds to 0.1 MB: only check claims that rounding cannot flip
        if abs(float(peak) - budget_mb) > 0.05:
            assert (met == "yes") == (float(peak) <= budget_mb), row


def test_compiled_rows_are_measured_by_the_profiler(quick_run):
    out, _ = quick_run
    model = json.loads((out / "results.json").read_text())["models"][0]
    assert model["eager_profiled_peak"] > 0
    ours = [c for c in model["cells"] if c["method"] == MEMPLAN_COMPILED]
    assert ours and any(c["peak"] is not None and c["compiled"] and c["compile_s"] > 0 for c in ours)
    for c in ours:
        # either measured as compiled code, or skipped with a note while optimize has no compile=
        assert c["compiled"] or (c["status"] in ("n/a", "infeasible", "error") and c["note"]), c


def test_readme_summary_between_markers(quick_run):
    out, readme = quick_run
    text = readme.read_text()
    assert text.startswith("# project\n\nfirst lines\n")
    inner = text[text.index(START) + len(START) : text.index(END)]
    assert f"| {MODEL} |" in inner  # the one summary table
    assert f"(./{MODEL}.md)" in inner and "(./README.md)" in inner  # links to the results files
    assert "time at 50%" not in inner  # the per-model tables stay in the results folder
    full = (out / "README.md").read_text()
    assert "| memplan compiled |" in full and "time at 50%" in full


def test_markdown_regenerates_from_results_json(quick_run, tmp_path):
    out, readme = quick_run
    regen_readme = tmp_path / "PROJECT_README.md"
    regen_readme.write_text("# project\n")
    regen = tmp_path / "results"
    rc = cli.main(["--from-results", str(out / "results.json"), "--out", str(regen), "--no-plots",
                   "--update-readme", "--readme", str(regen_readme)])
    assert rc == 0
    assert (regen / f"{MODEL}.md").read_text() == (out / f"{MODEL}.md").read_text()
    assert (regen / "README.md").read_text() == (out / "README.md").read_text()
    summary = lambda text: text[text.index(START) : text.index(END)]
    # the same summary; its links point at each run's own folder (here results/, there the README's own)
    assert summary(regen_readme.read_text()).replace("results/", "./") == summary(readme.read_text())


def test_splice_replaces_only_between_markers():
    text = f"head\n{START}\nold\n{END}\ntail\n"
    assert splice(text, "new") == f"head\n{START}\nnew\n{END}\ntail\n"


def test_memplan_compiled_is_skipped_with_a_note_while_optimize_refuses_compile(monkeypatch):
    """A memplan without the compiled runtime: the row says so instead of failing the run."""
    from types import SimpleNamespace

    from benchmarks.harness import methods

    def old_optimize(*args, **options):
        if "compile" in options:
            raise TypeError("unknown option(s) for memplan.optimize: compile")
        raise AssertionError("not reached")

    monkeypatch.setattr(methods.memplan, "optimize", old_optimize)
    mut = SimpleNamespace(step=None, args=(), kwargs={})
    cells = methods.memplan_compiled_cells(mut, [("50%", 100)], memplan_time_limit=1.0)
    assert [c.budget_label for c in cells] == ["50%", methods.OWN_MIN]
    assert all(c.status == "n/a" and c.candidate is None and "compile=" in c.note for c in cells)
