"""The lower bound, computed in a child process while the search runs on.

`hierarchical.solve_hierarchical` spends its time limit searching and then
reports `lower_bounds.lower_bound`, which is mostly HiGHS time. Run at the
end, the bound gets a tenth of the limit; on a second core it can have
nearly all of it while the search keeps the first core.

Why a child interpreter and not a thread or `multiprocessing`:

* two HiGHS instances solving at once in one process have crashed
  (ERGO-Code/HiGHS#3141), and the bound's Python (moments, model building)
  would hold the GIL against the search;
* `multiprocessing`'s spawn re-imports the caller's ``__main__`` (a training
  script without a ``__name__`` guard would run again), and fork copies a
  process that may hold torch's threads.

The child is given a deadline on the wall clock, not a duration: the time
its interpreter takes to start and import `solvers` (0.6-1 s) comes out of
its limit, whatever it was, and it bounds for all the rest.

The child reads the problem from a temporary file and prints each bound it
proves as it goes (`lower_bound`'s ``progress``), so that a child stopped at
the deadline still gives the best one so far. Anything that goes wrong (the
child cannot start, fails, or has proved nothing yet) gives None, and the
caller computes the bound itself as before.

    python -m solvers.strategies.background PROBLEM.json DEADLINE   (a `time.time()` instant)
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Optional

from ..core.problem import Problem

# The child yields to the search (and to anything else) where cores are short: the bound is worth
# less than the plan.
CHILD_NICENESS = 10


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class BackgroundBound:
    """`lower_bounds.lower_bound(problem, ...)` running in a child process, until ``time_limit``
    seconds from now (its own start included)."""

    def __init__(self, problem: Problem, time_limit: float) -> None:
        deadline = time.time() + float(time_limit)
        self._dir = tempfile.TemporaryDirectory(prefix="memplan-bound-")
        path = Path(self._dir.name) / "problem.json"
        problem.save(path)
        env = dict(os.environ)
        # The child must import this copy of `solvers`, installed or not.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "solvers.strategies.background", str(path), repr(deadline)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env, text=True)
        # Every line the child has printed so far, read by a thread so that the search can ask for
        # the bound proved so far (`proved`) without waiting: it stops once its plan is close to it.
        self._lines: list[str] = []
        self._reader = threading.Thread(target=_read_lines, args=(self._proc.stdout, self._lines), daemon=True)
        self._reader.start()
        # A caller that fails before `result` must not leave the child running or the file behind.
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._dir)

    @classmethod
    def start(cls, problem: Problem, time_limit: float) -> Optional["BackgroundBound"]:
        """The child computing the bound, or None when it cannot be started."""
        try:
            return cls(problem, time_limit)
        except OSError:
            return None

    def result(self, until: float) -> Optional[float]:
        """The child's bound, waiting for it until ``until`` (a `time.perf_counter` instant): when
        the child is not done by then, the best bound it has printed so far (every one it prints
        is valid); None when it printed none. The child is gone afterwards."""
        try:
            self._proc.wait(timeout=max(0.0, until - time.perf_counter()))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join()  # the pipe is closed once the child is gone: every line is in
        self.close()
        return self.proved()

    def proved(self) -> Optional[float]:
        """The best bound the child has printed so far (None: none yet), without waiting."""
        return best_printed("".join(self._lines))

    def close(self) -> None:
        """Stop the child (if it still runs) and remove its file."""
        self._finalizer()


def _read_lines(stream, lines: list[str]) -> None:
    """Append each line of ``stream`` to ``lines`` as it arrives, until the stream ends (the last
    one may be cut short by a kill: `best_printed` reads whole lines only); then close it."""
    with stream:
        for line in stream:
            lines.append(line)


def best_printed(out: str) -> Optional[float]:
    """The largest bound in the child's output ``out``, read from whole lines only: a number cut
    short by the kill may read as another (``1.2e-05`` as ``1.2``)."""
    values = []
    for line in out.split("\n")[:-1]:  # the part after the last newline is not whole
        try:
            values.append(float(line))
        except ValueError:
            continue
    values = [v for v in values if not math.isnan(v)]
    return max(values) if values else None


def _stop(proc: subprocess.Popen, directory: tempfile.TemporaryDirectory) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()  # the reader thread then sees the pipe end and closes it
    directory.cleanup()


def main(argv: list[str]) -> None:
    from ..methods.lower_bounds import lower_bound

    if hasattr(os, "nice"):
        os.nice(CHILD_NICENESS)
    problem = Problem.load(argv[0])

    def report(value: float) -> None:
        print(repr(float(value)), flush=True)

    report(lower_bound(problem, max(0.0, float(argv[1]) - time.time()), progress=report))


if __name__ == "__main__":
    main(sys.argv[1:])
