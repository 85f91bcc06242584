"""What a run measures about itself, so that it (and `streamx bench`) can name its bottleneck:
busy time per stage, how full the hand-off queues are, and the rows and tokens through it.

CPU stages use perf_counter. Device stages use CUDA events, resolved only when totals are
read, so timing never synchronises the device mid-run."""

from __future__ import annotations

import queue
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm


class StageTimes:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def measure(self, stage: str, device: torch.device | None = None) -> Iterator[None]:
        if device is not None and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((stage, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[stage] += time.perf_counter() - t0

    def totals(self) -> dict[str, float]:
        for stage, start, end in self._events:
            end.synchronize()
            self.seconds[stage] += start.elapsed_time(end) / 1000
        self._events.clear()
        return dict(self.seconds)


class QueueFill:
    """Mean occupancy (0..1) of a bounded queue when its consumer takes an item: near 1, the
    consumer binds; near 0, the producer does."""

    def __init__(self, q: queue.Queue):
        self.q, self.total, self.reads = q, 0, 0

    def record(self) -> None:  # called by the consumer right after a get
        self.total += self.q.qsize() + 1
        self.reads += 1

    @property
    def mean(self) -> float:
        return self.total / max(self.reads, 1) / self.q.maxsize


@dataclass
class Throughput:
    """Rows and tokens through a run: tokenized (the producer runs ahead) and through the forward pass."""

    tokens_to_go: int | None = None  # the sizing pass's tokens for this run to write (None: not sized)
    tokenized_rows: int = 0
    tokenized_tokens: int = 0
    rows: int = 0  # samples and rejects past the model stage
    real_tokens: int = 0  # computed (with --sharing, fewer than the rows')
    padded_tokens: int = 0
    row_tokens: int = 0  # the tokens of the rows served: what the sizing pass counts
    first_batch: tuple[float, int, int] | None = None  # (when, real tokens, row tokens) after the first batch

    def tokenized(self, rows: int, tokens: int) -> None:
        """Count what the producer hands over: a batch's samples and tokens, or a reject (one row, no tokens)."""
        self.tokenized_rows += rows
        self.tokenized_tokens += tokens

    def forwarded(self, rows: int, real_tokens: int, padded_tokens: int, row_tokens: int | None = None) -> None:
        """Count a batch through the model stage (`row_tokens`: its rows' tokens, when not `real_tokens`)."""
        self.rows += rows
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens
        self.row_tokens += real_tokens if row_tokens is None else row_tokens
        if self.first_batch is None:
            self.first_batch = (time.perf_counter(), self.real_tokens, self.row_tokens)

    def tokens_per_s(self, elapsed: float) -> float:
        """The rate since the first batch (the first one also pays the first window's tokenizing and the
        forward's warm-up), or over `elapsed` until a second batch is through."""
        return self._rate(self.real_tokens, 1, elapsed)

    def _rate(self, tokens: int, which: int, elapsed: float) -> float:
        if self.first_batch is not None:
            since, first = self.first_batch[0], self.first_batch[which]
            seconds = time.perf_counter() - since
            if tokens > first and seconds > 0:
                return (tokens - first) / seconds
        return tokens / elapsed

    def status(self, total_rows: int | None, elapsed: float) -> str:
        """tokens/s, padding efficiency and ETA, as the progress bar's postfix; what is happening until the
        first batch is through."""
        if self.first_batch is None:
            return ("starting: tokenizing the first window of rows, then the first forward pass"
                    if not self.tokenized_rows else "starting: the first forward pass")
        parts = [f"{self.tokens_per_s(elapsed):,.0f} tok/s"]
        if self.padded_tokens:
            parts.append(f"pad eff {self.real_tokens / self.padded_tokens:.1%}")
        eta = self.eta_seconds(total_rows, elapsed)
        if eta is not None:
            parts.append(f"ETA {tqdm.format_interval(eta)}")
        return ", ".join(parts)

    def eta_seconds(self, total_rows: int | None, elapsed: float) -> float | None:
        """Seconds left, from tokens rather than rows (a row costs its length, and length-sorted windows make
        the per-row rate swing): the tokens to go are the sizing pass's, else estimated from the rows
        tokenized so far."""
        rate = self._rate(self.row_tokens, 2, elapsed)  # rows' tokens, as the sizing pass counts them
        if self.tokens_to_go is not None:
            expected = self.tokens_to_go
        elif total_rows and self.tokenized_rows:
            expected = self.tokenized_tokens / self.tokenized_rows * total_rows
        else:
            return None
        return max(0.0, expected - self.row_tokens) / rate if rate > 0 else None
