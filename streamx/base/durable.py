"""Files that survive a power loss: a file's bytes reach the disk before its name does, and a name
before anything that counts on it.

A rename is atomic (a reader sees the old file or the whole new one), but not durable: after a power
loss or a kernel crash the renamed file can be there with no data in it, and a later rename (a commit
record) can reach the disk before an earlier one (the shard it covers). So every file a commit or a
completion marker names is written as the databases write theirs:

    write the bytes to a temporary name -> fsync the file -> rename it into place -> fsync the folder

and only then is the record that counts on it written, the same way. `DurableLocalStore` does this for
every key zarr writes (array shapes, index chunks, the commit attributes); the shard writer and
`convert` use `write_file` / `replace` for their own files. Object stores are durable when a PUT
succeeds: they need none of this.
"""

from __future__ import annotations

import asyncio
import os
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


def temporary(path: Path) -> Path:
    """A temporary name beside `path`, unique to this writer."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:8]}")


def write_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Write `path` through `write(tmp)`: absent or complete, after a crash too."""
    tmp = temporary(path)
    try:
        make_dirs(path.parent)
        write(tmp)
        fsync_file(tmp)
        replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class DurableLocalStore(LocalStore):
    """zarr's LocalStore with every write made durable before `set` returns (write_file): zarr.json
    documents, and chunks and shards written through zarr."""

    async def set(self, key: str, value: Buffer) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        data = memoryview(value.as_numpy_array()).cast("B")
        await asyncio.to_thread(write_file, self.root / key, lambda tmp: tmp.write_bytes(data))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)
