"""How fast the writer stores hidden states, against what the filesystem takes from plain writes.

`writer_bench` (`streamx bench-writer`) pushes synthetic, non-zero bf16 batches through
the real writer thread (`WriterStage` + `PartWriter`, a fresh store each round) and, interleaved
with it in rounds, writes the same bytes with plain sequential `os.write` calls into files of
one shard each: the most any writer can reach on that filesystem. Each of P processes writes
its own share, as torchrun ranks write their own parts; the figure for P is the total bytes over
the wall time from the first process's start to the last one's end.

`write_ceiling` is the plain-write figure alone, which `streamx bench` measures on its `--out`
filesystem to say whether the disk or the writer binds.

Every timed pass starts after `os.sync()` (untimed), so that one pass's dirty pages are not
written back during the next; `sync=True` adds a final `os.sync()` inside the timing (bytes on
disk rather than in the page cache). A first untimed plain pass warms the page allocator.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..base.threads import Worker, put
from ..data.batching import make_packed_batch
from ..data.tokenize import REJECT_REASONS, Sample
from ..model.transfer import HostBatch
from ..pipeline.metrics import QueueFill, StageTimes
from ..pipeline.writer import CapturedBatch, PartWriter, RejectRate, WriterStage
from ..store import Compat, OwnedPart, Store, StoreMetadata, make_layout, open_for_run, prepare

MODES = ("plain", "writer")


@dataclass(frozen=True)
class WriteWorkload:
    total_bytes: int = 2 << 30  # hidden-state bytes over all processes, per pass
    num_slots: int = 6  # K
    hidden_size: int = 4096  # H
    sample_tokens: int = 800  # mean sample length; lengths are drawn from [1/2, 3/2] of it
    batch_tokens: int = 8192  # tokens per packed batch handed to the writer
    rounds: int = 3
    sync: bool = False

    @property
    def token_bytes(self) -> int:
        return self.num_slots * self.hidden_size * 2


def _batches(w: WriteWorkload, nbytes: int, seed: int) -> Iterator[CapturedBatch]:
    """Batches of random-length samples adding up to `nbytes` of states. The states are one random
    bf16 pool (non-zero normals) reused by every batch, so that generating them is not timed."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.empty(w.batch_tokens, w.num_slots, w.hidden_size, dtype=torch.bfloat16)
    for i in range(0, w.batch_tokens, 512):  # in slices: no full-size fp32 temporary
        pool[i : i + 512] = torch.randn(pool[i : i + 512].shape, generator=g).to(torch.bfloat16)
    rng = np.random.default_rng(seed)
    remaining, row_id = nbytes // w.token_bytes, 0
    while remaining > 0:
        samples, used = [], 0
        while remaining > 0:
            n = min(int(rng.integers(w.sample_tokens // 2, w.sample_tokens * 3 // 2 + 1)), remaining)
            if used + n > w.batch_tokens:
                break
            ids = torch.from_numpy(rng.integers(0, 150_000, n))
            samples.append(Sample(row_id, ids, (ids % 2).long()))
            used, remaining, row_id = used + n, remaining - n, row_id + 1
        yield CapturedBatch(make_packed_batch(samples), HostBatch(pool[:used],
                                                                  torch.ones(len(samples), dtype=torch.bool)))


def _plain_pass(directory: Path, batches: list[CapturedBatch], file_bytes: int) -> int:
    """The batches' state bytes, in order, by plain os.write into files of `file_bytes` each."""
    written, fd = 0, -1
    try:
        for batch in batches:
            view = memoryview(batch.host.hidden.view(torch.int16).numpy()).cast("B")
            while view:
                if written % file_bytes == 0:
                    if fd >= 0:
                        os.close(fd)
                    name = directory / f"plain-{written // file_bytes:06d}"
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                n = os.write(fd, view[: file_bytes - written % file_bytes])
                view, written = view[n:], written + n
    finally:
        if fd >= 0:
            os.close(fd)
    return written


def _open_writer(path: Path, w: WriteWorkload) -> PartWriter:
    layout = make_layout(w.num_slots, w.hidden_size)
    metadata = StoreMetadata(
        layer_ids=list(range(w.num_slots)), num_layers=w.num_slots, hidden_size=w.hidden_size,
        chunk_tokens=layout.chunk_tokens, shard_tokens=layout.shard_tokens, compressor=layout.compressor,
        model={"model": "synthetic (streamx bench --writer-only)"}, tokenizer={}, max_length=0, truncation="",
        config={}, versions={}, reject_reasons=list(REJECT_REASONS),
        compat=Compat(model="synthetic", compute_dtype="bfloat16", layer_ids=list(range(w.num_slots)),
                      tokenization="", data="synthetic", split=""))
    root = prepare(str(path), metadata)
    return PartWriter(OwnedPart(str(path), "part-00000").open(open_for_run(str(path), metadata, root), layout))


def _writer_pass(writer: PartWriter, batches: list[CapturedBatch]) -> float:
    """The batches through the writer thread, as `streamx run` hands them over, up to the closed
    part; returns the writer's busy seconds."""
    items: queue.Queue = queue.Queue(maxsize=4)
    times, failed = StageTimes(), threading.Event()
    stage = WriterStage(writer, set(), RejectRate(1.0), times)
    thread = Worker("streamx-writer", lambda: stage.run(items, failed, QueueFill(items)), failed)
    thread.start()
    for item in [*batches, None]:
        put(items, item, failed)
    thread.join()
    if thread.error is not None:
        raise thread.error
    return times.totals().get("write", 0.0)


def _process(rank: int, w: WriteWorkload, directory: str, barrier, results) -> None:
    """One writer process: all rounds, in step with the others."""
    try:
        nbytes = w.total_bytes // (barrier.parties)
        batches = list(_batches(w, nbytes, seed=rank))
        state_bytes = sum(b.batch.num_tokens for b in batches) * w.token_bytes
        file_bytes = make_layout(w.num_slots, w.hidden_size).shard_tokens * w.token_bytes
        scratch = Path(directory) / f"p{rank}"
        passes = [("warmup", "plain")] + [(r, m) for r in range(w.rounds)
                                          for m in (MODES if r % 2 == 0 else MODES[::-1])]
        for round_, mode in passes:
            scratch.mkdir(parents=True, exist_ok=True)
            barrier.wait()
            if rank == 0:
                os.sync()  # the previous pass's dirty pages go to disk before anyone is timed
            barrier.wait()
            writer = _open_writer(scratch / "store.zarr", w) if mode == "writer" else None  # setup: not timed
            start = time.monotonic()
            if writer is None:
                written, busy = _plain_pass(scratch, batches, file_bytes), 0.0
            else:
                written, busy = state_bytes, _writer_pass(writer, batches)
            if w.sync:
                os.sync()
            end = time.monotonic()
            if writer is not None:  # what was timed is what a reader gets: every token committed
                committed = Store(str(scratch / "store.zarr")).num_tokens * w.token_bytes
                if committed != written:
                    raise RuntimeError(f"the writer committed {committed} bytes of {written}")
            shutil.rmtree(scratch)
            results.put({"rank": rank, "round": round_, "mode": mode, "start": start, "end": end, "bytes": written,
                         "busy": busy})
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which stops the others
        results.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})
        barrier.abort()


def _run_processes(w: WriteWorkload, processes: int, directory: str) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")  # fresh interpreters: no torch or zarr threads inherited from a fork
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_process, args=(r, w, directory, barrier, results), daemon=True)
             for r in range(processes)]
    for p in procs:
        p.start()
    expected = processes * (1 + 2 * w.rounds)
    records: list[dict[str, Any]] = []
    try:
        while len(records) < expected:
            try:
                record = results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("writer bench processes ended without reporting") from None
                continue
            if "error" in record:
                raise RuntimeError(f"writer bench process {record['rank']}: {record['error']}")
            records.append(record)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return records


