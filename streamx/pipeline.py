"""`streamx run`: the stages of one run, their threads and the bounded queues between them.

    producer thread   source -> tokenize -> batching          --batches-->
    main thread       capture/pack on the model's device       --to_write-->
    writer thread     host hand-off -> store part (its committer thread commits shards)

Queues are bounded (`queue_batches`), so host memory does not grow with the dataset. The
first exception in any thread sets `stop`, every stage winds down, and the main thread
re-raises it; whatever was committed stays committed and a re-run resumes from it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from tqdm import tqdm

from .batching import Batch, iter_windows
from .capture import LayerCapture, sample_is_finite
from .config import RunConfig
from .fp8 import FP8, quantize_fp8
from .metrics import QueueFill, StageTimes, Throughput
from .pack import select_pack_fn
from .plan import RunPlan, make_plan
from .store import SpaceGuard, open_for_run, open_store, prepare
from .tokenize import Reject
from .transfer import HostTransfer
from .writer import PackedBatch, PartWriter, RejectRate, write_loop


@dataclass
class RunSummary:
    out: str
    layer_ids: list[int]
    num_layers: int
    samples: int  # committed by this run (this process's part)
    tokens: int
    trainable_tokens: int
    rejects: int
    reject_counts: dict[str, int]
    hidden_bytes: int
    real_tokens: int  # tokens through the forward pass (including any later rejected as non-finite)
    padded_tokens: int
    resumed_rows: int  # rows skipped because an earlier run committed them
    seconds: float
    stage_seconds: dict[str, float]  # busy time per stage (source_tokenize, batching, forward, pack, quantize, d2h,
    # write)
    queue_fill: dict[str, float]  # mean occupancy (0..1) of the two bounded queues when read
    store_samples: int = 0  # the whole store after this run
    store_tokens: int = 0
    rank: int = 0  # this process's rank under torchrun

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


class Worker(threading.Thread):
    """A daemon thread whose exception is kept for the main thread, and which sets `stop`."""

    def __init__(self, name: str, target: Callable[[], None], stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self._target_fn, self.stop, self.error = target, stop, None

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self.error = err
            self.stop.set()


def put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    """Put, waiting for room, unless the run stops meanwhile."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _drain(q: queue.Queue, stop: threading.Event, workers: list[Worker]) -> Iterator[Any]:
    """Items until the None sentinel; raises a worker's error as soon as one stops."""

    def raise_worker_error() -> None:
        for w in workers:
            if w.error is not None:
                raise w.error

    while True:
        raise_worker_error()
        try:
            item = q.get(timeout=0.1)
        except queue.Empty:
            if stop.is_set():  # a worker records its error before it sets stop: look again
                raise_worker_error()
                raise RuntimeError("a pipeline thread stopped without an error") from None
            continue
        if item is None:
            return
        yield item


class Progress:
    """The live bar: rows done, tokens/s, padding efficiency and a token-driven ETA, redrawn every
    `interval` seconds even while a long batch runs."""

    def __init__(self, counts: Throughput, total_rows: int | None, desc: str, disable: bool, interval: float = 1.0):
        self.counts, self.total_rows, self.interval = counts, total_rows, interval
        self.bar = tqdm(total=total_rows, unit="row", desc=desc, disable=disable, dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}{postfix}]")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="streamx-progress", daemon=True)

    def __enter__(self) -> Progress:
        if not self.bar.disable:
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.draw()
        self.bar.close()

    def draw(self) -> None:
        c = self.counts
        self.bar.n = c.rows
        elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
        parts = [f"{c.real_tokens / elapsed:,.0f} tok/s"]
        if c.padded_tokens:
            parts.append(f"pad eff {c.real_tokens / c.padded_tokens:.1%}")
        eta = c.eta_seconds(self.total_rows, elapsed)
        if eta is not None:
            parts.append(f"ETA {tqdm.format_interval(eta)}")
        self.bar.set_postfix_str(", ".join(parts))  # and redraws

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self.draw()


