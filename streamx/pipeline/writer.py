"""The writer: appends samples to one part of the store and commits them crash-consistently.

Commit protocol. Token arrays are written in whole shards (`shard_tokens`), in order; after
each shard the part's commit record (one small JSON document, replaced atomically) is
advanced to cover every sample and reject whose data is now fully written. A sample is
therefore either committed or absent: a kill at any moment loses at most the uncommitted
tail, which a re-run recomputes (its rows are not in the commit). A resumed writer rewrites
the committed tokens of the last partial shard into the shard it continues, so shards are
always written whole, and overwrites whatever lies beyond the commit.

Speed. The hidden states are nearly all the bytes. With no compressor on a local store, each
shard file is streamed: a sample's states go from the host batch to the file by one write call,
no copy and no encode (streamx.store.shards), and the file is renamed into place when the shard
is full. Otherwise (compressed arrays, object stores) a shard is collected in a host buffer and
written through zarr.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import zarr

from ..base.threads import get
from ..data.batching import Batch, Carry
from ..data.provenance import RowDigests
from ..data.sharing import Segment
from ..data.tokenize import REJECT_REASONS, Duplicate, Reject, tokens_digest
from ..model.transfer import HostBatch
from ..proof.audit import RECORDED
from ..store import Audited, Commit, SpaceGuard, StoreError
from ..store.format import (
    DIGEST_ARRAY,
    RANGE_ARRAYS,
    REJECT_ARRAYS,
    ROW_MASK_ARRAYS,
    SAME_AS_ARRAYS,
    SAMPLE_ARRAYS,
    SHARING_ARRAYS,
    SHARING_SAMPLE_ARRAYS,
    digest_words,
    part_storage,
)
from ..store.shards import ShardSink, shard_sink
from .metrics import QueueFill, StageTimes


@dataclass
class CapturedBatch:
    """A forward's captured states on their way to the store: the batch (its rows and where each lies in the
    computed tokens), and the computed tokens' states on the host."""

    batch: Batch
    host: HostBatch  # the states [N, K, H] as stored (bf16 or fp8, + scales) and per-segment finite flags
    ways: list[int] | None = None  # how it computed each row (proof.audit.Way.code; None: not recorded)


@dataclass
class RowOfBatch:
    """A row to store, as ranges (first token, length) of its batch's computed tokens, after those of tokens an
    earlier batch stored (a tree cut into several batches: streamx.model.carry)."""

    row_id: int
    ranges: list[tuple[int, int]]
    loss_mask: np.ndarray  # its own, over its tokens
    duplicate: bool = False
    content_key: int = 0
    digest: bytes = b""  # tokens_digest of its tokens ("": not recorded)
    stored_before: list[tuple[int, int]] = field(default_factory=list)  # (first token in the part, length)
    stored_mask: np.ndarray | None = None  # the stored loss mask over stored_before
    way: int = 0  # how its states were computed (proof.audit.Way.code; 0: not recorded)
    cut: int = 0  # its row's tokens past --max-length, not stored (Sample.cut)


@dataclass
class KeptSegment:
    """Where a segment that later batches continue lies in the part, and what they need to know of it."""

    offset: int
    loss_mask: np.ndarray  # as stored
    finite: bool


class KeptSegments:
    """Where the segments that later batches' rows start with lie in the part (a tree cut across batches:
    streamx.model.carry), from the batch that stores each to the last batch that continues it."""

    def __init__(self) -> None:
        self._kept: dict[Segment, KeptSegment] = {}

    def before(self, carry: Carry | None, k: int) -> list[tuple[KeptSegment, int]]:
        """The stored segments that row k of a batch starts with, and how many tokens of each it holds."""
        return [] if carry is None else [(self._kept[segment], n) for segment, n in carry.rows[k]]

    def keep(self, carry: Carry, spans: dict[int, tuple[int, int]], first: int, stored_mask: np.ndarray,
             finite: list[bool]) -> None:
        """The batch's segments that later batches continue: segment s is the tokens spans[s] of those stored
        from token `first` of the part on."""
        for s, segment in carry.exports.items():
            a, b = spans[s]
            self._kept[segment] = KeptSegment(first + a, stored_mask[a:b].copy(), bool(finite[s]))

    def release(self, carry: Carry) -> None:
        """Let go of the segments no batch after this one continues."""
        for segment in carry.releases:
            self._kept.pop(segment, None)


