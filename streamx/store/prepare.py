"""A store as a run finds and opens it: what is at --out, creating or reopening the store (refusing an
incompatible one), and the part each process writes.

A run reads its output twice: once while it plans (`Output.read`: the commit records alone, for the
banner, the output check and the free-space check), and once when it opens the store for writing
(`prepare` on rank 0, then `open_for_run` on every rank: the sample index, for the rows to skip).
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import zarr
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

from ..base import durable
from ..base.durable import TEMPORARY, DurableLocalStore
from ..base.location import local_path, zarr_path
from ..base.locks import Lock, is_lock, lock_file
from .format import (
    PARTS,
    SAME_AS_ARRAYS,
    Commit,
    Compat,
    Layout,
    StoreError,
    StoreMetadata,
    committed_parts,
    create_part,
    part_is_complete,
)
from .reader import DoneKeys, RowSet, Store


def _writable(path: str) -> str | DurableLocalStore:
    """What zarr writes a store through: a local one durably (streamx.base.durable), an object store as it is."""
    local = local_path(path)
    return path if local is None else DurableLocalStore(local)


def _open_group(path: str, mode: str) -> zarr.Group | None:
    """The streamx store's root group at `path`, or None when there is none."""
    try:
        root = zarr.open_group(zarr_path(path) if mode == "r" else _writable(path), mode=mode)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, ValueError, KeyError):
        return None
    return root if "streamx" in root.attrs else None


def part_commits(root: zarr.Group) -> dict[str, Commit]:
    """Each part's commit record, read afresh."""
    return {name: Commit.from_json(part.attrs["commit"]) for name, part in committed_parts(root)[0].items()}


@dataclass(frozen=True)
class Output:
    """What is at a run's --out before it starts: nothing, a store (its parts' commit records), or other files."""

    path: str
    is_store: bool
    commits: tuple[Commit, ...] = ()
    compat: dict[str, Any] = field(default_factory=dict)  # the store's compat record (Compat)

    @classmethod
    def read(cls, path: str) -> Output:
        root = _open_group(path, "r")
        if root is None:
            return cls(path, False)
        return cls(path, True, tuple(part_commits(root).values()), dict(root.attrs["streamx"].get("compat", {})))

    @classmethod
    def checked(cls, path: str, overwrite: bool = False) -> Output:
        """`read`, then `check`. Where the check finds files but no store, another process (a task of a job array
        started in the same instant) may be making one: a store's place holds nothing but what `_being_made`
        passes until its root is marked made (`_create`), so a second read after the check sees that store."""
        output = cls.read(path)
        try:
            output.check(overwrite)
        except StoreError:
            output = cls.read(path)
            output.check(overwrite)  # a store made meanwhile passes; anything else is refused as before
        return output

    @property
    def committed_rows(self) -> int:
        """Rows some part has committed, as a sample or a reject."""
        return sum(c.samples + c.rejects for c in self.commits)

    def state(self, overwrite: bool = False) -> str:
        """What a run will do with it, in words: a new store, a replaced one, or a resumed one."""
        if not self.is_store:
            return "new store"
        if overwrite:
            return "existing store, replaced (--overwrite)"
        samples = sum(c.samples for c in self.commits)
        return f"resuming: {samples:,} samples already committed in {len(self.commits)} part(s)"

    def check(self, overwrite: bool = False) -> None:
        """Fail early (before a model is loaded) when the path cannot become or continue a store: a place this
        process may not write, or a folder or object-store prefix that holds anything but a streamx store.
        --overwrite replaces a store, never other files (a home folder, a bucket's other data)."""
        target = local_path(self.path)
        if target is not None:
            _check_location(target)
        if not self.is_store and _holds_anything(self.path):
            raise StoreError(f"{self.path} exists and is not a streamx store; choose an empty or new --out "
                             "(--overwrite replaces only a streamx store)")


def _holds_anything(path: str) -> bool:
    """Whether the local folder, or the object-store prefix, at `path` holds any file but what a store being
    made holds: locks, the temporary files of durable writes (another rank making the store: its zarr.json is
    on its way), and its `parts` group alone, written before the root (`_create`)."""
    fs, root = fsspec.core.url_to_fs(path)
    return any(not _being_made(fs, name) for name in _listing(fs, root))


def _being_made(fs: fsspec.AbstractFileSystem, name: str) -> bool:
    """Whether `name`, in a store's place, is what a store being made holds (`_holds_anything`)."""
    base = posixpath.basename(name.rstrip("/"))
    if base == PARTS:  # the group alone: its zarr.json (or that on its way)
        members = [posixpath.basename(member) for member in _listing(fs, name)]
        return all(member == "zarr.json" or fnmatch.fnmatch(member, TEMPORARY) for member in members)
    return is_lock(base) or fnmatch.fnmatch(base, TEMPORARY)


