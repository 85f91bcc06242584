"""Files that survive a power loss: a file's bytes reach the disk before its name does, and a name
before anything that counts on it.

A rename is atomic (a reader sees the old file or the whole new one), but not durable: after a power
loss or a kernel crash the renamed file can be there with no data in it, and a later rename (a commit
record) can reach the disk before an earlier one (the shard it covers). So every file a commit or a
completion marker names is written as the databases write theirs:

    write the bytes to a temporary name -> fsync the file -> rename it into place -> fsync the folder

and only then is the record that counts on it written, the same way. A new folder is made durable in
its parent the same way (`make_dirs`). This module owns all of it: the one temporary-name scheme
(`temporary`), the removal of a killed writer's temporary files (`remove_temporaries`), folder creation,
`write_file` / `replace` for streamx's own files, and `DurableLocalStore`, zarr's local store with every
write so. Object stores are durable when a PUT succeeds: they need none of this.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zarr.core.buffer import Buffer
from zarr.storage import LocalStore


def fsync_file(path: Path) -> None:
    """The file's data and size on disk (an fsync through any descriptor flushes the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """The folder's entries on disk: the names created, renamed or removed in it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """mkdir -p, each new folder's name made durable in its parent."""
    new = []
    while not path.exists():
        new.append(path)
        path = path.parent
    for folder in reversed(new):
        folder.mkdir(exist_ok=True)
        fsync_dir(folder.parent)


def replace(tmp: Path, target: Path) -> None:
    """Rename a complete, fsynced file into place, durably."""
    make_dirs(target.parent)
    os.replace(tmp, target)
    fsync_dir(target.parent)


TEMPORARY = ".*.tmp-*"  # every temporary name `temporary` gives, as a glob
KEPT = ".streamx-lock"  # what clearing a folder never removes: names that begin so are locks inside it (base.locks)


def temporary(path: Path) -> Path:
    """A temporary name beside `path`, unique to this writer: hidden, so that zarr lists no stray member."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:8]}")


def remove_temporaries(folder: Path) -> None:
    """Remove the temporary files a killed writer left in `folder` and below it (only its one writer may call
    this: a live writer's temporary file would go too)."""
    for stale in folder.rglob(TEMPORARY):
        stale.unlink(missing_ok=True)


def write_file(path: Path, write: Callable[[Path], Any], exclusive: bool = False) -> None:
    """Write `path` through `write(tmp)`: absent or complete, after a crash too. `exclusive`: only where `path`
    is not there yet (FileExistsError otherwise), decided atomically."""
    tmp = temporary(path)
    try:
        make_dirs(path.parent)
        write(tmp)
        fsync_file(tmp)
        if exclusive:
            os.link(tmp, path)  # fails if the name exists; the folder's fsync below makes it durable
            fsync_dir(path.parent)
        else:
            replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class DurableLocalStore(LocalStore):
    """zarr's LocalStore with every write made durable before it returns (write_file): zarr.json documents,
    and chunks and shards written through zarr, by every path zarr writes through (`set`, `set_if_not_exists`
    and batched sets go through `_set`; the sync API through `set_sync`), and its root folder made durable
    in its parent when zarr creates it (zarr 3.1 to 3.4 open a store by any of `_open`, `_ensure_open` and
    `_ensure_open_sync`)."""

    def _open_durably(self) -> None:
        if not self._is_open:
            if not self.read_only:
                make_dirs(self.root)
            if not self.root.exists():
                raise FileNotFoundError(f"{self.root} does not exist")
            self._is_open = True

    async def _open(self, *args: Any, **kwargs: Any) -> None:
        if not self.read_only:
            await asyncio.to_thread(make_dirs, self.root)
        return await super()._open(*args, **kwargs)

    async def _ensure_open(self) -> None:
        await asyncio.to_thread(self._open_durably)

    def _ensure_open_sync(self) -> None:
        self._open_durably()

    async def clear(self) -> None:
        self._check_writable()
        await asyncio.to_thread(_clear, self.root)

    async def delete_dir(self, prefix: str) -> None:  # --overwrite empties the root this way (store.prepare)
        if prefix.strip("/"):
            return await super().delete_dir(prefix)
        await self.clear()

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        await asyncio.to_thread(self._open_durably)
        self._check_writable()
        await asyncio.to_thread(_write_buffer, self.root / key, value, exclusive)

    async def set(self, key: str, value: Buffer) -> None:
        await self._set(key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        try:
            await self._set(key, value, exclusive=True)
        except FileExistsError:
            pass

    def set_sync(self, key: str, value: Buffer) -> None:
        self._open_durably()
        self._check_writable()
        _write_buffer(self.root / key, value, False)


def _clear(root: Path) -> None:
    """Empty the folder (--overwrite), a lock inside it excepted (base.locks)."""
    make_dirs(root)
    for path in root.iterdir():
        if path.name.startswith(KEPT):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    fsync_dir(root)


def _write_buffer(path: Path, value: Buffer, exclusive: bool) -> None:
    data = memoryview(value.as_numpy_array()).cast("B")
    write_file(path, lambda tmp: tmp.write_bytes(data), exclusive)
