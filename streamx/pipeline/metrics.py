"""What a run measures about itself, so that it (and `streamx bench`) can name its bottleneck:
busy time per stage, how full the hand-off queues are, and the rows and tokens through it.

CPU stages use perf_counter. Device stages use CUDA events, resolved only when totals are
read, so timing never synchronises the device mid-run."""

from __future__ import annotations

import queue
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

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


RATE_WINDOW = 30.0  # seconds of recent batches the rate is taken over


@dataclass
class Throughput:
    """Rows and tokens through a run: tokenized (the producer runs ahead) and through the forward pass. Tokens are
    those computed (with --sharing, fewer than the rows': repeats, prefix rows and shared leading runs once)."""

    tokens_to_go: int | None = None  # the tokens this run will compute, as planned (None: not known)
    clock: Callable[[], float] = time.perf_counter
    tokenized_rows: int = 0
    tokenized_tokens: int = 0
    rows: int = 0  # rows past the model stage: samples, repeats and rejects
    real_tokens: int = 0  # computed
    padded_tokens: int = 0
    marks: deque[tuple[float, int]] = field(default_factory=deque)  # (when, real tokens) after each recent batch

    def tokenized(self, rows: int, tokens: int) -> None:
        """Count what the producer hands over: a batch's rows and computed tokens, or a row with none to compute."""
        self.tokenized_rows += rows
        self.tokenized_tokens += tokens

    def forwarded(self, rows: int, real_tokens: int, padded_tokens: int) -> None:
        """Count a batch through the model stage."""
        self.rows += rows
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens
        now = self.clock()
        self.marks.append((now, self.real_tokens))
        while len(self.marks) > 2 and self.marks[0][0] < now - RATE_WINDOW:
            self.marks.popleft()

    def tokens_per_s(self, elapsed: float) -> float:
        """The rate over the batches that ended in the last RATE_WINDOW seconds (at least the last one), from the
        end of the batch before them: it holds between batches, and the first batch (which also pays the first
        window's tokenizing and the forward's warm-up) never counts; over `elapsed` until a second batch is
        through."""
        if len(self.marks) > 1:
            (start, first), (end, last) = self.marks[0], self.marks[-1]
            if end > start:
                return (last - first) / (end - start)
        return self.real_tokens / elapsed

    def status(self, total_rows: int | None, elapsed: float) -> str:
        """tokens/s, padding efficiency and ETA, as the progress bar's postfix; what is happening until the
        first batch is through."""
        if not self.marks and not self.rows:
            return ("starting: tokenizing the first window of rows, then the first forward pass"
                    if not self.tokenized_rows else "starting: the first forward pass")
        parts = [f"{self.tokens_per_s(elapsed):,.0f} tok/s"]
        if self.padded_tokens:
            parts.append(f"pad eff {self.real_tokens / self.padded_tokens:.1%}")
        eta = self.eta_seconds(total_rows, elapsed)
        if eta == 0 and self.tokens_left(total_rows):  # a forward slower than the rate said: say what runs
            parts.append(f"ETA overdue (no batch through for {tqdm.format_interval(self.clock() - self.marks[-1][0])})")
        elif eta is not None:
            parts.append(f"ETA {tqdm.format_interval(eta)}")
        return ", ".join(parts)

    def eta_seconds(self, total_rows: int | None, elapsed: float) -> float | None:
        """Seconds left: the tokens still to compute at the recent rate (a row costs what it computes, not its
        length: a repeat costs nothing), as of the last batch through, counting down since (down to 0)."""
        left = self.tokens_left(total_rows)
        if not left:
            return left  # None: not known; 0: none left
        rate = self.tokens_per_s(elapsed)
        if rate <= 0:
            return None
        since = self.clock() - self.marks[-1][0] if self.marks else 0.0
        return max(0.0, left / rate - since)

    def tokens_left(self, total_rows: int | None) -> float | None:
        """Tokens still to compute: exact once every row is tokenized; before, as planned, else extrapolated from
        the rows tokenized so far (None: neither is known)."""
        if total_rows is not None and self.tokenized_rows >= total_rows:
            expected: float = self.tokenized_tokens
        elif self.tokens_to_go is not None:
            expected = max(self.tokens_to_go, self.tokenized_tokens)
        elif total_rows and self.tokenized_rows:
            expected = self.tokenized_tokens / self.tokenized_rows * total_rows
        else:
            return None
        return max(0.0, expected - self.real_tokens)
