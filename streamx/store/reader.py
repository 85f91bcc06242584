"""How to read a store: `open_store(path)`, then samples by source row id, counts, rejects, metadata.

    store = open_store("out.zarr")
    store.sample(row_id)          the sample of one source row
    store.row_ids()               the committed source rows, ascending
    store.at(i), store.index      position i of the sample index (store order: part by part, as written)

Only what the commit records name is read; the arrays' shapes mean nothing to a reader.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import zarr

from .. import __version__
from ..base.location import local_path, zarr_path
from ..base.units import gb
from .format import (
    CONTENT_KEY_ARRAYS,
    DIGEST_ARRAY,
    READABLE_FORMATS,
    ROW_MASK_ARRAYS,
    SHARING_ARRAYS,
    Audited,
    Commit,
    SharedKinds,
    StoreError,
    StoreMetadata,
    committed_parts,
)
from .shards import ChunkCache, ShardFiles, streamable_dir


@dataclass
class StoredSample:
    row_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T]
    hidden_states: torch.Tensor  # bfloat16 [T, K, H], slots in ascending layer id (raw fp8: float8_e4m3fn)
    hidden_states_scales: torch.Tensor | None = None  # raw fp8 reads only: float32 [T]


@dataclass(frozen=True)
class SampleIndex:
    """Where every committed sample lies, in store order."""

    rows: np.ndarray  # source row id of each sample
    parts: np.ndarray  # its part's number (in Store.parts order)
    offsets: np.ndarray  # its first token in that part
    lengths: np.ndarray
    range_starts: np.ndarray  # where its ranges start in its part's range table (with --sharing)
    range_counts: np.ndarray  # 0: its tokens are `lengths` tokens from `offsets`; else its ranges
    mask_offsets: np.ndarray  # -1: its loss mask is the stored tokens'; else where its own is in row_loss_mask


class RowSet(Collection[int]):
    """Source row ids as a bitmap, one byte per row up to the largest: what a resume skips, without the
    Python object per row a set would hold (~60 MB at a million rows, 1 MB here)."""

    def __init__(self, rows: np.ndarray):
        self.bits = np.zeros(int(rows.max()) + 1 if rows.size else 0, dtype=bool)
        self.bits[rows] = True
        self.count = int(self.bits.sum())

    def __contains__(self, row: object) -> bool:
        return isinstance(row, (int, np.integer)) and 0 <= row < self.bits.size and bool(self.bits[row])

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self.bits).tolist())


@dataclass(frozen=True)
class DoneKeys:
    """The content keys of a store's committed rows (samples and rejects), by row id: what a resume needs of
    the rows it does not read again (RunPlan.batch_stream)."""

    rows: np.ndarray  # int64, ascending, each once
    keys: np.ndarray  # uint64, the key of each (0: none)
    digests: np.ndarray  # uint64 [n, 2], the tokens_digest of each sample (0: a reject, or not recorded)
    differing: np.ndarray  # int64, ascending: rows stored as repeats whose tokens proved not their first row's

    def in_whole_windows(self, sort_window: int, num_rows: int | None) -> Callable[[int], bool]:
        """A predicate: does a row lie in a sorting window whose every row is committed (`num_rows`: the
        source's rows, for the size of its last window)."""
        counts = np.bincount(self.rows // sort_window) if self.rows.size else np.zeros(0, dtype=np.int64)
        expected = np.full(counts.size, sort_window)
        if num_rows is not None and counts.size and (num_rows - 1) // sort_window == counts.size - 1:
            expected[-1] = num_rows - (counts.size - 1) * sort_window
        whole = counts >= expected
        return lambda row: row // sort_window < whole.size and bool(whole[row // sort_window])

    def __len__(self) -> int:
        return self.rows.size

    def between(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """The committed rows a..b-1 and their keys."""
        i, j = np.searchsorted(self.rows, [a, b])
        return self.rows[i:j], self.keys[i:j]

    def digest(self, row: int) -> bytes | None:
        """The tokens_digest committed for `row`, or None (not committed, a reject, or not recorded)."""
        i = int(np.searchsorted(self.rows, row))
        if i == self.rows.size or self.rows[i] != row or not self.digests[i].any():
            return None
        return self.digests[i].astype("<u8").tobytes()

    def differs(self, row: int) -> bool:
        """Whether `row` was stored as a repeat of a row whose tokens proved not to be its own."""
        i = int(np.searchsorted(self.differing, row))
        return i < self.differing.size and self.differing[i] == row


@dataclass(frozen=True)
class Completeness:
    """Whether a store holds every row of its data: each part closed by a run that reached the end of its share,
    and every source row a sample or a reject in some part."""

    open_parts: list[str]  # interrupted (killed, or stopped by a signal) and not yet resumed to the end
    half_made: list[str]  # left half-created by a killed run: nothing in them is committed
    source_rows: int | None  # the data's rows, as the closing runs recorded them (None: no part closed yet)
    missing_rows: np.ndarray  # rows of the data in no part, ascending

    @property
    def complete(self) -> bool:
        return self.source_rows is not None and not (self.open_parts or self.half_made or self.missing_rows.size)

    def problems(self) -> list[str]:
        """One line per reason it is not complete."""
        out = [f"part {name} is open: its run was interrupted before the end of its rows" for name in self.open_parts]
        out += [f"part {name} was left half-created by a killed run" for name in self.half_made]
        if self.missing_rows.size:
            shown = ", ".join(str(int(r)) for r in self.missing_rows[:10])
            more = f" and {self.missing_rows.size - 10:,} more" if self.missing_rows.size > 10 else ""
            out.append(f"{self.missing_rows.size:,} of the data's {self.source_rows:,} rows are in no part: "
                       f"rows {shown}{more}")
        if self.source_rows is None and not (self.open_parts or self.half_made):
            out.append("no part has been written yet")
        return out


class Store:
    """Read API over a store: samples by source row, counts, rejects, metadata."""

    def __init__(self, path: str, root: zarr.Group | None = None):
        if root is None:
            local = local_path(path)
            if local is not None and not local.exists():
                raise StoreError(f"{path} does not exist")
            try:
                root = zarr.open_group(zarr_path(path), mode="r")
            except (FileNotFoundError, zarr.errors.GroupNotFoundError):
                raise StoreError(f"{path} is not a streamx store") from None
        if "streamx" not in root.attrs:
            raise StoreError(f"{path} is not a streamx store")
        self.root, self.path = root, path
        record = dict(root.attrs["streamx"])
        if record.get("format") not in READABLE_FORMATS:
            raise StoreError(f"{path} has store format {record.get('format')!r}, which this streamx {__version__} "
                             f"cannot read ({', '.join(READABLE_FORMATS)}); upgrade streamx")
        self.metadata = StoreMetadata.from_json(record)
        self.storage = self.metadata.layout.storage
        self.parts, self.incomplete_parts = committed_parts(root)
        self.commits = {name: Commit.from_json(part.attrs["commit"]) for name, part in self.parts.items()}
        columns: dict[str, list[np.ndarray]] = {name: [] for name in ("rows", "parts", "offsets", "lengths",
                                                                    "range_starts", "range_counts", "mask_offsets")}
        tables: list[np.ndarray] = []  # per part: [G, 2] (offset, length) of the shared rows' ranges
        same_as: list[np.ndarray] = []  # per part: the row each repeated row reads (-1: none; format /4)
        digests: list[np.ndarray] = []  # per part: [n, 2] tokens digests (zeros: not recorded; format /5)
        for i, (name, part) in enumerate(self.parts.items()):
            commit = self.commits[name]
            n = commit.samples
            columns["rows"].append(part["sample_row_id"][:n])
            columns["parts"].append(np.full(n, i))
            columns["offsets"].append(part["sample_offset"][:n])
            columns["lengths"].append(part["sample_length"][:n])
            shares = all(array in part for array in SHARING_ARRAYS)  # parts from before --sharing: contiguous
            columns["range_starts"].append(part["sample_range_start"][:n] if shares else np.zeros(n, dtype=np.int64))
            columns["range_counts"].append(part["sample_range_count"][:n] if shares else np.zeros(n, dtype=np.int64))
            columns["mask_offsets"].append(part["sample_mask_offset"][:n] if shares else np.full(n, -1))
            same_as.append(part["sample_same_as"][:n] if "sample_same_as" in part else np.full(n, -1))
            digests.append(part[DIGEST_ARRAY][:n] if DIGEST_ARRAY in part else np.zeros((n, 2), dtype=np.uint64))
            tables.append(np.stack([part["range_offset"][: commit.ranges], part["range_length"][: commit.ranges]],
                                   axis=1).astype(np.int64) if commit.ranges else np.zeros((0, 2), dtype=np.int64))
        committed = SampleIndex(*(np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, dtype=np.int64)
                                  for xs in columns.values()))
        self._digests = np.concatenate(digests).astype(np.uint64) if digests else np.zeros((0, 2), dtype=np.uint64)
        self.index, self.same_as, self.repeated = resolve_same_as(
            committed, np.concatenate(same_as).astype(np.int64) if same_as else np.zeros(0, dtype=np.int64),
            self._digests)
        # every committed sample, in part order (as the key arrays), but for the repeats that are not their first
        # row: not done, so that the next run computes them
        self._done = ~np.isin(np.arange(committed.rows.size), self.repeated.differing_at)
        self._committed_rows = committed.rows[self._done]
        self._by_row = np.argsort(self.index.rows, kind="stable")
        # the parts' range tables as one, and where each part's starts in it
        self._range_table = np.concatenate([np.zeros((0, 2), dtype=np.int64), *tables])
        self._range_table_starts = np.cumsum([0, *(len(t) for t in tables)])[:-1].astype(np.int64)
        self._part_list = list(self.parts.values())
        self._ranges: dict[tuple[int, str], Callable[[int, int], np.ndarray]] = {}

    @property
    def layer_ids(self) -> list[int]:
        return list(self.metadata.layer_ids)

    def __len__(self) -> int:
        return int(self.index.rows.size)

    @property
    def num_tokens(self) -> int:
        """Tokens stored: with --sharing, each token that rows share once."""
        return sum(c.tokens for c in self.commits.values())

    @property
    def row_tokens(self) -> int:
        """The samples' tokens, as if nothing were shared."""
        return sum(c.samples_tokens for c in self.commits.values())

    def row_ids(self) -> np.ndarray:
        """Committed source rows, ascending."""
        return self.index.rows[self._by_row]

    @property
    def waiting_rows(self) -> int:
        """Committed rows that repeat a row no part has committed yet (another rank's, still running): not samples
        until it lands, then read as its sample."""
        rejected = [part["reject_row_id"][: self.commits[name].rejects] for name, part in self.parts.items()]
        return int((~np.isin(self.repeated.unread_same_as, np.concatenate([np.zeros(0, dtype=np.int64),
                                                                           *rejected]))).sum())

    def sample(self, row_id: int, raw: bool = False, slots: Sequence[int] | None = None) -> StoredSample:
        """The sample of source row `row_id`. Its states are bf16; with `raw`, an fp8 store's are the stored
        float8_e4m3fn values with their float32 scales in `hidden_states_scales`; `slots` picks the slots
        returned (positions in layer_ids), all by default."""
        return self.at(self.position(row_id), raw, slots)

    def position(self, row_id: int) -> int:
        """Where the sample of source row `row_id` is in `index`."""
        pos = np.searchsorted(self.index.rows, row_id, sorter=self._by_row)
        if pos >= len(self) or self.index.rows[self._by_row[pos]] != row_id:
            raise KeyError(f"source row {row_id} is not in the store")
        return int(self._by_row[pos])

    def at(self, position: int, raw: bool = False, slots: Sequence[int] | None = None) -> StoredSample:
        """The sample at `position` of `index` (store order); `raw` and `slots` as for `sample`."""
        input_ids, loss_mask = self.tokens_at(position)
        hidden, scales = self.states_at(position, raw, slots)
        return StoredSample(row_id=int(self.index.rows[position]), input_ids=input_ids, loss_mask=loss_mask,
                            hidden_states=hidden, hidden_states_scales=scales)

    def states_at(self, position: int, raw: bool = False, slots: Sequence[int] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states of the sample at `position` alone, and with `raw` an fp8 store's scales (else None);
        `raw` and `slots` as for `sample`."""
        bits = self.read_tokens(position, "hidden_states")
        if slots is not None and list(slots) != list(range(bits.shape[1])):  # a subset or another order: a copy
            bits = bits[:, list(slots)]
        scales = self.read_tokens(position, "hidden_states_scales") if self.storage.scaled else None
        if raw:
            return self.storage.from_bits(bits), None if scales is None else torch.from_numpy(scales)
        return self.storage.decode(bits, scales), None

    def tokens_at(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ids and loss mask (int64) of the sample at `position`, without its states."""
        ids = self.read_tokens(position, "input_ids")
        return torch.from_numpy(ids), torch.from_numpy(self.loss_mask_at(position).astype(np.int64))

    def loss_mask_at(self, position: int) -> np.ndarray:
        """The loss mask of the sample at `position`, as stored (uint8)."""
        at = int(self.index.mask_offsets[position])
        if at < 0:
            return self.read_tokens(position, "loss_mask")
        # its own mask: the stored tokens' is the union of the masks of the rows that share them
        return self._read(int(self.index.parts[position]), "row_loss_mask", at, at + int(self.index.lengths[position]))

    def ranges(self, position: int) -> list[tuple[int, int]]:
        """Where the sample at `position` lies in its part's token arrays: (first token, end) of each of its
        ranges, in order (one, unless it shares tokens with other rows: --sharing)."""
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} out of range for a store of {len(self)} samples")
        count = int(self.index.range_counts[position])
        if count == 0:
            a = int(self.index.offsets[position])
            return [(a, a + int(self.index.lengths[position]))]
        start = int(self._range_table_starts[int(self.index.parts[position])] + self.index.range_starts[position])
        return [(int(a), int(a + n)) for a, n in self._range_table[start : start + count]]

    def spans(self, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`ranges` of many samples at once, flat and in order: for each range, the sample it belongs to (its
        index in `positions`; all samples by default), its first token in its part and its length."""
        idx = self.index
        positions = np.arange(len(self)) if positions is None else np.asarray(positions, dtype=np.int64)
        counts = np.maximum(idx.range_counts[positions], 1)
        owner = np.repeat(np.arange(positions.size), counts)
        at = positions[owner]
        tabled = idx.range_counts[at] > 0
        row = np.where(tabled, self._range_table_starts[idx.parts[at]] + idx.range_starts[at]
                       + np.arange(owner.size) - (np.cumsum(counts) - counts)[owner], 0)
        table = self._range_table if self._range_table.size else np.zeros((1, 2), dtype=np.int64)
        return (owner, np.where(tabled, table[row, 0], idx.offsets[at]),
                np.where(tabled, table[row, 1], idx.lengths[at]))

    def shared_kinds(self) -> SharedKinds:
        """What the samples share, by kind, read from where their ranges lie (docs/store.md "Shared tokens"). Every
        range starts at a computed segment's first token, so ranges at one place nest: a row is a duplicate when
        an earlier row ends at the same token, a prefix row when a longer row reads past its last token, and
        the other rows' tokens beyond the segments they read (each counted once) were shared in leading runs."""
        idx = self.index
        sample, offsets, lengths = self.spans()
        last = np.cumsum(np.maximum(idx.range_counts, 1)) - 1  # each sample's last range in the flat arrays
        places, place = np.unique(idx.parts[sample] << 40 | offsets, return_inverse=True)
        longest = np.zeros(places.size, dtype=np.int64)
        np.maximum.at(longest, place, lengths)
        not_last = np.ones(sample.size, dtype=bool)
        not_last[last] = False
        read_past = np.zeros(places.size, dtype=bool)  # a row reads the whole range there, then goes on
        read_past[place[not_last & (lengths == longest[place])]] = True
        end_place, end_length = place[last], lengths[last]
        _, firsts = np.unique(end_place << 24 | end_length, return_index=True)  # rows ending at one token are equal
        duplicate = np.ones(len(self), dtype=bool)
        duplicate[firsts] = False
        prefix = ~duplicate & ((end_length < longest[end_place]) | read_past[end_place])
        leaves = ~duplicate & ~prefix
        return SharedKinds(int(duplicate.sum()), int(idx.lengths[duplicate].sum()), int(prefix.sum()),
                           int(idx.lengths[prefix].sum()), int(idx.lengths[leaves].sum() - longest.sum()))

    def read_tokens(self, position: int, name: str) -> np.ndarray:
        """One token array's values over the sample at `position`: a view of the shard files where its tokens
        lie in one range of one shard, else joined."""
        spans = self.ranges(position)
        part = int(self.index.parts[position])
        pieces = [self._read(part, name, a, b) for a, b in spans]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _read(self, part: int, name: str, a: int, b: int) -> np.ndarray:
        """Tokens a..b of one of a part's token arrays: straight from the shard files where the layout allows
        (store.shards.ShardFiles), else through zarr."""
        key = (part, name)
        if key not in self._ranges:
            arr = self._part_list[part][name]
            if name in ROW_MASK_ARRAYS:  # compressed, one short read per row
                self._ranges[key] = ChunkCache(arr).read
            elif streamable_dir(arr):
                self._ranges[key] = ShardFiles(arr).read
            else:
                self._ranges[key] = lambda a, b, arr=arr: arr[a:b]
        return self._ranges[key](a, b)

    def samples(self, raw: bool = False) -> Iterator[StoredSample]:
        """Every committed sample, in store order."""
        for position in range(len(self)):
            yield self.at(position, raw)

    def rejected(self) -> list[tuple[int, str]]:
        """The committed rejects (row, reason), and the repeated rows whose first row was rejected, with its reason."""
        reasons = self.metadata.reject_reasons
        out = []
        for name, part in self.parts.items():
            n = self.commits[name].rejects
            out += [(int(r), reasons[int(c)]) for r, c in zip(part["reject_row_id"][:n], part["reject_reason"][:n],
                                                                           strict=True)]
        if self.repeated.unread.size:
            first = dict(out)
            out += [(int(r), first[int(t)]) for r, t in zip(self.repeated.unread, self.repeated.unread_same_as,
                                                            strict=True) if int(t) in first]
        return out

    def done_keys(self) -> DoneKeys | None:
        """The committed rows' content keys, or None when a part was written before streamx recorded them."""
        if not all(name in part for part in self.parts.values() for name in CONTENT_KEY_ARRAYS):
            return None
        sample_keys = np.concatenate([part["sample_content_key"][: self.commits[name].samples]
                                      for name, part in self.parts.items()] or [np.zeros(0)])
        rows, keys, digests = [self._committed_rows], [sample_keys[self._done]], [self._digests[self._done]]
        for name, part in self.parts.items():
            n = self.commits[name].rejects
            rows.append(part["reject_row_id"][:n])
            keys.append(part["reject_content_key"][:n])
            digests.append(np.zeros((n, 2), dtype=np.uint64))
        rows, keys = np.concatenate(rows), np.concatenate(keys).astype(np.uint64)
        unique, first = np.unique(rows, return_index=True)
        return DoneKeys(unique, keys[first], np.concatenate(digests)[first], np.unique(self.repeated.differing))

    def done_row_ids(self) -> RowSet:
        """Rows a resumed run must not process again: committed samples and committed rejects."""
        rejects = [part["reject_row_id"][: self.commits[name].rejects] for name, part in self.parts.items()]
        return RowSet(np.concatenate([self._committed_rows, *rejects]))

    def completeness(self) -> Completeness:
        """Which parts are still open and which of the data's rows no part holds (`convert` refuses a store that
        is not complete, `verify` fails it). Parts closed before streamx recorded the data's rows count up to
        the last row they hold."""
        recorded = [c.source_rows for c in self.commits.values() if c.closed and c.source_rows is not None]
        done = self.done_row_ids().bits
        closed = any(c.closed for c in self.commits.values())
        source_rows = max(recorded) if recorded else (done.size if closed else None)
        expected = np.ones(source_rows or 0, dtype=bool)
        expected[: min(done.size, expected.size)] &= ~done[: expected.size]
        return Completeness([name for name, c in self.commits.items() if not c.closed], list(self.incomplete_parts),
                            source_rows, np.flatnonzero(expected))

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        examples: dict[str, str] = {}
        for c in self.commits.values():
            for reason, n in c.reject_counts.items():
                counts[reason] = counts.get(reason, 0) + n
            examples.update({k: v for k, v in c.reject_examples.items() if k not in examples})
        if self.repeated.unread.size:  # repeated rows whose first row was rejected are rejects too
            for row, reason in self.rejected()[sum(c.rejects for c in self.commits.values()):]:
                counts[reason] = counts.get(reason, 0) + 1
                examples.setdefault(reason, f"row {row}: repeats a rejected row")
        return {
            "path": self.path,
            "samples": len(self),
            "waiting_rows": self.waiting_rows,  # committed, and samples once the rows they repeat land
            "tokens": self.row_tokens,  # the samples' (as if nothing were shared)
            "stored_tokens": self.num_tokens,
            "shared": asdict(self.shared_kinds()),  # row tokens not stored again, by kind of sharing
            "trainable_tokens": sum(c.trainable_tokens for c in self.commits.values()),
            "duplicate_content_kept": sum(c.duplicates for c in self.commits.values()),  # samples repeating a row
            **self._cut(),
            "rejected": sum(counts.values()),
            "reject_counts": counts,
            "reject_examples": examples,
            "duplicate_rows": int(self.index.rows.size - np.unique(self.index.rows).size),
            "hidden_state_bytes": self.num_tokens * self.metadata.bytes_per_token,
            "incomplete_parts": self.incomplete_parts,  # no commit record yet: nothing in them is committed
            "parts": {name: {"samples": c.samples, "tokens": c.tokens, "rejects": c.rejects, "closed": c.closed}
                      for name, c in self.commits.items()},
            "metadata": self.metadata.to_json(),
        }

    def _cut(self) -> dict[str, int | None]:
        """Samples cut at --max-length and their tokens past it, over the parts that counted them (None: none did,
        a store from before streamx 0.8.2)."""
        counted = [c for c in self.commits.values() if c.cut_rows is not None]
        return {"cut_rows": sum(c.cut_rows for c in counted) if counted else None,
                "cut_tokens": sum(c.cut_tokens or 0 for c in counted) if counted else None}

    def cut_of(self, row_id: int) -> int | None:
        """Source row `row_id`'s tokens past --max-length, cut there and not stored (None: its part did not record
        it, a part from before streamx 0.8.2)."""
        self.position(row_id)  # (a KeyError where it is no sample)
        for name, part in self.parts.items():  # its own entry: a repeat's index points at the row it reads
            entries = np.flatnonzero(part["sample_row_id"][: self.commits[name].samples] == row_id)
            if entries.size:
                return int(part["sample_cut"][int(entries[-1])]) if "sample_cut" in part else None
        return None

    def audit(self) -> Audited | None:
        """What the in-run audit of the runs that wrote the store did, over all its parts (None: no run audited:
        --audit-every 0, --tp, or a store from before streamx audited its runs)."""
        found = None
        for commit in self.commits.values():
            if commit.audit:
                found = Audited.from_json(commit.audit) if found is None else found.merged(commit.audit)
        if found is not None:  # (merged keeps a part's latest run's; across parts they add up)
            found.to_heal = [span for c in self.commits.values() for span in (c.audit or {}).get("to_heal") or []] \
                or None
        return found

    def _cut_phrase(self, summary: dict[str, Any]) -> str:
        """The data line's word on rows cut at --max-length."""
        if summary["cut_rows"] is None:
            return "; rows cut there not counted (a store from before streamx 0.8.2)"
        if not summary["cut_rows"]:
            return "; no row was longer"
        return (f"; {summary['cut_rows']:,} rows were longer and cut there: {summary['cut_tokens']:,} tokens past it "
                f"not stored ({summary['cut_tokens'] / max(1, summary['tokens'] + summary['cut_tokens']):.1%} of "
                "their data's tokens)")

    def describe(self) -> list[str]:
        """What `streamx inspect` prints: model, layers, counts, sizes, reject reasons, parts."""
        summary, meta = self.summary(), self.metadata
        model = meta.model
        random = "; RANDOM WEIGHTS (--random-weights)" if meta.random_weights else ""
        scales = " (+ a float32 scale per token)" if self.storage.scaled else ""
        fanout = next((c.fanout for c in self.commits.values() if c.fanout), None)  # (data.fanout)
        audit = self.audit()
        lines = [
            f"store        {summary['path']} ({meta.format})",
            f"model        {model.get('model', '?')} ({model.get('architecture', '?')}, {meta.num_layers} layers, "
            f"{model.get('residual') or f'hidden {meta.hidden_size}'}, computed in {model.get('dtype', '?')}; weights "
            f"{model.get('weights_fingerprint', '?')[:12]}{random})",
            f"layer ids    {meta.layer_ids} ({meta.layer_convention}: id {meta.num_layers} = last layer before the "
            "final norm)",
            f"data         {meta.compat.data} (split {meta.compat.split}), max_length {meta.max_length} "
            f"({meta.truncation}){self._cut_phrase(summary)}",
            f"samples      {summary['samples']:,} committed, {summary['rejected']:,} rejected"
            + (f"; {summary['waiting_rows']:,} more committed rows repeat rows not committed yet (samples once those "
               "land)" if summary["waiting_rows"] else "")
            + (f", {summary['duplicate_rows']} DUPLICATE rows" if summary["duplicate_rows"] else "")
            + (f"; {summary['duplicate_content_kept']:,} samples repeat an earlier row's content (streamx run "
               "--skip-duplicates leaves them out)" if summary["duplicate_content_kept"] else ""),
            f"tokens       {summary['tokens']:,} ({summary['trainable_tokens']:,} trainable, "
            f"{summary['trainable_tokens'] / max(1, summary['tokens']):.1%})",
            f"sharing      {meta.sharing}: {self.row_tokens:,} row tokens computed and stored as {self.num_tokens:,} "
            f"({self.num_tokens / max(1, self.row_tokens):.1%}" + (
                f"; shared: {SharedKinds(**summary['shared']).phrase(self.row_tokens)}"
                if self.num_tokens != self.row_tokens else "") + "); rows read whole",
            *([f"fan-out      {fanout}"] if fanout else []),
            *([f"audit        {audit.phrase()}"] if audit is not None else []),
            "lengths      " + ("no samples" if not len(self) else ", ".join(
                f"{name} {int(v):,}" for name, v in zip(("min", "median", "p90", "p99", "max"), np.percentile(
                    self.index.lengths, [0, 50, 90, 99, 100], method="lower"), strict=True)) + " tokens"),
            f"size         {gb(summary['hidden_state_bytes'])} of {meta.storage} hidden states{scales}, "
            f"{meta.bytes_per_token:,} bytes/token, chunks {meta.chunk_tokens} tokens, shards {meta.shard_tokens} "
            f"tokens, compressor {meta.compressor}",
        ]
        for reason, n in sorted(summary["reject_counts"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  rejected {n:>6,} {reason}  (e.g. {summary['reject_examples'].get(reason, '')})")
        for name, part in summary["parts"].items():
            state = "complete" if part["closed"] else "interrupted (re-run the same command to resume)"
            lines.append(f"part         {name}: {part['samples']:,} samples, {part['tokens']:,} tokens, {state}")
        for name in self.incomplete_parts:
            lines.append(f"part         {name}: being created, or left half-created by a killed run (nothing in it "
                         "is committed; re-run the same command to resume)")
        state = self.completeness()
        problems = state.problems()
        lines.append(f"complete     yes: all {state.source_rows:,} rows of the data" if state.complete else
                     f"complete     NO: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
                     + "; convert refuses it without --allow-partial")
        return lines


@dataclass(frozen=True)
class Repeated:
    """What resolving the repeated rows (format /4) found beside the index."""

    unread: np.ndarray  # repeated rows whose first row is not a sample here: rejected, or not yet committed
    unread_same_as: np.ndarray  # the row each of them repeats
    differing: np.ndarray  # repeated rows whose tokens are not their first row's (a content-key collision)
    differing_same_as: np.ndarray  # the row each of them named
    differing_at: np.ndarray  # where they are among the committed samples (part order)


def resolve_same_as(committed: SampleIndex, same_as: np.ndarray, digests: np.ndarray,
                    ) -> tuple[SampleIndex, np.ndarray, Repeated]:
    """The index in which each repeated row (format /4: `same_as` names the first row with its content) reads that
    row's sample wherever it lies, its entry that sample's; the `same_as` of the entries kept; and what else it
    found: the repeated rows left out, whose first row is not a sample here, and those whose tokens are not
    that row's (another length, or another tokens digest where both were recorded, `digests`: format /5),
    which read nothing and are not in the index."""
    repeats = np.flatnonzero(same_as >= 0)
    none = np.zeros(0, dtype=np.int64)
    if not repeats.size:
        return committed, same_as, Repeated(none, none, none, none, none)
    firsts = np.flatnonzero(same_as < 0)
    by_row = firsts[np.argsort(committed.rows[firsts], kind="stable")]
    at = np.minimum(np.searchsorted(committed.rows[by_row], same_as[repeats]), max(by_row.size - 1, 0))
    found = (committed.rows[by_row[at]] == same_as[repeats]) if by_row.size else np.zeros(repeats.size, dtype=bool)
    read, first = repeats[found], by_row[at[found]]
    columns = {name: getattr(committed, name).copy() for name in SampleIndex.__dataclass_fields__}
    for name, values in columns.items():
        if name != "rows":
            values[read] = values[first]
    recorded = digests[read].any(axis=1) & digests[first].any(axis=1)
    differ = (committed.lengths[read] != committed.lengths[first]) | \
        (recorded & (digests[read] != digests[first]).any(axis=1))
    keep = np.ones(same_as.size, dtype=bool)
    keep[repeats[~found]] = False
    keep[read[differ]] = False
    return (SampleIndex(**{name: values[keep] for name, values in columns.items()}), same_as[keep],
            Repeated(committed.rows[repeats[~found]], same_as[repeats[~found]], committed.rows[read[differ]],
                     same_as[read[differ]], read[differ]))


def open_store(path: str) -> Store:
    return Store(path)


def to_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, default=str)
