"""The command line the zoo-model studies share: which models, at what size and share of eager's peak,
for how many timed rounds, and where the table goes."""
from __future__ import annotations

import argparse
from pathlib import Path


def zoo_arguments(doc: str, models: str, fraction: float, rounds: int, out: Path) -> argparse.ArgumentParser:
    """The options of a study that plans zoo models at a share of eager's peak and times rounds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=models)
    parser.add_argument("--size", default="small")
    parser.add_argument("--fraction", type=float, default=fraction)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--time-limit", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=out)
    return parser