@dataclass
class PendingRow:
    """A sample appended and not yet committed."""

    row_id: int
    ranges: list[tuple[int, int]]  # (first token in the part, length), in order
    length: int
    trainable: int
    duplicate: bool
    content_key: int
    digest: bytes  # tokens_digest of its tokens ("": not recorded)
    own_mask: np.ndarray | None  # its loss mask, where it differs from the stored tokens' over its ranges
    end: int  # the end of the tokens appended with it: committed once the shards hold them
    same_as: int = -1  # a repeated row: the row it reads (its ranges are empty)
    way: int = 0  # RowOfBatch.way
    cut: int = 0  # RowOfBatch.cut


class PartWriter:
    """Appends samples to one part. The caller's thread writes the bytes; a committer thread puts
    each full shard in place and then commits it, in order, while the next shard is written.
    With a SpaceGuard, the committer stops the run when the filesystem is about to fill up.

    Fencing: each writer puts its own id in every commit record it writes, and reads the record afresh before
    it puts a shard in place and before it commits; if another writer has committed since (a double launch
    where the lock did not hold: Lustre's localflock, NFS without locks, an object store), it stops with one
    line and what it committed stays. With `digests`, each commit records the source windows its rows were read
    from (data.provenance.RowDigests), for a resume to compare."""

    def __init__(self, part: zarr.Group, space: SpaceGuard | None = None, digests: RowDigests | None = None):
        self.part, self.space, self.digests = part, space, digests
        self.writer = {"id": uuid.uuid4().hex[:16], "host": socket.gethostname(), "pid": os.getpid()}
        self.arrays = {name: arr for name, arr in part.arrays()}
        self.storage = part_storage(part)
        self.shard = self.arrays["hidden_states"].shards[0]
        record = part.attrs["commit"]
        self.opened = Commit.from_json(record)  # what earlier runs committed
        self.commit = Commit.from_json(record)  # advanced by each commit of this run
        self.commit.closed, self.commit.writer = False, self.writer
        self._last_writer = self.opened.writer  # who wrote the record as it stands
        self.sizes = {name: arr.shape[0] for name, arr in self.arrays.items()}
        self.shares = all(name in self.arrays for name in SHARING_ARRAYS)  # a part from before --sharing: no
        self.same_as = all(name in self.arrays for name in SAME_AS_ARRAYS)  # one from before format /4: no
        committed = self.commit.tokens
        self.flushed = committed // self.shard * self.shard  # tokens handed to the committer in whole shards
        self.end = committed  # tokens appended so far (committed + pending)
        self.sinks: dict[str, ShardSink] = {}
        for name in self.storage.token_arrays:
            arr = self.arrays[name]
            self.sinks[name] = shard_sink(arr, self.flushed)
            if committed > self.flushed:  # the committed part of the last, partial shard
                self.sinks[name].write(arr[self.flushed : committed])
        self.pending_samples: list[PendingRow] = []
        self.pending_rejects: list[Reject] = []
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamx-commit")
        self._committing: Future | None = None

    def committed_ways(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows earlier runs committed in the part and how each was computed (proof.audit.Way.code; 0: not
        recorded, a part from before streamx recorded it)."""
        n = self.opened.samples
        rows = self.arrays["sample_row_id"][:n]
        return rows, self.arrays["sample_way"][:n] if "sample_way" in self.arrays else np.zeros(n, dtype=np.uint8)

    # -- appending (the caller's thread)

    def append(self, row_id: int, input_ids: np.ndarray, loss_mask: np.ndarray, hidden_bits: np.ndarray,
               hidden_scales: np.ndarray | None = None, duplicate: bool = False, content_key: int = 0) -> None:
        """One sample that shares nothing: its token ids, loss mask, hidden states as stored (bf16 or fp8 bit
        patterns) and, for fp8 storage, its per-token scales; `duplicate`: its content repeats an earlier row's
        (counted in the commit); `content_key`: its row's (tokenize.content_key)."""
        row = RowOfBatch(row_id, [(0, len(input_ids))], loss_mask, duplicate, content_key,
                         tokens_digest(input_ids, loss_mask))
        self.append_batch(input_ids, loss_mask, hidden_bits, hidden_scales, [row])

    def append_batch(self, input_ids: np.ndarray, loss_mask: np.ndarray, hidden_bits: np.ndarray,
                     hidden_scales: np.ndarray | None, rows: list[RowOfBatch]) -> int:
        """A batch's computed tokens, stored once whatever rows read them, and its rows, each made of ranges of
        them. `loss_mask`: 1 where some row reading a token trains on it; a row whose own mask differs keeps it.
        Each row is committed as soon as the shards hold the tokens it reads (rows in order of their last).
        Returns where the batch's first token lies in the part."""
        first = self.end
        values = {"hidden_states": hidden_bits, "hidden_states_scales": hidden_scales, "input_ids": input_ids,
                  "loss_mask": loss_mask}
        written = 0
        for row in sorted(rows, key=lambda r: max((a + n for a, n in r.ranges), default=0)):
            needed = max((a + n for a, n in row.ranges), default=0)
            if needed > written:
                self._write_tokens({name: v[written:needed] for name, v in values.items() if v is not None})
                written = needed
            self._add_row(row, [*row.stored_before, *((first + a, n) for a, n in row.ranges)], loss_mask)
        if written < len(input_ids):
            self._write_tokens({name: v[written:] for name, v in values.items() if v is not None})
        return first

    def _write_tokens(self, values: dict[str, np.ndarray]) -> None:
        T, done = len(values["input_ids"]), 0
        while done < T:
            n = min(T - done, self.shard - (self.end - self.flushed))
            for name, sink in self.sinks.items():
                sink.write(values[name][done : done + n])
            self.end += n
            done += n
            if self.end - self.flushed == self.shard:
                self._end_shard(self.shard)

    def _add_row(self, row: RowOfBatch, ranges: list[tuple[int, int]], stored_mask: np.ndarray) -> None:
        mask = np.ascontiguousarray(row.loss_mask, dtype=np.uint8)
        there = np.concatenate([*([row.stored_mask] if row.stored_before else []),
                                *(stored_mask[a : a + n] for a, n in row.ranges)])
        own = None if np.array_equal(there, mask) else mask
        if (len(ranges) > 1 or own is not None) and not self.shares:
            raise StoreError(f"{self.part.path} was created before streamx shared tokens between rows: resume it with "
                             "--sharing off")
        self.pending_samples.append(PendingRow(row.row_id, ranges, sum(n for _, n in ranges), int(mask.sum()),
                                               row.duplicate, row.content_key, row.digest, own, self.end,
                                               way=row.way, cut=row.cut))

    def duplicate(self, row: Duplicate) -> None:
        """A row that repeats an earlier row's content: it stores no token and reads that row's sample."""
        if not self.same_as:
            raise StoreError(f"{self.part.path} was created before streamx recorded repeated rows: resume it with the "
                             "streamx that made it, or with --sharing off")
        self.pending_samples.append(PendingRow(row.row_id, [(0, 0)], row.length, row.trainable, True, row.content_key,
                                               row.digest, None, self.end, row.same_as, RECORDED,  # (nothing to heal)
                                               row.cut))

    def reject(self, reject: Reject) -> None:
        self.pending_rejects.append(reject)

    def close(self, complete: bool = True, source_rows: int | None = None, fanout: str | None = None,
              audit: Audited | None = None) -> None:
        """Write the last partial shard, commit everything and trim the arrays to the commit; `complete`: the
        run got to the end of its data, which had `source_rows` rows (else the part stays open for a resume,
        as after a kill); `fanout`: what the run's rows fan out to that sharing cannot fold (data.fanout);
        `audit`: what the in-run audit did (proof.audit), added to the part's earlier runs'."""
        self._end_shard(self.end - self.flushed)
        self.wait_committed()
        self._committer.shutdown()
        self.commit.closed = complete
        if complete:
            self.commit.source_rows = source_rows
        self.commit.fanout = fanout or self.commit.fanout  # (a resume tokenizes fewer rows: a note stays)
        if audit is not None:
            self.commit.audit = audit.merged(self.commit.audit).to_json()
        self._fence()
        for name, arr in self.arrays.items():
            n = self._committed_size(name)
            if arr.shape[0] != n:
                arr.resize((n, *arr.shape[1:]))
        self.part.attrs["commit"] = self.commit.to_json()
        self._last_writer = self.writer

    def abandon(self) -> None:
        """After a failure: let the commit in flight end (what it commits is whole) and stop the committer, so that
        nothing writes the part once the run has returned. Its own error, if any, gives way to the run's first."""
        try:
            self.wait_committed()
        except Exception:  # the run reports the failure that stopped it
            pass
        finally:
            self._committer.shutdown()

    def this_run(self) -> Commit:
        """What this writer has committed beyond what earlier runs had: after close(), this run's work."""
        return self.commit.since(self.opened)

    def _end_shard(self, tokens: int) -> None:
        """Hand the shard ending here, and the samples and rejects it completes, to the committer."""
        finishers = [sink.seal(self.flushed, tokens) for sink in self.sinks.values()] if tokens else []
        self.flushed += tokens
        ready = 0
        while ready < len(self.pending_samples) and self.pending_samples[ready].end <= self.flushed:
            ready += 1
        samples, self.pending_samples = self.pending_samples[:ready], self.pending_samples[ready:]
        rejects, self.pending_rejects = self.pending_rejects, []
        self.wait_committed()  # one shard in flight at most (bounded memory); its error surfaces here
        self._committing = self._committer.submit(self._publish, self.flushed, finishers, samples, rejects)

    def wait_committed(self) -> None:
        """Until every full shard handed over so far is in place and committed."""
        if self._committing is not None:
            committing, self._committing = self._committing, None
            committing.result()

    # -- storage (the committer thread)

    def _publish(self, stop: int, finishers: list[Callable[[], None]], samples: list[PendingRow],
                 rejects: list[Reject]) -> None:
        self._fence()
        for name in self.sinks:
            self._grow(name, stop)
        for finish in finishers:
            finish()
        self._fence()
        self._commit(samples, rejects)
        if self.space is not None:  # after the commit: a stop for space loses nothing written
            self.space.check()

    def _committed_size(self, name: str) -> int:
        if name in self.sinks:
            return self.commit.tokens
        if name in RANGE_ARRAYS:
            return self.commit.ranges
        if name in ROW_MASK_ARRAYS:
            return self.commit.row_masks
        samples = name in (*SAMPLE_ARRAYS, *SHARING_SAMPLE_ARRAYS, *SAME_AS_ARRAYS, DIGEST_ARRAY)
        return self.commit.samples if samples else self.commit.rejects

    def _grow(self, name: str, stop: int) -> None:
        """Make room for `stop` entries. Arrays grow by doubling (a resize is a metadata write, as dear
        as a commit) and close() trims them: readers go by the commit record, never by shapes."""
        arr = self.arrays[name]
        if self.sizes[name] < stop:
            self.sizes[name] = max(stop, 2 * self.sizes[name])
            arr.resize((self.sizes[name], *arr.shape[1:]))

    def _write(self, name: str, start: int, values: np.ndarray) -> None:
        if name not in self.arrays:  # the content keys, in a part from before streamx recorded them
            return
        self._grow(name, start + len(values))
        self.arrays[name][start : start + len(values)] = values

    def _commit(self, samples: list[PendingRow], rejects: list[Reject]) -> None:
        if not samples and not rejects:
            return
        c = self.commit
        if samples:
            shared = [r for r in samples if len(r.ranges) > 1]
            masks = [r for r in samples if r.own_mask is not None]
            starts = np.zeros(len(samples), dtype=np.int64)
            counts = np.zeros(len(samples), dtype=np.int64)
            mask_offsets = np.full(len(samples), -1, dtype=np.int64)
            ranges, range_at, own, mask_at = [], c.ranges, [], c.row_masks
            for i, row in enumerate(samples):
                if len(row.ranges) > 1:
                    starts[i], counts[i] = range_at, len(row.ranges)
                    ranges += row.ranges
                    range_at += len(row.ranges)
                if row.own_mask is not None:
                    mask_offsets[i] = mask_at
                    own.append(row.own_mask)
                    mask_at += len(row.own_mask)
            columns = {"sample_row_id": [r.row_id for r in samples], "sample_offset": [r.ranges[0][0] for r in samples],
                       "sample_length": [r.length for r in samples]}
            for name, values in columns.items():
                self._write(name, c.samples, np.array(values, dtype=np.int64))
            self._write("sample_content_key", c.samples, np.array([r.content_key for r in samples], dtype=np.uint64))
            self._write("sample_way", c.samples, np.array([r.way for r in samples], dtype=np.uint8))
            self._write("sample_cut", c.samples, np.array([r.cut for r in samples], dtype=np.int64))
            if shared or masks or self.shares:
                self._write("sample_range_start", c.samples, starts)
                self._write("sample_range_count", c.samples, counts)
                self._write("sample_mask_offset", c.samples, mask_offsets)
            if self.same_as:
                self._write("sample_same_as", c.samples, np.array([r.same_as for r in samples], dtype=np.int64))
            self._write(DIGEST_ARRAY, c.samples, digest_words([r.digest for r in samples]))
            if ranges:
                table = np.array(ranges, dtype=np.int64)
                self._write("range_offset", c.ranges, table[:, 0])
                self._write("range_length", c.ranges, table[:, 1])
            if own:
                self._write("row_loss_mask", c.row_masks, np.concatenate(own))
            c.samples += len(samples)
            c.ranges, c.row_masks = range_at, mask_at
            c.tokens = max(c.tokens, samples[-1].end)
            c.row_tokens = c.samples_tokens + sum(r.length for r in samples)
            c.trainable_tokens += sum(r.trainable for r in samples)
            c.duplicates += sum(int(r.duplicate) for r in samples)
            c.cut_rows = (c.cut_rows or 0) + sum(r.cut > 0 for r in samples)
            c.cut_tokens = (c.cut_tokens or 0) + sum(r.cut for r in samples)
        if rejects:
            rows = np.array([r.row_id for r in rejects], dtype=REJECT_ARRAYS["reject_row_id"])
            codes = np.array([REJECT_REASONS.index(r.reason) for r in rejects], dtype=REJECT_ARRAYS["reject_reason"])
            self._write("reject_row_id", c.rejects, rows)
            self._write("reject_reason", c.rejects, codes)
            self._write("reject_content_key", c.rejects, np.array([r.content_key for r in rejects], dtype=np.uint64))
            c.rejects += len(rejects)
            for r in rejects:
                c.reject_counts[r.reason] = c.reject_counts.get(r.reason, 0) + 1
                c.reject_examples.setdefault(r.reason, f"row {r.row_id}: {r.detail}")
        if self.digests is not None:  # the source windows these rows were read from, as read (a resume compares)
            c.data_digests.update(self.digests.of([r.row_id for r in samples] + [r.row_id for r in rejects]))
        c.updated = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.part.attrs["commit"] = c.to_json()  # the commit point: one atomic document replace
        self._last_writer = self.writer

    def _fence(self) -> None:
        """Stop if another writer has committed to this part since this one last read or wrote its record."""
        record = zarr.open_group(store=self.part.store, path=self.part.path, mode="r").attrs["commit"]
        now, expected = record.get("writer") or {}, self._last_writer or {}
        if now.get("id") != expected.get("id"):
            raise StoreError(f"{self.part.path} of {self.part.store} was committed by another writer since this one "
                             f"opened it (pid {now.get('pid')} on {now.get('host')}): two processes are writing the "
                             "same part (a double launch where the filesystem's locks do not reach every node); this "
                             "one stops, and what each committed stays")


class RejectRateError(RuntimeError):
    pass


@dataclass
class RejectRate:
    """Stops the run when most rows are rejected: then the data or the chat template is wrong, not a
    few rows. Checked once `min_rows` rows have been seen."""

    max_fraction: float
    min_rows: int = 100
    rows: int = 0
    rejects: Counter = field(default_factory=Counter)

    def accept(self) -> None:
        self.rows += 1

    def reject(self, reason: str) -> None:
        self.rows += 1
        self.rejects[reason] += 1
        total = sum(self.rejects.values())
        if self.rows >= self.min_rows and total > self.max_fraction * self.rows:
            top, n = self.rejects.most_common(1)[0]
            raise RejectRateError(f"{total} of {self.rows} rows rejected (> {self.max_fraction:.0%}); top reason: "
                                  f"{top} ({n} rows)")


class WriterStage:
    """The writer thread's body: CapturedBatch, Reject and Duplicate items until a None sentinel, then close. Rows
    in `done` (committed by an earlier run, recomputed with their batch) are dropped."""

    def __init__(self, writer: PartWriter, done: Collection[int], rate: RejectRate, times: StageTimes,
                 source_rows: Callable[[], int | None] = lambda: None,
                 fanout: Callable[[], str | None] = lambda: None,
                 audit: Callable[[], Audited | None] = lambda: None):
        self.writer, self.done, self.rate, self.times = writer, done, rate, times
        self.source_rows = source_rows  # the data's rows, asked when it has run out (recorded in the commit)
        self.fanout = fanout  # the run's FanOut note, asked at the end (recorded in the commit)
        self.audit = audit  # the in-run audit's figures, asked at the end (recorded in the commit)
        self.kept = KeptSegments()
        self.stored_again = 0  # tokens a resume stored again (`_store`)

    def run(self, items: queue.Queue, failed: threading.Event, fill: QueueFill | None = None,
            rows_left: threading.Event | None = None) -> None:
        """`rows_left` set when the sentinel comes: the run wound up before the end of its data."""
        try:
            while True:
                item = get(items, failed)
                if fill is not None:
                    fill.record()
                if item is None:
                    audit = self.audit()
                    # a part with rows waiting to be computed again stays open until they are (pipeline.heal)
                    complete = (rows_left is None or not rows_left.is_set()) and not (audit and audit.to_heal)
                    with self.times.measure("write"):
                        self.writer.close(complete, self.source_rows() if complete else None, self.fanout(), audit)
                    return
                if isinstance(item, Reject):
                    self.reject(item)
                elif isinstance(item, Duplicate):
                    if item.row_id not in self.done:
                        self.writer.duplicate(item)
                        self.rate.accept()
                else:
                    self.write(item)
        except BaseException:
            self.writer.abandon()
            raise

    def reject(self, reject: Reject) -> None:
        if reject.row_id not in self.done:
            self.writer.reject(reject)
            if reject.reason != "duplicate_content":  # asked for (--skip-duplicates), not a sign of broken data
                self.rate.reject(reject.reason)

    def write(self, batch: CapturedBatch) -> None:
        with self.times.measure("d2h_wait"):
            batch.host.wait()
        with self.times.measure("write"):
            try:
                self._append(batch)
            finally:  # the pinned buffer goes back to the ring even when the write fails
                batch.host.release()

    def _append(self, captured: CapturedBatch) -> None:
        """The batch's computed tokens, once, then each of its rows not committed before, as ranges of them (after
        the segments an earlier batch stored); a row with a NaN or Inf among its states is a reject."""
        batch, carry = captured.batch, captured.batch.carry
        finite = captured.host.finite.tolist()
        rows, reads, done_reads = [], set(), set()  # rows to store; the segments they read; those done rows read
        for k, (sample, segments) in enumerate(zip(batch.samples, batch.row_segments(), strict=True)):
            if sample.row_id in self.done:
                done_reads.update(segments)
                continue
            before = self.kept.before(carry, k)
            if all(finite[s] for s in segments) and all(kept.finite for kept, _ in before):
                reads.update(segments)
                rows.append(RowOfBatch(
                    sample.row_id, batch.row_ranges[k], sample.loss_mask.numpy(), sample.duplicate,
                    sample.content_key, sample.digest, [(kept.offset, n) for kept, n in before],
                    np.concatenate([kept.loss_mask[:n] for kept, n in before]) if before else None,
                    captured.ways[k] if captured.ways is not None else 0, sample.cut))
            else:
                self.reject(Reject(sample.row_id, "non_finite", "NaN or Inf in the captured hidden states",
                                   sample.content_key))
        exports = set(carry.exports if carry is not None else ())
        stored = sorted(reads | exports)
        if stored:
            self._store(captured, stored, rows, finite)
        if done_reads:  # the run that committed those rows stored what they read and what later batches continue
            self.stored_again += sum(batch.segment_lengths[s] for s in (done_reads | exports).intersection(stored))
        if carry is not None:
            self.kept.release(carry)
        for _ in rows:
            self.rate.accept()

    def _store(self, captured: CapturedBatch, stored: list[int], rows: list[RowOfBatch], finite: list[bool]) -> None:
        """The batch's segments `stored` (those its rows to store read, and those later batches continue) and its
        rows. A resume runs a batch again whose rows an earlier run committed, all or some, where a later batch
        continues it or some of its rows are not committed (`to_run`): it stores only what these need, so a
        resume stores again at most the segments rows of both read (`stored_again`), never a whole batch."""
        batch, carry = captured.batch, captured.batch.carry
        values = {"hidden_bits": self.writer.storage.to_bits(captured.host.hidden), "ids": batch.computed_ids(),
                  "mask": batch.stored_loss_mask(),
                  "scales": None if captured.host.scales is None else captured.host.scales.numpy()}
        bounds = np.cumsum([0, *batch.segment_lengths]).tolist()
        starts = {s: bounds[s] for s in stored}  # where each stored segment lies among the stored tokens
        if len(stored) < len(batch.segment_lengths):
            picked = np.concatenate([np.arange(bounds[s], bounds[s + 1]) for s in stored])
            values = {name: None if v is None else v[picked] for name, v in values.items()}
            starts = dict(zip(stored, np.cumsum([0, *(batch.segment_lengths[s] for s in stored)])[:-1].tolist(),
                              strict=True))
            segment_of = batch.segment_index.numpy().tolist()
            rows = [dataclasses.replace(row, ranges=[(starts[segment_of[a]] + a - bounds[segment_of[a]], n)
                                                     for a, n in row.ranges]) for row in rows]
        first = self.writer.append_batch(values["ids"], values["mask"], values["hidden_bits"], values["scales"], rows)
        if carry is not None:
            spans = {s: (starts[s], starts[s] + batch.segment_lengths[s]) for s in carry.exports}
            self.kept.keep(carry, spans, first, values["mask"], finite)
