"""The host-overhead study runs (so that it cannot rot between runs of it), and its table says
what memplan's whole step costs in optimizer calls. Timings are reported, never asserted."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_study_runs_and_updates_in_backward_in_fewer_calls_than_parameters(tmp_path):
    from benchmarks.studies.host_overhead import main

    out = tmp_path / "host_overhead.md"
    main(["--rounds", "1", "--reps", "1", "--out", str(out)])
    text = out.read_text()
    assert "store-all (forward + backward)" in text
    calls = {line.split("|")[1].strip(): (int(line.split("|")[2]), int(line.split("|")[3]))
             for line in text.splitlines() if line.startswith("| in backward") or line.startswith("| after backward")}
    assert calls and all(n_calls < n_params for n_calls, n_params in calls.values()), calls
