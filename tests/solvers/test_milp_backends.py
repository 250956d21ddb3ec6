"""`solvers.methods.milp_backends`: the HiGHS build bundled with OR-Tools prints a debugging line to the
process's standard output whatever its settings; solves drop it and keep every other byte, from
Python or native code, in order."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from solvers.methods.milp_backends import BACKENDS, STRAY_PRINTS

CHILD = textwrap.dedent("""
    import ctypes, sys, time
    from solvers.methods.milp_backends import STRAY_PRINTS, _without_stray_prints
    libc = ctypes.CDLL(None)
    print("before", flush=True)
    with _without_stray_prints():
        print("python inside")  # buffered by Python: flushed on the way out
        libc.printf(b"native " + STRAY_PRINTS[0] + b"native after\\n")  # native code, as HiGHS prints
        # A full C buffer is written out whatever it ends with: a stray print cut in two.
        libc.printf(b"cut " + STRAY_PRINTS[0][:20])
        libc.fflush(None)
        time.sleep(0.3)  # the filter reads the first piece on its own
        libc.printf(STRAY_PRINTS[0][20:] + b"Highs, not stray\\n")
        libc.fflush(None)
        sys.stdout.flush()
    print("after", flush=True)
""")


def test_the_stray_print_goes_and_the_rest_stays_in_order():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, check=True, cwd=root).stdout
    assert STRAY_PRINTS[0] not in out
    assert out.splitlines() == [b"before", b"python inside", b"native native after", b"cut Highs, not stray", b"after"]


def test_a_highs_solve_still_answers_under_the_filter():
    b = BACKENDS["highs"]()
    x, y = b.bool_var(), b.bool_var()
    b.add([(x, 1.0), (y, 1.0)], 1.0, float("inf"))
    b.minimize([(x, 2.0), (y, 3.0)], 0.0)
    raw = b.solve(5.0, None)
    assert raw.status == "optimal" and raw.values[:2] == [1.0, 0.0] and abs(raw.objective - 2.0) < 1e-9
