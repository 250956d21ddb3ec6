"""The order `make test` hands test files to its workers: the longest first.

`make test` runs each file on one worker (``--dist loadfile``) and the workers take files in
collection order (``--no-loadscope-reorder``; xdist's own order is by number of tests, which put
files of a few long tests, such as the compiled plans', last and left one worker running them
while the other had finished). Longest first, the last files to start are short ones, and the two
workers end close together. Only the order changes: a file not named here runs after these, in
pytest's order, and the tests of a file keep theirs.
"""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Files by the time their tests took in a clean-clone `make test` (2 cores, December 2026), longest first.
LONGEST_FIRST = [
    "memplan/test_compiled.py",
    "memplan/test_fully_shard.py",
    "memplan/test_data_parallel.py",
    "memplan/test_dropped_logits.py",
    "memplan/test_optimizer_step.py",
    "memplan/test_cli.py",
    "memplan/test_offload.py",
    "solvers/test_lower_bounds.py",
    "solvers/test_exact.py",
    "memplan/test_dynamo.py",
    "test_readme.py",
    "memplan/test_optimizer_placement.py",
    "test_cuda_check.py",
    "memplan/test_dynamo_hf.py",
    "memplan/test_paging.py",
]


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item) -> int:
        try:
            return rank.get(item.path.relative_to(TESTS).as_posix(), len(rank))
        except ValueError:  # (a test outside tests/)
            return len(rank)

    items.sort(key=order)  # (stable: each file's tests keep their order)
