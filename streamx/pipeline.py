"""`streamx run`: wires the stages and owns their threads.

    producer thread   source -> tokenize -> batching          --queue-->
    main thread       capture/pack on the model's device       --queue-->
    writer thread     host hand-off -> store part, commits

Queues are bounded (`queue_batches`), so host memory does not grow with the dataset. The
first exception in any thread sets `stop`, every stage winds down, and the main thread
re-raises it; whatever was committed stays committed and a re-run resumes from it.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import torch
import transformers
import zarr
from tqdm import tqdm

from . import __version__
from .batching import Batch, iter_batches, iter_windows
from .capture import LayerCapture, sample_is_finite
from .config import RunConfig, resolve_layer_ids
from .distributed import init_from_env
from .models import ModelInfo, load_model
from .pack import select_pack_fn
from .source import open_source
from .store import STORE_FORMAT, Layout, create_or_open, make_layout, open_for_append, open_store
from .timing import StageTimes
from .tokenize import REJECT_REASONS, Reject, SampleBuilder
from .transfer import HostTransfer
from .writer import PackedBatch, PartWriter, WriteCounts, write_loop

CONVENTION = (
    "speculators: id 0 = embeddings output (input of layer 0); id k = output of decoder layer k-1 "
    "(input of layer k); id L = output of the last decoder layer, before the final norm"
)


@dataclass
class RunSummary:
    out: str
    layer_ids: list[int]
    num_layers: int
    samples: int  # committed by this run
    tokens: int
    trainable_tokens: int
    rejects: int
    reject_counts: dict[str, int]
    hidden_bytes: int
    real_tokens: int  # tokens through the forward pass (including any later rejected as non-finite)
    padded_tokens: int
    resumed_rows: int  # rows skipped because an earlier run committed them
    seconds: float
    stage_seconds: dict[str, float]  # busy time per stage (source_tokenize, batching, forward, pack, d2h, write)
    queue_fill: dict[str, float]  # mean occupancy (0..1) of the two bounded queues when read
    store_samples: int = 0  # the whole store after this run
    store_tokens: int = 0
    rank: int = 0  # this process's rank under torchrun

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


def store_metadata(config: RunConfig, info: ModelInfo, builder: SampleBuilder, layer_ids: list[int],
                   layout: Layout) -> dict[str, Any]:
    """What a store records (docs/store.md, "Metadata"); `compat` decides whether a re-run may resume."""
    template = builder.tokenizer.chat_template or ""
    compat = {
        "model": info.weights_fingerprint,
        "compute_dtype": info.dtype,
        "layer_ids": layer_ids,
        "tokenization": builder.fingerprint,
        "data": config.data,
        "split": config.split,
    }
    return {
        "format": STORE_FORMAT,
        "layer_ids": layer_ids,
        "layer_convention": "speculators",
        "layer_convention_text": CONVENTION,
        "last_id_is_pre_norm": True,
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "num_slots": len(layer_ids),
        "hidden_states_dtype": "bfloat16",
        "hidden_states_encoding": "uint16 bit pattern of bfloat16 (zarr 3.1 has no bfloat16); bit-exact",
        "bytes_per_token": layout.bytes_per_token,
        "chunk_tokens": layout.chunk_tokens,
        "shard_tokens": layout.shard_tokens,
        "compressor": layout.compressor,
        "model": asdict(info),
        "tokenizer": {
            "name_or_path": builder.tokenizer.name_or_path,
            "fingerprint": builder.fingerprint,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        },
        "max_length": config.max_length,
        "truncation": config.truncation,
        "config": config.to_dict(),
        "versions": {"streamx": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "zarr": zarr.__version__},
        "reject_reasons": list(REJECT_REASONS),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "compat": compat,
    }


class _Worker(threading.Thread):
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


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _drain(q: queue.Queue, stop: threading.Event, workers: list[_Worker]) -> Iterator[Any]:
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
                raise RuntimeError("a pipeline thread stopped without an error")
            continue
        if item is None:
            return
        yield item


def run(config: RunConfig, progress: bool = True, log: Callable[[str], None] = print,
        loaded: tuple[Any, Any, ModelInfo] | None = None) -> RunSummary:
    """Run the pipeline; `loaded` = load_model(...)'s result lets callers (bench) reuse a loaded model."""
    started = time.perf_counter()
    if not progress:
        transformers.utils.logging.disable_progress_bar()  # its weight-loading bar too
    rank = init_from_env()
    model, tokenizer, info = loaded or load_model(config.model, config.dtype, rank.device(config.device),
                                                  config.attn_implementation, config.device_map,
                                                  config.random_weights, config.tokenizer)
    if info.random_weights and rank.is_main:
        log(f"{config.model}: random weights (--random-weights); the store is for measurement, not training")
    layer_ids = resolve_layer_ids(config.layers, info.num_layers)
    builder = SampleBuilder(tokenizer, config.max_length, config.truncation)
    source = open_source(config.data, config.split, config.max_samples)
    layout = make_layout(len(layer_ids), info.hidden_size, config.chunk_tokens, config.shard_tokens, config.compressor)
    metadata = store_metadata(config, info, builder, layer_ids, layout)
    if rank.is_main:  # creates (or checks and reopens) the store before any other rank opens it
        create_or_open(config.out, metadata, config.overwrite)
    rank.barrier()
    root = open_for_append(config.out, metadata)
    done = open_store(config.out).done_row_ids()
    rank.barrier()  # every rank has read the same committed set before any rank commits more
    if done and rank.is_main:
        log(f"resuming {config.out}: {len(done)} rows already committed")
    writer = PartWriter(root, rank.part_name, layout)

    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stop = threading.Event()
    batches: queue.Queue = queue.Queue(maxsize=config.queue_batches)
    to_write: queue.Queue = queue.Queue(maxsize=config.queue_batches)
    counts = WriteCounts()
    times = StageTimes()
    fill = {"batches": [0, 0], "to_write": [0, 0]}  # [sum of queue sizes seen by the consumer, reads]

    def produce() -> None:
        for window in iter_windows(source, config.sort_window):
            if (window[0].row_id // config.sort_window) % rank.world_size != rank.rank:
                continue  # another rank's window
            if all(row.row_id in done for row in window):
                continue
            with times.measure("source_tokenize"):
                tokenized = [builder(row) for row in window]
            with times.measure("batching"):
                window_batches = list(iter_batches(tokenized, config.token_budget, config.max_batch_size, pad_id))
            for item in window_batches:
                rows = [item.row_id] if isinstance(item, Reject) else [s.row_id for s in item.samples]
                if all(r in done for r in rows):  # the writer drops done rows of partly done batches
                    continue
                if isinstance(item, Batch) and device.type == "cuda":  # pinned: host-to-device copies run async
                    item.pin_memory()
                _put(batches, item, stop)
                if stop.is_set():
                    return
        _put(batches, None, stop)

    producer = _Worker("streamx-producer", produce, stop)
    writer_thread = _Worker("streamx-writer", lambda: write_loop(to_write, writer, counts, stop, done,
                                                                 config.max_reject_fraction, times, fill), stop)
    transfer = HostTransfer(device, config.token_budget, len(layer_ids), info.hidden_size,
                            num_buffers=config.queue_batches + 2, stop=stop)
    total = None if source.num_rows is None else max(0, source.num_rows - len(done))
    if total is not None and rank.world_size > 1:
        total = -(-total // rank.world_size)  # about this rank's share
    bar = tqdm(total=total, unit="sample", disable=not progress, dynamic_ncols=True,
               desc="streamx run" if rank.world_size == 1 else f"streamx run [rank {rank.rank}]")
    real = padded = 0
    pack = select_pack_fn(config.kernel, device)

    def pack_fn(packed: torch.Tensor, slot: int, hidden: torch.Tensor, token_index: torch.Tensor) -> None:
        with times.measure("pack", device):
            pack(packed, slot, hidden, token_index)
    producer.start()
    writer_thread.start()
    try:
        with LayerCapture(model, layer_ids, pack_fn) as capture:
            for item in _drain(batches, stop, [producer, writer_thread]):
                fill["batches"][0] += batches.qsize() + 1
                fill["batches"][1] += 1
                if isinstance(item, Reject):
                    _put(to_write, item, stop)
                    bar.update(1)
                    continue
                packed = torch.empty((item.num_tokens, len(layer_ids), info.hidden_size), dtype=torch.bfloat16,
                                     device=device)
                with times.measure("forward", device):
                    capture.forward(item, packed)
                    finite = sample_is_finite(packed, item.sample_index, len(item.samples))
                with times.measure("d2h", device):
                    host = transfer.start(packed, finite)
                _put(to_write, PackedBatch(item.samples, host), stop)
                real += item.num_tokens
                padded += item.padded_tokens
                bar.update(len(item.samples))
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix(tok_s=f"{real / elapsed:,.0f}", pad_eff=f"{real / padded:.1%}", refresh=False)
        _put(to_write, None, stop)
        writer_thread.join()
        if writer_thread.error is not None:
            raise writer_thread.error
    finally:
        stop.set()  # no-op after a clean finish; otherwise winds the threads down
        bar.close()
        producer.join(timeout=5)
        writer_thread.join(timeout=30)
    rank.barrier()  # the store is complete when every rank has closed its part
    store = open_store(config.out)
    stage_seconds = times.totals()
    stage_seconds["forward"] = stage_seconds.get("forward", 0.0) - stage_seconds.get("pack", 0.0)  # hooks run inside
    return RunSummary(
        out=config.out, layer_ids=layer_ids, num_layers=info.num_layers, samples=counts.samples, tokens=counts.tokens,
        trainable_tokens=counts.trainable_tokens, rejects=counts.rejects, reject_counts=dict(counts.reject_counts),
        hidden_bytes=counts.bytes, real_tokens=real, padded_tokens=padded, resumed_rows=len(done),
        seconds=time.perf_counter() - started, stage_seconds=stage_seconds,
        queue_fill={name: total / max(reads, 1) / config.queue_batches for name, (total, reads) in fill.items()},
        store_samples=len(store),
        store_tokens=store.num_tokens, rank=rank.rank,
    )
