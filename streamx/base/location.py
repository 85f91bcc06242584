"""Where a path lies: a local folder, or an object store (s3://, gs://, ... through fsspec).

One test for it, here: a plain path or a file:// URL is local (written durably, locked, its free space
checked); a path with any other scheme is an object store (durable once a PUT succeeds, no lock)."""

from __future__ import annotations

from pathlib import Path


def local_path(path: str) -> Path | None:
    """The local path that `path` names (a plain path, or a file:// URL), or None for an object store."""
    scheme, sep, rest = path.partition("://")
    if not sep:
        return Path(path)
    return Path(rest) if scheme == "file" else None


def zarr_path(path: str) -> str:
    """What zarr opens for `path`: the local path itself (so that zarr gives a LocalStore, which the shard
    reader and writer stream), or the object store's URL."""
    local = local_path(path)
    return str(local) if local is not None else path