def writer_bench(w: WriteWorkload, directory: str | None = None, processes: tuple[int, ...] = (1, 2),
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """The writer against plain writes for each process count. `ratio` compares totals over the
    rounds; `best_ratio` the fastest pass of each mode (on a noisy machine, noise only slows a pass)."""
    report: dict[str, Any] = {"workload": asdict(w), "processes": {}}
    with tempfile.TemporaryDirectory(prefix="streamx-writebench-", dir=directory) as tmp:
        report["directory"] = str(Path(tmp).parent.resolve())
        for p in processes:
            records = [r for r in _run_processes(w, p, tmp) if r["round"] != "warmup"]
            modes: dict[str, Any] = {}
            for mode in MODES:
                passes = []  # (bytes, seconds) of each round, all processes together
                for r in range(w.rounds):
                    rs = [x for x in records if x["mode"] == mode and x["round"] == r]
                    seconds = max(x["end"] for x in rs) - min(x["start"] for x in rs)
                    passes.append((sum(x["bytes"] for x in rs), seconds))
                modes[mode] = {"bytes_per_s": sum(b for b, _ in passes) / sum(s for _, s in passes),
                               "best_bytes_per_s": max(b / s for b, s in passes),
                               "rounds_bytes_per_s": [b / s for b, s in passes], "bytes_per_pass": passes[0][0]}
            writes = [x for x in records if x["mode"] == "writer"]
            busy = sum(x["busy"] for x in writes)
            modes["writer"]["busy_bytes_per_s_per_process"] = sum(x["bytes"] for x in writes) / busy if busy else None
            modes["ratio"] = modes["writer"]["bytes_per_s"] / modes["plain"]["bytes_per_s"]
            modes["best_ratio"] = modes["writer"]["best_bytes_per_s"] / modes["plain"]["best_bytes_per_s"]
            report["processes"][p] = modes
            log(f"{p} process{'es' if p > 1 else ''}: plain {modes['plain']['bytes_per_s'] / 1e9:.2f} GB/s, "
                f"writer {modes['writer']['bytes_per_s'] / 1e9:.2f} GB/s, writer / plain {modes['ratio']:.3f} "
                f"(best passes {modes['best_ratio']:.3f})")
    return report


def write_ceiling(directory: str | None, nbytes: int = 1 << 30, passes: int = 2) -> float:
    """Bytes per second of plain sequential writes (files of 256 MiB, page cache) into `directory`."""
    w = WriteWorkload(total_bytes=nbytes, num_slots=1, hidden_size=4096, batch_tokens=8192)
    batches = list(_batches(w, nbytes, seed=0))
    speeds = []
    with tempfile.TemporaryDirectory(prefix="streamx-ceiling-", dir=directory) as tmp:
        for _ in range(passes + 1):  # the first pass warms the page allocator
            os.sync()
            start = time.perf_counter()
            written = _plain_pass(Path(tmp), batches, 256 << 20)
            speeds.append(written / (time.perf_counter() - start))
            for f in Path(tmp).iterdir():
                f.unlink()
    return sum(speeds[1:]) / passes


def format_writer_report(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"writer bench in {report['directory']}: {w['total_bytes'] / 2**30:.1f} GiB per pass, K={w['num_slots']}, "
             f"H={w['hidden_size']}, ~{w['sample_tokens']}-token samples, {w['rounds']} rounds, "
             + ("os.sync() timed (bytes on disk)" if w["sync"] else "page cache (no sync)"),
             f"{'processes':>9}{'plain GB/s':>12}{'writer GB/s':>13}{'writer/plain':>14}{'best passes':>13}"
             "  per round writer/plain"]
    for p, m in report["processes"].items():
        pairs = zip(m["writer"]["rounds_bytes_per_s"], m["plain"]["rounds_bytes_per_s"], strict=True)
        per_round = " ".join(f"{a / b:.2f}" for a, b in pairs)
        lines.append(f"{p:>9}{m['plain']['bytes_per_s'] / 1e9:>12.2f}{m['writer']['bytes_per_s'] / 1e9:>13.2f}"
                     f"{m['ratio']:>14.3f}{m['best_ratio']:>13.3f}  {per_round}")
    return "\n".join(lines)
