"""What a data file says of itself, for the commands that read it: its fingerprint (what a resume must find
unchanged, wherever the file has moved, checked before the run starts), the digests of its rows as a run reads them
(`RowDigests`: any edit, checked as a resume reads the rows again), and, for a file `streamx regenerate` wrote, the
record beside it (NAME.settings.json): the settings it was generated with, whether it is complete, and whose tokens
it holds."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

EDGE_BYTES = 1 << 20  # a file's fingerprint reads its first and last MiB
DIGEST_ROWS = 1024  # rows per digested window (RowDigests)


class DataChanged(ValueError):
    """A resume read rows that differ from those the store's rows were computed from."""


class _Numbered(Protocol):
    row_id: int


R = TypeVar("R", bound=_Numbered)


class RowDigests:
    """A digest of each window of DIGEST_ROWS consecutive source rows, over their bytes as the run reads them (a
    jsonl line, else the record as canonical JSON), taken as each row is read, skipped or not, so that it costs no
    extra read. A part's commit records the windows of the rows it commits ({first row: [rows read, digest]}, the
    rows read so far where the window is not yet read whole); a resume compares each window, once as many rows of it
    are read again, with every part's record of it (`recorded`, the parts' commit records' digests) and stops
    with DataChanged at the first that differs, before any row of that window is batched (`held`). Rows from
    `limit` on (--max-samples) are neither digested nor compared. Thread-safe: the producer reads, the committer
    records."""

    def __init__(self, recorded: Iterable[Mapping[str, list]] = (), limit: int | None = None, name: str = "the data"):
        self.limit, self.name = limit, name
        self.recorded: dict[int, dict[int, str]] = {}  # first row -> {rows: digest}, over every part's record
        for record in recorded:
            for first, (rows, digest) in record.items():
                self.recorded.setdefault(int(first), {})[int(rows)] = digest
        self._open: dict[int, tuple[int, Any]] = {}  # first row -> (rows read, hash so far): the window being read
        self._read: dict[int, tuple[int, str]] = {}  # first row -> (rows, digest): windows read before it
        self._lock = threading.Lock()

    def add(self, row_id: int, data: bytes) -> None:
        """Row `row_id`'s bytes, read (rows come in source order)."""
        if self.limit is not None and row_id >= self.limit:
            return
        first = row_id - row_id % DIGEST_ROWS
        with self._lock:
            if first not in self._open:  # a new window: those before it are read whole, keep their digests only
                for earlier, (rows, h) in self._open.items():
                    self._read[earlier] = (rows, h.hexdigest())
                self._open = {first: (0, hashlib.blake2b(digest_size=8))}
            rows, h = self._open[first]
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
            self._open[first] = (rows + 1, h)
            digest = h.hexdigest() if rows + 1 in self.recorded.get(first, ()) else None
        if digest is not None and digest != self.recorded[first][rows + 1]:
            raise DataChanged(
                f"{self.name} changed since the store's rows were computed from it: rows {first:,} to {row_id:,} "
                f"differ (the first changed window of {DIGEST_ROWS:,} rows); resume on the data the store was made "
                "from, or pass --overwrite to start over")

    def of(self, row_ids: Iterable[int]) -> dict[str, list]:
        """{first row: [rows read, digest]} of the windows that hold these rows, for a commit record."""
        firsts = {r - r % DIGEST_ROWS for r in row_ids}
        with self._lock:
            read = {w: self._read[w] if w in self._read else (self._open[w][0], self._open[w][1].hexdigest())
                    for w in firsts if w in self._read or w in self._open}
        return {str(w): list(state) for w, state in sorted(read.items())}

    def held(self, rows: Iterable[R]) -> Iterator[R]:
        """The rows, each held back while a record of its window is still to be compared (its rows are not all read
        yet), so that no row of a window that changed is batched (a sorting window smaller than a window of
        digests, or not aligned to one). A fresh run, or windows read whole, hold nothing. Rows still held when the
        data ends (or --max-samples cuts it) are of a window read shorter than every record of it, which cannot be
        compared: DataChanged, naming the --max-samples that would compare it."""
        pending: list[R] = []
        for row in rows:
            first = row.row_id - row.row_id % DIGEST_ROWS
            if pending and pending[-1].row_id < first:  # earlier windows are read whole: compared
                yield from pending
                pending = []
            pending.append(row)
            if not self._waiting(first):
                yield from pending
                pending = []
        last = pending[-1].row_id - pending[-1].row_id % DIGEST_ROWS if pending else None
        if last is not None and self._waiting(last):  # (read to its end, shorter than every record of it)
            raise DataChanged(self._cut_short(last))
        yield from pending  # (compared by the rows read after them, which another rank computes)

    def _cut_short(self, first: int) -> str:
        """Why the window at `first`, read shorter than every record of it, cannot be compared."""
        recorded = max(self.recorded[first])
        with self._lock:
            read = self._open[first][0] if first in self._open else self._read.get(first, (0, ""))[0]
        if self.limit is not None and first + read >= self.limit:
            return (f"--max-samples {self.limit:,} reads {read:,} of the {recorded:,} rows from row {first:,} that the "
                    f"store's record compares, so {self.name} cannot be compared with the rows the store was computed "
                    f"from: run with --max-samples {first + recorded:,} or more, or pass --overwrite to start over")
        return (f"{self.name} changed since the store's rows were computed from it: it has {read:,} rows from row "
                f"{first:,} where it had {recorded:,} (rows were removed); resume on the data the store was made from, "
                "or pass --overwrite to start over")

    def _waiting(self, first: int) -> bool:
        """Does a record of the window at `first` compare more rows than have been read of it?"""
        counts = self.recorded.get(first)
        if not counts:
            return False
        with self._lock:
            read = self._open[first][0] if first in self._open else self._read.get(first, (0, ""))[0]
        return max(counts) > read


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
    A copy or a move of the same bytes keeps it (no path, no mtime); an append, or an edit that changes the size or
    the first or last MiB, changes it: checked before a resume starts. An edit elsewhere is RowDigests' to see, as
    the resume reads the rows."""
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