class Pipeline:
    """One process's run: the three stages, the queues between them and what they measure."""

    def __init__(self, plan: RunPlan, writer: PartWriter, done: set[int]):
        self.plan, self.writer, self.done = plan, writer, done
        cfg = plan.config
        self.stop = threading.Event()
        self.batches: queue.Queue = queue.Queue(maxsize=cfg.queue_batches)
        self.to_write: queue.Queue = queue.Queue(maxsize=cfg.queue_batches)
        self.times = StageTimes()
        self.fill = {"batches": QueueFill(self.batches), "to_write": QueueFill(self.to_write)}
        self.counts = Throughput()

    def produce(self) -> None:
        """Producer thread: this rank's windows of source rows, tokenized and batched."""
        plan, done, rank = self.plan, self.done, self.plan.rank
        pin = plan.device.type == "cuda"  # pinned batches: host-to-device copies run async
        for window in iter_windows(plan.source, plan.config.sort_window):
            if (window[0].row_id // plan.config.sort_window) % rank.world_size != rank.rank:
                continue  # another rank's window
            if all(row.row_id in done for row in window):
                continue
            with self.times.measure("source_tokenize"):
                samples = plan.tokenize(window)
            self.counts.tokenized_rows += len(window)
            self.counts.tokenized_tokens += sum(len(s.input_ids) for s in samples if not isinstance(s, Reject))
            with self.times.measure("batching"):
                items = list(plan.batches(samples))
            for item in items:
                rows = [item.row_id] if isinstance(item, Reject) else [s.row_id for s in item.samples]
                if all(r in done for r in rows):  # the writer drops done rows of partly done batches
                    continue
                if isinstance(item, Batch) and pin:
                    item.pin_memory()
                put(self.batches, item, self.stop)
                if self.stop.is_set():
                    return
        put(self.batches, None, self.stop)

    def compute(self, workers: list[Worker]) -> None:
        """Main thread: each batch through the model with the capture hooks, handed to the writer."""
        plan, device = self.plan, self.plan.device
        K, H = len(plan.layer_ids), plan.info.hidden_size
        fp8 = plan.config.storage == "fp8"
        transfer = HostTransfer(device, plan.config.token_budget, K, H, num_buffers=plan.config.queue_batches + 2,
                                stop=self.stop, hidden_dtype=FP8 if fp8 else torch.bfloat16)
        pack = select_pack_fn(plan.config.kernel, device)

        def timed_pack(packed: torch.Tensor, slot: int, hidden: torch.Tensor, token_index: torch.Tensor) -> None:
            with self.times.measure("pack", device):
                pack(packed, slot, hidden, token_index)

        with LayerCapture(plan.model, plan.layer_ids, timed_pack) as capture:
            for item in _drain(self.batches, self.stop, workers):
                self.fill["batches"].record()
                if isinstance(item, Reject):
                    put(self.to_write, item, self.stop)
                    self.counts.rows += 1
                    continue
                packed = torch.empty((item.num_tokens, K, H), dtype=torch.bfloat16, device=device)
                with self.times.measure("forward", device):
                    capture.forward(item, packed)
                    finite = sample_is_finite(packed, item.sample_index, len(item.samples))
                scales = None
                if fp8:  # on the device, so the host copy and the writer move half the bytes
                    with self.times.measure("quantize", device):
                        packed, scales = quantize_fp8(packed)
                with self.times.measure("d2h", device):
                    host = transfer.start(packed, finite, scales)
                put(self.to_write, PackedBatch(item.samples, host), self.stop)
                self.counts.rows += len(item.samples)
                self.counts.real_tokens += item.num_tokens
                self.counts.padded_tokens += item.padded_tokens
        put(self.to_write, None, self.stop)

    def run(self) -> None:
        rate = RejectRate(self.plan.config.max_reject_fraction)
        producer = Worker("streamx-producer", self.produce, self.stop)
        writer = Worker("streamx-writer", lambda: write_loop(self.to_write, self.writer, self.stop, self.done, rate,
                                                               self.times, self.fill["to_write"]), self.stop)
        producer.start()
        writer.start()
        try:
            self.compute([producer, writer])
            writer.join()
            if writer.error is not None:
                raise writer.error
        finally:
            self.stop.set()  # no-op after a clean finish; otherwise winds the threads down
            producer.join(timeout=5)
            writer.join(timeout=30)

    def stage_seconds(self) -> dict[str, float]:
        seconds = self.times.totals()
        seconds["forward"] = seconds.get("forward", 0.0) - seconds.get("pack", 0.0)  # the hooks run inside
        return seconds


def run(config: RunConfig | RunPlan, progress: bool = True, log: Callable[[str], None] = print) -> RunSummary:
    """Run the pipeline into config.out: a RunConfig is planned first (model loaded); a RunPlan is used as is."""
    started = time.perf_counter()
    if not progress:
        transformers.utils.logging.disable_progress_bar()  # its weight-loading bar too
    plan = config if isinstance(config, RunPlan) else make_plan(config, log=log)
    cfg, rank = plan.config, plan.rank
    if rank.is_main:  # creates (or checks and reopens) the store before any other rank opens it
        prepare(cfg.out, plan.metadata, cfg.overwrite)
    rank.barrier()
    target = open_for_run(cfg.out, plan.metadata)
    rank.barrier()  # every rank has read the same committed set before any rank creates its part or commits
    if target.done_rows and rank.is_main:
        log(f"resuming {cfg.out}: {len(target.done_rows)} rows already committed")
    space = SpaceGuard.for_layout(cfg.out, plan.layout) if cfg.space_check else None
    writer = PartWriter(target.part(rank.part_name, plan.layout), space)
    pipeline = Pipeline(plan, writer, target.done_rows)

    total = None if plan.source.num_rows is None else max(0, plan.source.num_rows - len(target.done_rows))
    if total is not None and rank.world_size > 1:
        total = -(-total // rank.world_size)  # about this rank's share
    desc = "streamx run" if rank.world_size == 1 else f"streamx run [rank {rank.rank}]"
    with Progress(pipeline.counts, total, desc, disable=not progress):
        pipeline.run()
    rank.barrier()  # the store is complete when every rank has closed its part
    store = open_store(cfg.out)
    written = writer.this_run()
    return RunSummary(
        out=cfg.out, layer_ids=plan.layer_ids, num_layers=plan.info.num_layers, samples=written.samples,
        tokens=written.tokens, trainable_tokens=written.trainable_tokens, rejects=written.rejects,
        reject_counts=written.reject_counts, hidden_bytes=written.tokens * plan.layout.bytes_per_token,
        real_tokens=pipeline.counts.real_tokens, padded_tokens=pipeline.counts.padded_tokens,
        resumed_rows=len(target.done_rows),
        seconds=time.perf_counter() - started, stage_seconds=pipeline.stage_seconds(),
        queue_fill={name: fill.mean for name, fill in pipeline.fill.items()},
        store_samples=len(store), store_tokens=store.num_tokens, rank=rank.rank,
    )
