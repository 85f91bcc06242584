"""Quantities for people."""

from __future__ import annotations


def gb(n: float) -> str:
    """Bytes for people: MB below 0.1 GB, GB below 1 TB, TB above (87.20 TB, not 87,198.75 GB)."""
    if n >= 1e12:
        return f"{n / 1e12:,.2f} TB"
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"
