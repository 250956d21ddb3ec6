"""The host-overhead study runs (so that it cannot rot between runs of it), and its table says
what memplan's whole step costs in optimizer calls. Timings are reported, never asserted."""
from __future__ import annotations

import pytest


@pytest.mark.slow
def test_the_study_runs_and_updates_in_backward_in_fewer_calls_than_parameters(tmp_path):
    pytest.importorskip("transformers")
    from benchmarks.studies.host_overhead import main

    out = tmp_path / "host_overhead.md"
    main(["--rounds", "1", "--reps", "1", "--out", str(out)])
    text = out.read_text()
    assert "store-all (forward + backward)" in text
    calls = {line.split("|")[1].strip(): (int(line.split("|")[2]), int(line.split("|")[3]))
             for line in text.splitlines() if line.startswith("| in backward") or line.startswith("| after backward")}
    assert calls and all(n_calls < n_params for n_calls, n_params in calls.values()), calls


def test_the_ratio_of_each_round_is_the_median_candidate_over_the_median_baseline():
    from benchmarks.studies.host_overhead import _median_ratios

    calls = {"fn": 0, "base": 0}

    def counted(key):
        def run() -> None:
            calls[key] += 1
        return run

    results = _median_ratios({"row": (counted("fn"), counted("base"))}, rounds=3, reps=2)
    median, low, high = results["row"]
    assert low <= median <= high and median > 0
    assert calls == {"fn": 3 + 3 * 2, "base": 3 + 3 * 2}  # 3 warm-up calls, then rounds x reps each