def _listing(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    try:
        return fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []


def _check_location(path: Path) -> None:
    """A local store's path is, or can become, a folder this process may write."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise StoreError(f"cannot write the store at {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK):
        raise StoreError(f"cannot write the store at {path}: {existing} is not writable")


def prepare(path: str, metadata: StoreMetadata, overwrite: bool = False) -> zarr.Group:
    """Create the store, or check that an existing one may be resumed by this run (its compat record
    matches) and refresh its metadata but for its creation time and compat record; returns its root group.
    Under torchrun rank 0 calls this before any rank opens a part; independent processes (a job array) may
    each call it at once: the store is marked made in one write that fails where another process has just
    made it, which is then opened instead, and nothing but --overwrite deletes anything."""
    root = None if overwrite else _open_group(path, "r+")
    if root is None:
        made = Output.checked(path, overwrite).is_store and not overwrite  # by another process since that read
        root = _open_group(path, "r+") if made else None
    if root is None:
        try:
            return _create(path, metadata, overwrite)
        except zarr.errors.ContainsGroupError:  # another process created it meanwhile
            root = _open_group(path, "r+")
        except OSError as err:
            raise StoreError(f"cannot write the store at {path}: {err.strerror or err}") from None
        if root is None:
            raise StoreError(f"{path} holds a Zarr group that is not a streamx store; choose another --out")
    _check_compatible(root, path, metadata)
    theirs = root.attrs["streamx"]
    # the compat record stays the store's: this run's matches it, the data by its fingerprint where both have one
    # (the same bytes at another path), and the convert folders made from the store name it (train.backend)
    root.attrs["streamx"] = {**metadata.to_json(), "created": theirs.get("created", metadata.created),
                             "compat": theirs["compat"]}
    return root


def _create(path: str, metadata: StoreMetadata, overwrite: bool) -> zarr.Group:
    """Make the store in two writes: its `parts` group, then the root's zarr.json, whose `streamx` attribute
    marks it made, so that a store marked made has its parts (what a kill between the two leaves, the `parts`
    group alone, is no stray file to `Output.check`). --overwrite empties it first."""
    local = local_path(path)
    if local is not None:
        durable.make_dirs(local.parent)
    if overwrite:  # a lock inside the store stays (base.durable); zarr >= 3.2's mode "w" deletes nothing
        store = _writable(path)
        sync((FsspecStore.from_url(store) if isinstance(store, str) else store).delete_dir(""))
    try:
        zarr.open_group(_writable(f"{path.rstrip('/')}/{PARTS}"), mode="a")
    except zarr.errors.ContainsGroupError:  # another process made it meanwhile (ranks of a job array, at once)
        pass
    return zarr.create_group(_writable(path), attributes={"streamx": metadata.to_json()})


def _check_compatible(root: zarr.Group, path: str, metadata: StoreMetadata) -> None:
    check_compatible(root.attrs["streamx"].get("compat", {}), path, metadata.compat)


def check_compatible(theirs: dict[str, Any], path: str, compat: Compat, unknown: Collection[str] = ()) -> None:
    """Refuse to resume the store at `path`, whose compat record is `theirs`, with a run of `compat` (`unknown`:
    fields not compared, as before the model loads), naming each difference."""
    differences = compat.differences(theirs, unknown)
    if differences:
        # e.g. a hybrid model's store from before its linear-attention layers could pack
        setting = differences[0].split(":")[0]
        resume = f", --{setting} {theirs.get(setting, 'off').split(':')[0].replace('rows', 'on')} to resume it" \
            if setting in ("packing", "sharing") and len(differences) == 1 else ""
        raise StoreError(f"{path} was written by an incompatible run ({'; '.join(differences)}); pass --overwrite "
                         f"to start over{resume}, or choose another --out")


@dataclass
class RunStore:
    """A prepared store opened by one writer process (a torchrun rank): the source rows some part has
    already committed, as a sample or a reject, which the run must skip, and their content keys. The process's
    own part is `OwnedPart.open`'s."""

    root: zarr.Group
    done_rows: RowSet
    done_keys: DoneKeys | None  # the done rows' content keys (None: a part from before streamx recorded them)
    same_as: bool  # every committed part records the row a repeated row reads (format /4): repeats need no compute
    data_digests: list[dict[str, list]]  # each part's record of the source windows it read (data.provenance)

    def totals(self) -> tuple[int, int]:
        """(samples, tokens) of the whole store as its commit records stand now (every part, read afresh)."""
        commits = part_commits(self.root)
        return sum(c.samples for c in commits.values()), sum(c.samples_tokens for c in commits.values())


def open_for_run(path: str, metadata: StoreMetadata, root: zarr.Group | None = None) -> RunStore:
    """Open a prepared store for writing (`root`: the group `prepare` returned, in the process that called
    it), after checking that this run may resume it."""
    if root is None:
        root = zarr.open_group(_writable(path), mode="r+")
        _check_compatible(root, path, metadata)
    store = Store(path, root)
    return RunStore(root, store.done_row_ids(), store.done_keys(),
                    all(name in part for part in store.parts.values() for name in SAME_AS_ARRAYS),
                    [c.data_digests for c in store.commits.values()])


class OwnedPart:
    """The part of the store at `path` that this process writes, and everything that makes it this process's
    alone: the lock, taken at once (streamx.base.locks; before a run loads its model) and held until `release`;
    then the part itself, opened once the store is prepared, with a killed writer's temporary files removed,
    created when new. Object stores have no lock: one writer per part is the launcher's to keep."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name
        local = local_path(path)
        if local is not None:
            _check_location(local)
        self.lock = Lock(lock_file(local, name), f"{name} of {path}") if local is not None else None

    def open(self, target: RunStore, layout: Layout) -> zarr.Group:
        """The part, created when new. Under torchrun, call it only once every rank has read `done_rows`: a
        part being created is not yet readable."""
        parts = target.root.require_group(PARTS)
        if self.name in parts and not part_is_complete(parts[self.name]):  # left half-created by a killed writer
            del parts[self.name]
        store = target.root.store
        if self.name in parts and isinstance(store, LocalStore):  # a killed writer's temporary files
            durable.remove_temporaries(Path(store.root) / PARTS / self.name)
        return parts[self.name] if self.name in parts else create_part(target.root, self.name, layout)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> OwnedPart:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
