"""``python -m benchmarks`` (= ``make bench``); see :mod:`benchmarks.harness.cli`."""
from benchmarks.harness.cli import main

raise SystemExit(main())
