"""The inductor_gap study's allocator mode (`benchmarks.studies.inductor_gap.keep_freed_memory`): freed
memory kept mapped, so reallocating it takes no page faults. The study is the subject here, so the
child process imports it from the repository root."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # where `benchmarks` is importable

_REALLOCATE = """
import resource, torch
{setup}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    torch.empty(10 << 20).fill_(1.0)  # 40 MiB: over glibc's largest mmap threshold, so mapped apart
counts = []
for _ in range(8):
    before = faults()
    torch.empty(10 << 20).fill_(1.0)
    counts.append(faults() - before)
print(min(counts))  # the fewest: the kernel may fault a page now and then for its own reasons
"""


def _faults_per_reallocation(setup: str) -> float:
    done = subprocess.run([sys.executable, "-c", _REALLOCATE.format(setup=setup)], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keeping_freed_memory_spares_the_page_faults_of_reallocating_it():
    default = _faults_per_reallocation("")
    kept = _faults_per_reallocation("from benchmarks.studies.inductor_gap import keep_freed_memory; keep_freed_memory()")
    print(f"minor faults of a 40 MiB reallocation (fewest of 8): {default} with glibc's defaults, {kept} kept")
    assert default > 5000  # each 4 KiB page of the fresh mapping faults once (10240 pages)
    assert kept < 100
