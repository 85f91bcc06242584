"""Free space on a store's filesystem, and the guard that stops a run before it fills up."""

from __future__ import annotations

import shutil

from ..base.location import local_path
from ..base.units import gb
from .format import TOKEN_ID_ARRAYS, Layout, StoreError, entry_bytes


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem that holds (or will hold) `path`; None for object stores and filesystems
    that report no size (some FUSE mounts say 0 of 0: not full, unknown)."""
    local = local_path(path)
    if local is None:
        return None
    target = local.expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    usage = shutil.disk_usage(existing)
    return usage.free if usage.total else None


class SpaceGuard:
    """Stops a run cleanly before its filesystem fills up: checked after each shard's commit. The
    reserve covers the shards in flight and leaves room for the commit records."""

    def __init__(self, path: str, reserve: int):
        self.path, self.reserve = path, reserve

    @classmethod
    def for_layout(cls, path: str, layout: Layout) -> SpaceGuard:
        """Room for two shards (one being written, one being put in place) and 64 MiB of records."""
        token_bytes = layout.bytes_per_token + entry_bytes(TOKEN_ID_ARRAYS)
        return cls(path, 2 * layout.shard_tokens * token_bytes + (64 << 20))

    def check(self) -> None:
        free = free_bytes(self.path)
        if free is not None and free < self.reserve:
            raise StoreError(f"stopped: {gb(free)} left on the filesystem of {self.path}, under the {gb(self.reserve)} "
                             "reserve; everything written so far is committed: free space and re-run the same "
                             "command to resume")
