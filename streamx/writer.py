"""The writer: appends samples to one part of the store and commits them crash-consistently.

Commit protocol. Token arrays are written in whole shards (`shard_tokens`), in order; after
each shard the part's commit record (one small JSON document, replaced atomically) is
advanced to cover every sample and reject whose data is now fully written. A sample is
therefore either committed or absent: a kill at any moment loses at most the uncommitted
tail, which a re-run recomputes (its rows are not in the commit). A resumed writer reloads
the committed tokens of the last partial shard into its buffer, so shards are always
written whole, and overwrites whatever lies beyond the commit.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import zarr

from .store import PARTS, EMPTY_COMMIT, Layout, bf16_to_bits, create_part
from .tokenize import REJECT_REASONS, Reject, Sample
from .timing import StageTimes
from .transfer import HostBatch


@dataclass
class PackedBatch:
    samples: list[Sample]  # row ids, input ids and loss masks, in packed order
    host: HostBatch  # their hidden states [N, K, H] and per-sample finite flags


class PartWriter:
    def __init__(self, root: zarr.Group, part_name: str, layout: Layout):
        parts = root.require_group(PARTS)
        self.part = parts[part_name] if part_name in parts else create_part(root, part_name, layout)
        self.arrays = {name: arr for name, arr in self.part.arrays()}
        self.shard = self.arrays["hidden_states"].shards[0]
        self.commit: dict[str, Any] = {**EMPTY_COMMIT, **self.part.attrs["commit"], "closed": False}
        self.sizes = {name: arr.shape[0] for name, arr in self.arrays.items()}
        committed = self.commit["tokens"]
        self.flushed = committed // self.shard * self.shard  # tokens written in whole shards
        self.end = committed  # tokens appended so far (committed + pending)
        _, K, H = self.arrays["hidden_states"].shape
        self.buffers = {
            "hidden_states": np.empty((self.shard, K, H), dtype=np.uint16),
            "input_ids": np.empty(self.shard, dtype=np.int64),
            "loss_mask": np.empty(self.shard, dtype=np.uint8),
        }
        for name, buffer in self.buffers.items():  # the committed part of the last, partial shard
            buffer[: committed - self.flushed] = self.arrays[name][self.flushed : committed]
        self.pending_samples: list[tuple[int, int, int, int]] = []  # (row_id, offset, length, trainable)
        self.pending_rejects: list[Reject] = []

    # -- appending

    def append(self, row_id: int, input_ids: np.ndarray, loss_mask: np.ndarray, hidden_bits: np.ndarray) -> None:
        T = len(input_ids)
        self.pending_samples.append((row_id, self.end, T, int(loss_mask.sum())))
        done = 0
        while done < T:
            fill = self.end - self.flushed
            n = min(T - done, self.shard - fill)
            self.buffers["hidden_states"][fill : fill + n] = hidden_bits[done : done + n]
            self.buffers["input_ids"][fill : fill + n] = input_ids[done : done + n]
            self.buffers["loss_mask"][fill : fill + n] = loss_mask[done : done + n]
            self.end += n
            done += n
            if self.end - self.flushed == self.shard:
                self._write_tokens(self.shard)
                self.flushed += self.shard
                self._commit(self.flushed)

    def reject(self, reject: Reject) -> None:
        self.pending_rejects.append(reject)

    def close(self) -> None:
        """Write the last partial shard, commit everything and trim the arrays to the commit."""
        self._write_tokens(self.end - self.flushed)
        self._commit(self.end)
        self.commit["closed"] = True
        for name, arr in self.arrays.items():
            n = self._committed_size(name)
            if arr.shape[0] != n:
                arr.resize((n, *arr.shape[1:]))
        self.part.attrs["commit"] = self.commit

    # -- storage

    def _committed_size(self, name: str) -> int:
        if name in self.buffers:
            return self.commit["tokens"]
        return self.commit["samples"] if name.startswith("sample_") else self.commit["rejects"]

    def _write(self, name: str, start: int, values: np.ndarray) -> None:
        arr = self.arrays[name]
        stop = start + len(values)
        if self.sizes[name] < stop:
            arr.resize((stop, *arr.shape[1:]))
            self.sizes[name] = stop
        arr[start:stop] = values

    def _write_tokens(self, n: int) -> None:
        if n:
            for name, buffer in self.buffers.items():
                self._write(name, self.flushed, buffer[:n])

    def _commit(self, upto_tokens: int) -> None:
        ready = 0
        while ready < len(self.pending_samples) and sum(self.pending_samples[ready][1:3]) <= upto_tokens:
            ready += 1
        samples, self.pending_samples = self.pending_samples[:ready], self.pending_samples[ready:]
        rejects, self.pending_rejects = self.pending_rejects, []
        if not samples and not rejects:
            return
        c = self.commit
        if samples:
            rows, offsets, lengths, trainable = (np.array(col, dtype=np.int64) for col in zip(*samples))
            for name, values in zip(("sample_row_id", "sample_offset", "sample_length"), (rows, offsets, lengths)):
                self._write(name, c["samples"], values)
            c["samples"] += len(samples)
            c["tokens"] = int(offsets[-1] + lengths[-1])
            c["trainable_tokens"] += int(trainable.sum())
        if rejects:
            self._write("reject_row_id", c["rejects"], np.array([r.row_id for r in rejects], dtype=np.int64))
            codes = np.array([REJECT_REASONS.index(r.reason) for r in rejects], dtype=np.uint8)
            self._write("reject_reason", c["rejects"], codes)
            c["rejects"] += len(rejects)
            for r in rejects:
                c["reject_counts"][r.reason] = c["reject_counts"].get(r.reason, 0) + 1
                c["reject_examples"].setdefault(r.reason, f"row {r.row_id}: {r.detail}")
        c["updated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.part.attrs["commit"] = c  # the commit point: one atomic document replace


class RejectRateError(RuntimeError):
    pass


@dataclass
class WriteCounts:
    samples: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    rejects: int = 0
    bytes: int = 0
    reject_counts: dict[str, int] = field(default_factory=dict)


def write_loop(items: queue.Queue, writer: PartWriter, counts: WriteCounts, stop: threading.Event,
               done: set[int], max_reject_fraction: float, times: StageTimes, fill: dict[str, list[int]],  # fill: [sum of sizes, reads]
               min_rows_for_rate: int = 100) -> None:
    """The writer thread's body: PackedBatch / Reject items until a None sentinel, then close.
    Rows in `done` (committed by an earlier run, recomputed with their batch) are dropped."""

    def record_reject(reject: Reject) -> None:
        if reject.row_id in done:
            return
        writer.reject(reject)
        counts.rejects += 1
        counts.reject_counts[reject.reason] = counts.reject_counts.get(reject.reason, 0) + 1

    def write_batch(batch: PackedBatch) -> None:
        with times.measure("d2h_wait"):
            batch.host.wait()
        with times.measure("write"):
            hidden_bits = bf16_to_bits(batch.host.hidden)
            offset = 0
            for sample, finite in zip(batch.samples, batch.host.finite.tolist()):
                T = len(sample.input_ids)
                if sample.row_id in done:
                    pass
                elif finite:
                    mask = sample.loss_mask.numpy().astype(np.uint8)
                    writer.append(sample.row_id, sample.input_ids.numpy(), mask, hidden_bits[offset : offset + T])
                    counts.samples += 1
                    counts.tokens += T
                    counts.trainable_tokens += int(mask.sum())
                    counts.bytes += hidden_bits[offset : offset + T].nbytes
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
        fill["to_write"][0] += items.qsize() + 1
        fill["to_write"][1] += 1
        if item is None:
            with times.measure("write"):
                writer.close()
            return
        if isinstance(item, Reject):
            record_reject(item)
        else:
            write_batch(item)
        rows = counts.samples + counts.rejects
        if rows >= min_rows_for_rate and counts.rejects > max_reject_fraction * rows:
            top, n = max(counts.reject_counts.items(), key=lambda kv: kv[1])
            raise RejectRateError(
                f"{counts.rejects} of {rows} rows rejected (> {max_reject_fraction:.0%}); top reason: {top} ({n} rows)"
            )
