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
no copy and no encode (store.shard_path), and the file is renamed into place when the shard is
full. Otherwise (compressed arrays, object stores, and the small token-id and mask arrays) a
shard is collected in a host buffer and written through zarr.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import numpy as np
import zarr

from .metrics import QueueFill, StageTimes
from .store import (
    SAMPLE_ARRAYS,
    TOKEN_ARRAYS,
    Commit,
    SpaceGuard,
    shard_index,
    shard_key,
    stored_bits,
    streamable_dir,
)
from .tokenize import REJECT_REASONS, Reject, Sample
from .transfer import HostBatch


@dataclass
class PackedBatch:
    samples: list[Sample]  # row ids, input ids and loss masks, in packed order
    host: HostBatch  # their hidden states [N, K, H] and per-sample finite flags


class ShardSink(Protocol):
    """Receives one token array's values shard by shard, in order."""

    def write(self, values: np.ndarray) -> None: ...  # the next tokens of the current shard

    def seal(self, start: int, tokens: int) -> Callable[[], None]:
        """End the current shard (at token `start`, holding `tokens`); return the work that puts it
        in place, which the committer runs while the next shard is being written."""
        ...


class StreamedShards:
    """Shard files written as their bytes arrive, then renamed into place whole."""

    def __init__(self, arr: zarr.Array, start: int):
        self.arr, self.chunk_tokens, self.shard_tokens = arr, arr.chunks[0], arr.shards[0]
        self.start = start  # first token of the shard being written
        self.dir = streamable_dir(arr)
        self.token_nbytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
        self.fd: int | None = None
        self.tmp: Path | None = None
        for stale in self.dir.glob("streamx-shard-*.partial"):  # a killed writer's; one writer per part
            stale.unlink()

    def write(self, values: np.ndarray) -> None:
        if self.fd is None:
            self.tmp = self.dir / f"streamx-shard-{self.start // self.shard_tokens:06d}.partial"
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(self.fd, memoryview(np.ascontiguousarray(values)).cast("B"))

    def seal(self, start: int, tokens: int) -> Callable[[], None]:
        fd, tmp, self.fd, self.start = self.fd, self.tmp, None, start + tokens
        return lambda: self.finish(fd, tmp, start, tokens)

    def finish(self, fd: int, tmp: Path, start: int, tokens: int) -> None:
        """Pad the last chunk, append the shard index, and rename the file into place."""
        chunks = -(-tokens // self.chunk_tokens)
        padding = (chunks * self.chunk_tokens - tokens) * self.token_nbytes  # a partial last chunk is stored whole
        _write_all(fd, memoryview(bytes(padding)))
        _write_all(fd, memoryview(shard_index(chunks, self.shard_tokens // self.chunk_tokens,
                                              self.chunk_tokens * self.token_nbytes)))
        os.close(fd)
        target = self.dir / shard_key(self.arr, start // self.shard_tokens)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)  # readers see the old file or the whole new one, never a torn one


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


class BufferedShards:
    """Shards collected in host memory, then written through zarr (which encodes and compresses);
    two buffers, so that the next shard fills while the committer writes the last one."""

    def __init__(self, arr: zarr.Array):
        self.arr = arr
        self.buffers = [np.empty((arr.shards[0], *arr.shape[1:]), dtype=arr.dtype) for _ in range(2)]
        self.tokens = 0

    def write(self, values: np.ndarray) -> None:
        self.buffers[0][self.tokens : self.tokens + len(values)] = values
        self.tokens += len(values)

    def seal(self, start: int, tokens: int) -> Callable[[], None]:
        sealed = self.buffers[0]
        self.buffers.reverse()  # the committer is done with the other one: one shard in flight at most
        self.tokens = 0
        return lambda: self.arr.__setitem__(slice(start, start + tokens), sealed[:tokens])


class PartWriter:
    """Appends samples to one part. The caller's thread writes the bytes; a committer thread puts
    each full shard in place and then commits it, in order, while the next shard is written.
    With a SpaceGuard, the committer stops the run when the filesystem is about to fill up."""

    def __init__(self, part: zarr.Group, space: SpaceGuard | None = None):
        self.part, self.space = part, space
        self.arrays = {name: arr for name, arr in part.arrays()}
        self.shard = self.arrays["hidden_states"].shards[0]
        record = part.attrs["commit"]
        self.opened = Commit.from_json(record)  # what earlier runs committed
        self.commit = Commit.from_json(record)  # advanced by each commit of this run
        self.commit.closed = False
        self.sizes = {name: arr.shape[0] for name, arr in self.arrays.items()}
        committed = self.commit.tokens
        self.flushed = committed // self.shard * self.shard  # tokens handed to the committer in whole shards
        self.end = committed  # tokens appended so far (committed + pending)
        self.sinks: dict[str, ShardSink] = {}
        for name in (name for name in TOKEN_ARRAYS if name in self.arrays):  # the scales: fp8 stores only
            arr = self.arrays[name]
            self.sinks[name] = StreamedShards(arr, self.flushed) if streamable_dir(arr) else BufferedShards(arr)
            if committed > self.flushed:  # the committed part of the last, partial shard
                self.sinks[name].write(arr[self.flushed : committed])
        self.pending_samples: list[tuple[int, int, int, int]] = []  # (row_id, offset, length, trainable)
        self.pending_rejects: list[Reject] = []
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamx-commit")
        self._committing: Future | None = None

    # -- appending (the caller's thread)

    def append(self, row_id: int, input_ids: np.ndarray, loss_mask: np.ndarray, hidden_bits: np.ndarray,
               hidden_scales: np.ndarray | None = None) -> None:
        """One sample: its token ids, loss mask, hidden states as stored (bf16 or fp8 bit patterns) and, for fp8
        storage, its per-token scales."""
        T = len(input_ids)
        self.pending_samples.append((row_id, self.end, T, int(loss_mask.sum())))
        values = {"hidden_states": hidden_bits, "hidden_states_scales": hidden_scales, "input_ids": input_ids,
                  "loss_mask": loss_mask}
        done = 0
        while done < T:
            n = min(T - done, self.shard - (self.end - self.flushed))
            for name, sink in self.sinks.items():
                sink.write(values[name][done : done + n])
            self.end += n
            done += n
            if self.end - self.flushed == self.shard:
                self._end_shard(self.shard)

    def reject(self, reject: Reject) -> None:
        self.pending_rejects.append(reject)

    def close(self) -> None:
        """Write the last partial shard, commit everything and trim the arrays to the commit."""
        self._end_shard(self.end - self.flushed)
        self.wait_committed()
        self._committer.shutdown()
        self.commit.closed = True
        for name, arr in self.arrays.items():
            n = self._committed_size(name)
            if arr.shape[0] != n:
                arr.resize((n, *arr.shape[1:]))
        self.part.attrs["commit"] = self.commit.to_json()

    def this_run(self) -> Commit:
        """What this writer has committed beyond what earlier runs had: after close(), this run's work."""
        c, o = self.commit, self.opened
        return Commit(samples=c.samples - o.samples, tokens=c.tokens - o.tokens,
                      trainable_tokens=c.trainable_tokens - o.trainable_tokens, rejects=c.rejects - o.rejects,
                      reject_counts={k: n - o.reject_counts.get(k, 0) for k, n in c.reject_counts.items()
                                     if n > o.reject_counts.get(k, 0)}, closed=c.closed, updated=c.updated)

    def _end_shard(self, tokens: int) -> None:
        """Hand the shard ending here, and the samples and rejects it completes, to the committer."""
        finishers = [sink.seal(self.flushed, tokens) for sink in self.sinks.values()] if tokens else []
        self.flushed += tokens
        ready = 0
        while ready < len(self.pending_samples) and sum(self.pending_samples[ready][1:3]) <= self.flushed:
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

    def _publish(self, stop: int, finishers: list[Callable[[], None]], samples: list[tuple[int, int, int, int]],
                 rejects: list[Reject]) -> None:
        for name in self.sinks:
            self._grow(name, stop)
        for finish in finishers:
            finish()
        self._commit(samples, rejects)
        if self.space is not None:  # after the commit: a stop for space loses nothing written
            self.space.check()

    def _committed_size(self, name: str) -> int:
        if name in self.sinks:
            return self.commit.tokens
        return self.commit.samples if name.startswith("sample_") else self.commit.rejects

    def _grow(self, name: str, stop: int) -> None:
        """Make room for `stop` entries. Arrays grow by doubling (a resize is a metadata write, as dear
        as a commit) and close() trims them: readers go by the commit record, never by shapes."""
        arr = self.arrays[name]
        if self.sizes[name] < stop:
            self.sizes[name] = max(stop, 2 * self.sizes[name])
            arr.resize((self.sizes[name], *arr.shape[1:]))

    def _write(self, name: str, start: int, values: np.ndarray) -> None:
        self._grow(name, start + len(values))
        self.arrays[name][start : start + len(values)] = values

    def _commit(self, samples: list[tuple[int, int, int, int]], rejects: list[Reject]) -> None:
        if not samples and not rejects:
            return
        c = self.commit
        if samples:
            rows, offsets, lengths, trainable = (np.array(col, dtype=np.int64) for col in zip(*samples, strict=True))
            for name, values in zip(SAMPLE_ARRAYS, (rows, offsets, lengths), strict=True):
                self._write(name, c.samples, values)
            c.samples += len(samples)
            c.tokens = int(offsets[-1] + lengths[-1])
            c.trainable_tokens += int(trainable.sum())
        if rejects:
            self._write("reject_row_id", c.rejects, np.array([r.row_id for r in rejects], dtype=np.int64))
            codes = np.array([REJECT_REASONS.index(r.reason) for r in rejects], dtype=np.uint8)
            self._write("reject_reason", c.rejects, codes)
            c.rejects += len(rejects)
            for r in rejects:
                c.reject_counts[r.reason] = c.reject_counts.get(r.reason, 0) + 1
                c.reject_examples.setdefault(r.reason, f"row {r.row_id}: {r.detail}")
        c.updated = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.part.attrs["commit"] = c.to_json()  # the commit point: one atomic document replace


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


def write_loop(items: queue.Queue, writer: PartWriter, stop: threading.Event, done: set[int], rate: RejectRate,
               times: StageTimes, fill: QueueFill) -> None:
    """The writer thread's body: PackedBatch / Reject items until a None sentinel, then close.
    Rows in `done` (committed by an earlier run, recomputed with their batch) are dropped."""

    def record_reject(reject: Reject) -> None:
        if reject.row_id not in done:
            writer.reject(reject)
            rate.reject(reject.reason)

    def write_batch(batch: PackedBatch) -> None:
        with times.measure("d2h_wait"):
            batch.host.wait()
        with times.measure("write"):
            hidden_bits = stored_bits(batch.host.hidden)
            scales = None if batch.host.scales is None else batch.host.scales.numpy()
            offset = 0
            for sample, finite in zip(batch.samples, batch.host.finite.tolist(), strict=True):
                T = len(sample.input_ids)
                if sample.row_id in done:
                    pass
                elif finite:
                    mask = sample.loss_mask.numpy().astype(np.uint8)
                    writer.append(sample.row_id, sample.input_ids.numpy(), mask, hidden_bits[offset : offset + T],
                                  None if scales is None else scales[offset : offset + T])
                    rate.accept()
                else:
                    record_reject(Reject(sample.row_id, "non_finite", "NaN or Inf in the captured hidden states"))
                offset += T
            batch.host.release()

    while True:
        try:
            item = items.get(timeout=0.1)
        except queue.Empty:
            if stop.is_set():
                return
            continue
        fill.record()
        if item is None:
            with times.measure("write"):
                writer.close()
            return
        if isinstance(item, Reject):
            record_reject(item)
        else:
            write_batch(item)
