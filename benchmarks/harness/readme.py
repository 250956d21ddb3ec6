"""Write the summary into README.md between ``<!-- bench:start -->`` and ``<!-- bench:end -->``.

Only the text between the markers is replaced. Without markers, a
"Benchmarks" section holding them is appended at the end. From a finished
run, without running anything again::

    python -m benchmarks --from-results benchmarks/results/results.json --update-readme
"""
from __future__ import annotations

from pathlib import Path

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"


def splice(text: str, block: str) -> str:
    """``text`` with the part between the markers replaced by ``block``."""
    body = f"{START}\n{block.strip()}\n{END}"
    i, j = text.find(START), text.find(END)
    if i != -1 and j > i:
        return text[:i] + body + text[j + len(END):]
    sep = "" if text.endswith("\n") else "\n"
    return f"{text}{sep}\n## Benchmarks\n\n{body}\n"


def update_readme(path: Path, block: str) -> None:
    path.write_text(splice(path.read_text(), block))
