"""What a data file says of itself, for the commands that read it: its fingerprint (what a resume must find
unchanged, wherever the file has moved), and, for a file `streamx regenerate` wrote, the record beside it
(NAME.settings.json): the settings it was generated with, whether it is complete, and whose tokens it holds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

EDGE_BYTES = 1 << 20  # a file's fingerprint reads its first and last MiB


def settings_file(path: Path) -> Path:
    """The record `streamx regenerate` keeps beside its output `path`."""
    return path.with_name(path.name + ".settings.json")


def regenerated(data: str) -> dict[str, Any] | None:
    """The record beside `data` when streamx regenerate wrote it (a local file), else None."""
    path = Path(data)
    record = settings_file(path)
    if not path.is_file() or not record.is_file():
        return None
    try:
        return json.loads(record.read_text())
    except ValueError:
        return None


def fingerprint(data: str) -> str:
    """A local file's size and a hash of its first and last MiB; a local folder's (a save_to_disk dataset) file
    names and sizes; "" for what is not local (a hub dataset, the embedded corpus), which is then not compared.
    A copy or a move of the same bytes keeps it (no path, no mtime); an edit or an append changes it."""
    path = Path(data)
    h = hashlib.sha256()
    if path.is_file():
        size = path.stat().st_size
        with open(path, "rb") as f:
            h.update(f.read(EDGE_BYTES))
            if size > EDGE_BYTES:
                f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                h.update(f.read(EDGE_BYTES))
        return f"file:{size}:{h.hexdigest()[:32]}"
    if path.is_dir():
        files = sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())
        h.update(json.dumps(files).encode())
        return f"folder:{len(files)}:{h.hexdigest()[:32]}"
    return ""
