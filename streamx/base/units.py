"""Quantities for people."""

from __future__ import annotations


def gb(n: float) -> str:
    """Bytes for people: GB from 0.1 GB up, else MB."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"
