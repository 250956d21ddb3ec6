"""Byte counts for people: the one formatting every report, error message and table uses."""
from __future__ import annotations


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units with two decimals (``"1.50 GB"``, ``"12.00 kB"``), or ``"123 B"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
