"""Byte counts for people: the one formatting every report, error message and table uses, and
the one reading of sizes people write (``16GB``, ``16GiB``, an int)."""
from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


def parse_bytes(size: int | str) -> int:
    """Bytes from ``16GB``, ``16GiB``, ``800MB``, ``1.5 TB`` (decimal and binary units) or a
    positive int; ValueError otherwise."""
    if isinstance(size, bool):
        raise ValueError(f"cannot read {size!r} as bytes")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"cannot read {size!r} as bytes: give a positive number")
        return size
    if isinstance(size, str):
        m = _SIZE_RE.match(size)
        if m:
            value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
            if value >= 1:
                return int(value)
    raise ValueError(f"cannot read {size!r} as bytes: give an int or a string such as '16GB' or '16GiB'")


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units with two decimals (``"1.50 GB"``, ``"12.00 kB"``), or ``"123 B"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
