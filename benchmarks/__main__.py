"""``python -m benchmarks`` (= ``make bench``); see :mod:`benchmarks.cli`."""
from benchmarks.cli import main

raise SystemExit(main())
