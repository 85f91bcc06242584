"""`streamx run`: the stages of one run, their threads and the bounded queues between them.

    producer thread   RunPlan.batch_stream: source -> tokenize -> batching   --batches-->
    main thread       capture + gather on the model's device (+ fp8)         --to_write-->
    writer thread     host hand-off -> store part (its committer thread commits shards)

Queues are bounded (`queue_batches`), so host memory does not grow with the dataset. The
first exception in any thread sets `failed`, every stage gives up (streamx.base.threads), and the
main thread raises it; whatever was committed stays committed and a re-run resumes from it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..base.locks import LockedError
from ..base.progress import Progress
from ..base.threads import SignalStop, Stopped, Worker, first_error, get, put
from ..base.units import gb
from ..config import RunConfig
from ..data.batching import Batch
from ..data.fanout import FanOut
from ..data.provenance import RowDigests
from ..data.tokenize import Duplicate, Reject
from ..model.capture import LayerCapture, segment_is_finite
from ..model.gather import select_gather_fn
from ..model.load import library_bars
from ..model.packing import padded_attention
from ..model.transfer import HostTransfer
from ..proof.audit import Audit, Finding, not_reference, ways_of
from ..proof.ladder import Ladder
from ..store import PARTS, Audited, DoneKeys, OwnedPart, RunStore, SharedKinds, SpaceGuard, Store, open_for_run, prepare
from .heal import heal, ranged, unranged
from .metrics import QueueFill, StageTimes, Throughput
from .plan import RunPlan, make_plan
from .ranks import Rank, init_from_env
from .tensor_parallel import GroupWord, Word
from .writer import CapturedBatch, PartWriter, RejectRate, WriterStage


@dataclass
class RunSummary:
    out: str
    layer_ids: list[int]
    num_layers: int
    samples: int  # committed by this run (this process's part)
    tokens: int  # stored (with --sharing, each token rows share once)
    trainable_tokens: int
    duplicates: int  # committed samples whose content repeats an earlier row's (kept: --skip-duplicates off)
    rejects: int
    reject_counts: dict[str, int]
    hidden_bytes: int
    real_tokens: int  # tokens through the forward pass (including any later rejected as non-finite)
    padded_tokens: int
    resumed_rows: int  # rows skipped because an earlier run committed them
    seconds: float
    stage_seconds: dict[str, float]  # busy time per stage (source_tokenize, batching, forward, gather, quantize,
    # d2h, write)
    queue_fill: dict[str, float]  # mean occupancy (0..1) of the two bounded queues when read
    store_samples: int = 0  # the whole store after this run
    store_tokens: int = 0
    rank: int = 0  # this process's rank under torchrun
    row_tokens: int = 0  # the committed samples' tokens, as if nothing were shared
    stopped_by: str | None = None  # the signal that ended the run early (SIGINT, SIGTERM), None when it ran to the end
    incomplete: list[str] = field(default_factory=list)  # why the store does not hold all its data yet (empty: it does)
    cut_rows: int = 0  # committed samples whose row was longer than --max-length, cut there
    cut_tokens: int = 0  # their tokens past it, not stored
    max_length: int = 0
    shared: SharedKinds | None = None  # what the whole store's rows share, by kind (None: not read, other ranks)
    cpu_seconds: float = 0.0  # the process's CPU time over the run, every thread's
    cores: int = 1  # the cores the process may run on
    stored_again: int = 0  # tokens a resume stored again: the shared prefixes that later rows continue
    store_waiting: int = 0  # the store's committed rows that repeat rows not committed yet (Store.waiting_rows)
    fanout: str | None = None  # rows that extend an earlier row's messages but not its tokens (FanOut.note)
    tp_rank: int = 0  # within its tensor-parallel group (--tp): the others only run the forward with the first
    audit: Audited | None = None  # what the in-run audit did (None: --audit-every 0)

    @property
    def tokens_per_s(self) -> float:
        """Tokens through the model per second of the whole run (loading and planning included)."""
        return self.real_tokens / self.seconds if self.seconds else 0.0

    @property
    def cpu_share(self) -> float:
        """The CPU time the process got of all its cores' time over the run: low on a busy machine (or a run
        that waits on its device or disk)."""
        return self.cpu_seconds / (self.seconds * self.cores) if self.seconds else 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def committed_nothing(self) -> bool:
        """Every row this run computed was rejected (a model whose states are not finite on any row, e.g. a layer
        the forward skips): a failure, whatever else the run did."""
        return bool(self.rejects) and not self.samples

    def pace(self) -> str:
        """Why a run took its time, in one phrase: what it computed per second and the CPU it got."""
        return f"{self.tokens_per_s:,.0f} computed tokens/s, {self.cpu_share:.0%} of {self.cores} cores"

    def lines(self, command: str = "the same command") -> list[str]:
        """What `streamx run` prints when it ends (under torchrun, rank 0 the whole summary, the others one line);
        `command`: the one that resumes this run."""
        rejects = ", ".join(f"{k}: {v}" for k, v in sorted(self.reject_counts.items())) or "none"
        if self.stopped_by:
            ending = [f"stopped by {self.stopped_by}: what was written is committed, the rest is not; the store is "
                      "unfinished (convert and verify refuse it)", f"next: {command}   (resumes)"]
        elif self.incomplete:
            ending = [f"the store is unfinished: {self.incomplete[0]}" + (f" (+{len(self.incomplete) - 1} more)"
                                                                          if len(self.incomplete) > 1 else ""),
                      "next: let every rank finish (or re-run the ones that stopped), then streamx convert "
                      f"{self.out} --out SPEC_DIR"]
        else:
            ending = [f"next: streamx inspect {self.out}   |   streamx convert {self.out} --out SPEC_DIR (speculators "
                      f"training data)   |   python: streamx.open_store({self.out!r}).sample(row_id)"]
        if self.tp_rank:
            return [f"[rank {self.rank}, tensor-parallel {self.tp_rank}] ran its share of the group's forwards "
                    f"({self.real_tokens:,} tokens) in {self.seconds:.0f} s; the group's first process wrote them"]
        if self.rank and (self.incomplete or self.stopped_by):  # (the last rank to finish says it all)
            return [f"[rank {self.rank}] committed {self.samples:,} samples in {self.seconds:.0f} s ({self.pace()}), "
                    f"rejected {self.rejects:,} ({rejects})",
                    *(ending if self.stopped_by else [])]
        return [
            f"{'this run committed' if self.resumed_rows else 'committed'} {self.samples:,} samples "
            f"({self.row_tokens:,} tokens, {self.trainable_tokens:,} trainable) in "
            f"{self.seconds:.0f} s ({self.pace()}); rejected {self.rejects:,} ({rejects})",
            *([f"{self.duplicates:,} of these samples repeat an earlier row's content (--skip-duplicates leaves such "
               "rows out)"] if self.duplicates else []),
            *([f"cut at --max-length {self.max_length:,}: {self.cut_rows:,} of these samples were longer, and their "
               f"{self.cut_tokens:,} tokens past it are not stored "
               f"({self.cut_tokens / max(1, self.row_tokens + self.cut_tokens):.1%} of all their tokens; a larger "
               "--max-length keeps them, --truncation skip leaves such rows out)"] if self.cut_rows else []),
            f"layer ids {self.layer_ids} (speculators convention; id {self.num_layers} = the last layer's output "
            "before the final norm)",
            f"hidden states written: {gb(self.hidden_bytes)}; padding efficiency {self.padding_efficiency:.1%}",
            *([f"resumed: {self.resumed_rows:,} rows were committed before this run"
               + (f"; it stored again the {self.stored_again:,} tokens of shared prefixes its rows continue from the "
                  "interrupted window (docs/store.md)" if self.stored_again else "")] if self.resumed_rows else []),
            *([f"sharing: {self.row_tokens:,} row tokens computed and stored as {self.tokens:,} "
               f"({self.tokens / max(1, self.row_tokens):.1%})" + ("" if self.shared is None else
                                                                    f"; the store's rows share "
                                                                    f"{self.shared.phrase(self.store_tokens)}")]
              if self.row_tokens != self.tokens else []),
            *([f"fan-out: {self.fanout}"] if self.fanout else []),
            *([f"audit: {self.audit.phrase()}"] if self.audit is not None else []),
            f"store: {self.out} ({self.store_samples:,} samples, {self.store_tokens:,} tokens in total"
            + (f"; {self.store_waiting:,} more committed rows repeat rows not committed yet: samples once those land"
               if self.store_waiting else "") + ")",
            *ending,
        ]


class Pipeline:
    """One process's run: the three stages, the queues between them and what they measure."""

    def __init__(self, plan: RunPlan, writer: PartWriter, done: Collection[int], done_keys: DoneKeys | None = None,
                 same_as: bool = True, log: Callable[[str], None] = print):
        self.plan, self.writer, self.done, self.done_keys, self.log = plan, writer, done, done_keys, log
        self.same_as = same_as  # repeated rows read the first row with their content (a store whose parts can say so)
        cfg = plan.config
        self.failed = threading.Event()  # a stage failed: every stage gives up
        self.signalled = threading.Event()  # SIGINT/SIGTERM: no new batches, commit the rest
        self.rows_left = threading.Event()  # a stage wound up early for it (not set when the data ran out first)
        self.batches: queue.Queue = queue.Queue(maxsize=cfg.queue_batches)
        self.to_write: queue.Queue = queue.Queue(maxsize=cfg.queue_batches)
        self.times = StageTimes()
        self.fill = {"batches": QueueFill(self.batches), "to_write": QueueFill(self.to_write)}
        # --tp: the group's other processes run each forward with this one (tensor_parallel)
        self.group = GroupWord(plan.rank, plan.device) if plan.rank.tp_size > 1 else None
        planned = plan.tokens_to_compute  # (per rank: about)
        planned = None if planned is None else -(-planned // plan.rank.world_size)
        self.audit = Audit(plan.model, plan.layer_ids, plan.packing, plan.pad_token_id, cfg.audit_every,
                           cfg.audit_share, lambda: self.stage_seconds().get("forward", 0.0), planned,
                           self.announce(Word.ALONE)) if cfg.audit_every else None
        self.ladder = Ladder(plan.model, plan.packing, cfg.token_budget, cfg.max_batch_size, plan.pad_token_id)
        # what an earlier run of this part left: the rung it computed rows on, rows waiting to be computed again
        earlier = Audited.from_json(writer.opened.audit) if writer.opened.audit else Audited()
        self.earlier_coverage = earlier.coverage or {}  # the rows earlier runs computed each way (counts alone)
        self.ladder.start_at(earlier.rung)
        rows, codes = writer.committed_ways()
        self.ladder.recorded(rows, codes)  # healed too if this run drops their way
        self.unrecorded = int((codes == 0).sum())  # rows of a part from before streamx recorded their way
        self.waiting = unranged(earlier.to_heal)
        self.stage = WriterStage(writer, done, RejectRate(cfg.max_reject_fraction), self.times,
                                 lambda: plan.source_rows, self.fanout, self.audited)  # (asked after the last batch)
        self.counts = Throughput(planned)

    def announce(self, word: Word) -> Callable[[Batch], None]:
        """What tells the group's other processes (--tp) of a forward only this process decided (`word`)."""
        return (lambda batch: None) if self.group is None else (lambda batch: self.group.send(word, batch))

    def fanout(self) -> str | None:
        """What this run's chat rows fan out to that sharing cannot fold (data.fanout), once they are tokenized."""
        found = self.plan.builder.fanout
        return None if found is None else found.note(self.plan.config.train_turns)

    def audited(self) -> Audited | None:
        """The audit's figures so far, with the run's forward time, the rung the run stands on and the rows waiting
        to be computed again (asked by the writer when it closes the part, after the last batch)."""
        waiting = ranged(self.to_heal()) or None
        if self.audit is None:  # (--audit-every 0 on a resume of a run that left rows to heal: still healed)
            return Audited(rung=self.ladder.name, to_heal=waiting) if waiting or self.ladder.rung else None
        audited = self.audit.audited
        audited.forward_seconds = self.stage_seconds().get("forward", 0.0)
        audited.rung, audited.to_heal = self.ladder.name, waiting
        return audited

    def to_heal(self) -> np.ndarray:
        """The rows committed a way the run no longer takes (this run's, and those an earlier run left)."""
        return np.union1d(self.ladder.suspects(), self.waiting)

    def healed(self, rows: int) -> None:
        """The rows `to_heal` named were computed again (`rows` of them in the part)."""
        self.ladder.healed()
        self.waiting = np.zeros(0, dtype=np.int64)
        if self.audit is not None:
            self.audit.audited.recomputed += rows

    def rows_to_run(self, batch: Batch) -> int:
        """The batch's rows that this run commits (a resume's batch may hold rows committed before)."""
        return sum(s.row_id not in self.done for s in batch.samples)

    def produce(self) -> None:
        """Producer thread: this rank's batches (RunPlan.batch_stream), pinned on CUDA."""
        pin = self.plan.device.type == "cuda"  # pinned batches: host-to-device copies run async
        for item in self.plan.batch_stream(self.done, times=self.times, done_keys=self.done_keys,
                                           same_as=self.same_as, digests=self.writer.digests):
            if self.signalled.is_set():
                self.rows_left.set()
                break
            if isinstance(item, (Reject, Duplicate)):
                self.counts.tokenized(rows=1, tokens=0)
            else:
                self.counts.tokenized(rows=self.rows_to_run(item), tokens=item.num_tokens)
                if pin:
                    item.pin_memory()
            put(self.batches, item, self.failed)
        put(self.batches, None, self.failed)

    def compute(self) -> None:
        """Main thread: each batch through the model with the capture hooks, handed to the writer."""
        plan, device = self.plan, self.plan.device
        K, H, storage = len(plan.layer_ids), plan.info.hidden_size, plan.layout.storage
        transfer = HostTransfer(device, plan.config.token_budget, K, H, num_buffers=plan.config.queue_batches + 2,
                                failed=self.failed, hidden_dtype=storage.dtype)
        gather = select_gather_fn(plan.config.kernel, device)

        def timed_gather(states: torch.Tensor, slot: int, hidden: torch.Tensor, token_index: torch.Tensor) -> None:
            with self.times.measure("gather", device):
                gather(states, slot, hidden, token_index)

        if self.group is not None and self.ladder.rung:  # a resume on the rung its store records
            self.group.rung(self.ladder.rung)
        with LayerCapture(plan.model, plan.layer_ids, timed_gather) as capture, self.audit or nullcontext():
            while (item := self.next_batch()) is not None:
                self.fill["batches"].record()
                if isinstance(item, (Reject, Duplicate)):  # nothing to compute
                    put(self.to_write, item, self.failed)
                    self.counts.rows += 1
                    continue
                self.compute_rows(item, capture, transfer)
        put(self.to_write, None, self.failed)

    def compute_rows(self, batch: Batch, capture: LayerCapture, transfer: HostTransfer, planned: bool = True) -> None:
        """The rows of a batch (`planned`: as the producer made it), as the rung the run stands on computes them;
        where the audit drops a way meanwhile, the rest as the next rung does."""
        rung, pending = self.ladder.rung, self.ladder.batches(batch, self.done)
        as_planned = planned and len(pending) == 1 and pending[0] is batch
        if self.group is not None and planned and not as_planned:
            self.group.planned(batch, computed=False)  # the group computes the batches sent instead
        while pending:
            if self.ladder.rung != rung:
                rung, pending = self.ladder.rung, self.ladder.batched([row for b in pending for row in b.samples])
                as_planned = False
                continue
            self.compute_batch(pending.pop(0), capture, transfer, as_planned)

    def compute_batch(self, batch: Batch, capture: LayerCapture, transfer: HostTransfer, planned: bool) -> None:
        """One batch (`planned`: as the producer made it) through the model, audited, handed to the writer; a way
        the audit finds wrong is dropped and the batch computed again on the next rung (proof.ladder)."""
        plan, device, storage = self.plan, self.plan.device, self.plan.layout.storage
        if self.group is not None and planned:
            self.group.planned(batch)
        elif self.group is not None:  # (a batch only this process made: the rung's, or the audit's recompute)
            self.group.send(Word.BATCH, batch)
        states = torch.empty((batch.num_tokens, len(plan.layer_ids), plan.info.hidden_size), dtype=torch.bfloat16,
                             device=device)
        with self.times.measure("forward", device):
            capture.forward(batch, states)
            finite = segment_is_finite(states, batch.segment_index, len(batch.segment_lengths))
        ways = ways_of(batch, plan.packing)  # (stored per row: a resume that drops a way heals the rows too)
        if self.audit is not None:  # before the writer sees the batch
            found = self.audit.batch(batch, states, not_reference(ways))
            if found is not None:
                self.drop(found, capture)
                self.compute_rows(batch, capture, transfer, planned=False)
                self.audit.audited.recomputed += self.rows_to_run(batch)
                return
            self.ladder.record(batch, {k: way for k, way in not_reference(ways).items()
                                       if batch.samples[k].row_id not in self.done})
        scales = None
        if storage.scaled:  # on the device, so the host copy and the writer move half the bytes
            with self.times.measure("quantize", device):
                states, scales = storage.encode(states)
        with self.times.measure("d2h", device):
            host = transfer.start(states, finite, scales)
        put(self.to_write, CapturedBatch(batch, host, [way.code for way in ways]), self.failed)
        self.counts.forwarded(self.rows_to_run(batch), batch.num_tokens, batch.padded_tokens)

    def drop(self, found: Finding, capture: LayerCapture) -> None:
        """The audit found a way wrong: the run goes down the ladder, says so and records it."""
        now = self.ladder.drop(found.way)
        capture.kept.clear()  # nothing computed so far is continued from any more
        if self.group is not None:
            self.group.rung(self.ladder.rung)
        # rows an earlier run of the part computed that way where the part does not record which (streamx < 0.8.1)
        earlier = min(self.unrecorded, self.earlier_coverage.get(str(found.way), [0, 0, 0, 0])[2])
        self.audit.audited.found = [*(self.audit.audited.found or []), {**found.to_json(), "earlier_rows": earlier}]
        self.log(f"audit: {found}; the run now computes its rows {now}, this batch again, and before it ends the "
                 "rows committed that way (by this run, or an earlier one of this part)"
                 + (f"; {earlier:,} rows an earlier run of this part computed that way are not told apart: check them "
                    "with streamx verify --samples N, or start over with --overwrite" if earlier else ""))

    def next_batch(self) -> Any:
        """The producer's next item; None at the end of the data, or at once when asked to wind up."""
        try:
            item = get(self.batches, self.failed, self.signalled)
        except Stopped:
            if self.failed.is_set():
                raise
        else:
            if item is None or not self.signalled.is_set():
                return item
        self.rows_left.set()  # winding up: this batch and the rest are left for the resume
        return None

    def run(self) -> None:
        producer = Worker("streamx-producer", self.produce, self.failed)
        writer = Worker("streamx-writer", lambda: self.stage.run(self.to_write, self.failed, self.fill["to_write"],
                                                                 self.rows_left), self.failed)
        producer.start()
        writer.start()
        finished = False
        try:
            self.compute()
            writer.join()
            finished = writer.error is None
        except Stopped:  # another thread failed: its error is raised below
            pass
        finally:
            self.failed.set()  # no-op after a clean finish; otherwise winds the threads down
            producer.join(timeout=5)
            writer.join(timeout=30)
        if not finished:
            raise first_error([producer, writer])

    def stage_seconds(self) -> dict[str, float]:
        seconds = self.times.totals()
        seconds["forward"] = seconds.get("forward", 0.0) - seconds.get("gather", 0.0)  # the hooks run inside
        return seconds


def run(config: RunConfig | RunPlan, progress: bool = True, log: Callable[[str], None] = print,
        wind_up_on_signals: bool = True) -> RunSummary:
    """Run the pipeline into config.out: a RunConfig is planned first (model loaded); a RunPlan is used as is.
    The process holds its part of the store for the whole run (streamx.base.locks), taken before the model
    loads. SIGINT and SIGTERM end it early with what was written committed (`RunSummary.stopped_by`), unless
    `wind_up_on_signals` is off (a caller that runs many short runs, as bench, lets Ctrl-C stop it at once)."""
    started = time.perf_counter(), time.process_time()  # wall and CPU
    library_bars(progress)
    cfg, rank = (config.config, config.rank) if isinstance(config, RunPlan) else \
        (config, init_from_env(config.rank, config.world_size, config.tp))
    if not rank.leads:  # a tensor-parallel group's other processes: the forward alone, no part of their own
        plan = config if isinstance(config, RunPlan) else make_plan(config, log=log, rank=rank)
        return follow(plan, started)
    with OwnedPart(cfg.out, rank.part_name) as part:
        plan = config if isinstance(config, RunPlan) else make_plan(config, log=log, rank=rank)
        return _run(plan, part, started, progress, log, wind_up_on_signals)


def _run(plan: RunPlan, part: OwnedPart, started: tuple[float, float], progress: bool, log: Callable[[str], None],
         signals: bool) -> RunSummary:
    cfg, rank = plan.config, plan.rank
    # a job's first process creates (or checks and reopens) the store before its others open it; independent ranks
    # and jobs each do
    root = prepare(cfg.out, plan.metadata, cfg.overwrite) if rank.prepares else None
    rank.barrier()
    target = open_for_run(cfg.out, plan.metadata, root)
    rank.barrier()  # every rank has read the same committed set before any rank creates its part or commits
    if target.done_rows and rank.is_main:
        log(f"resuming {cfg.out}: {len(target.done_rows)} rows already committed")
    space = SpaceGuard.for_layout(cfg.out, plan.layout)  # (--no-space-check skips only the start-up check)
    digests = RowDigests(target.data_digests, cfg.max_samples, cfg.data)  # a resume stops where the data changed
    writer = PartWriter(part.open(target, plan.layout), space, digests)
    plan.builder.fanout = FanOut(plan.tokenizer)  # this run's rows as tokenized (a fresh one: bench reuses plans)
    pipeline = Pipeline(plan, writer, target.done_rows, target.done_keys, target.same_as, log)

    total = None if plan.source.num_rows is None else rows_to_run(plan.source.num_rows, target.done_rows,
                                                                  cfg.sort_window, rank)
    desc = "streamx run" if rank.world_size == 1 else f"streamx run [rank {rank.rank}]"
    with Progress(pipeline.counts, total, desc, disable=not progress), \
            SignalStop(pipeline.signalled, log, enabled=signals) as signals_in:
        pipeline.run()
    if pipeline.to_heal().size and not pipeline.rows_left.is_set():  # (wound up early: the resume heals them)
        heal_part(plan, pipeline, part, target, space, digests, log)
    if pipeline.group is not None:
        pipeline.group.end()
    # no rank waits for another's work (a collective here would time out on a rank that finished long before the
    # others, and torchrun would stop them all): each reads the whole store once its part is closed, and the last
    # to find it complete closes the parts no rank of this world writes and says the whole summary
    written = writer.this_run()
    close_parts_of_no_rank(cfg.out, target, rank.world_size, log)
    final = Store(cfg.out)  # (the other ranks may still be running)
    store_samples, store_tokens, incomplete = len(final), final.row_tokens, final.completeness().problems()
    store_waiting = final.waiting_rows
    shared = final.shared_kinds()
    return RunSummary(
        out=cfg.out, layer_ids=plan.layer_ids, num_layers=plan.info.num_layers, samples=written.samples,
        tokens=written.tokens, row_tokens=written.samples_tokens, trainable_tokens=written.trainable_tokens,
        duplicates=written.duplicates, cut_rows=written.cut_rows or 0, cut_tokens=written.cut_tokens or 0,
        max_length=cfg.max_length, rejects=written.rejects,
        reject_counts=written.reject_counts, hidden_bytes=written.tokens * plan.layout.bytes_per_token,
        real_tokens=pipeline.counts.real_tokens, padded_tokens=pipeline.counts.padded_tokens,
        resumed_rows=len(target.done_rows),
        seconds=time.perf_counter() - started[0], stage_seconds=pipeline.stage_seconds(),
        queue_fill={name: fill.mean for name, fill in pipeline.fill.items()},
        store_samples=store_samples, store_tokens=store_tokens, rank=rank.rank,
        stopped_by=signals_in.signal.name if signals_in.signal and pipeline.rows_left.is_set() else None,
        incomplete=incomplete, shared=shared, cpu_seconds=time.process_time() - started[1], cores=available_cores(),
        stored_again=pipeline.stage.stored_again, store_waiting=store_waiting, fanout=pipeline.fanout(),
        audit=pipeline.audited(),
    )


def heal_part(plan: RunPlan, pipeline: Pipeline, part: OwnedPart, target: RunStore, space: SpaceGuard,
              digests: RowDigests, log: Callable[[str], None]) -> None:
    """The rows this part committed a way the audit found wrong (this run or an earlier one): computed again and
    written over (pipeline.heal), then the part closed, its record saying so."""
    group = part.open(target, plan.layout)
    healed = heal(plan, group, part.name, pipeline.to_heal(), pipeline.ladder, log, pipeline.announce(Word.BATCH))
    writer = PartWriter(group, space, digests)
    writer.close(True, plan.source_rows, pipeline.fanout(), Audited(recomputed=healed, rung=pipeline.ladder.name))
    pipeline.healed(healed)
    log(f"audit: {healed:,} committed rows computed again {pipeline.ladder.name}; {part.name} is closed")


def follow(plan: RunPlan, started: tuple[float, float]) -> RunSummary:
    """A tensor-parallel group's other process (--tp): its share of each forward of the group, in step with its
    first process, which captures and writes (tensor_parallel.GroupWord). It makes the same planned batches from
    the same rows and is sent what the first process alone decides (the audit's rows, a rung of the ladder and its
    batches, the rows healed); it holds no part and writes nothing, and leaves a signal to the first process: it
    stops when that one does."""
    cfg, rank = plan.config, plan.rank
    rank.barrier()  # the store is prepared (`_run`)
    target = open_for_run(cfg.out, plan.metadata)
    rank.barrier()
    group, K, H = GroupWord(rank, plan.device), len(plan.layer_ids), plan.info.hidden_size
    ladder = Ladder(plan.model, plan.packing, cfg.token_budget, cfg.max_batch_size, plan.pad_token_id)
    tokens = 0
    # a first signal is the first process's to act on (it winds the group up); a second stops at once, as there
    with LayerCapture(plan.model, plan.layer_ids, select_gather_fn(cfg.kernel, plan.device)) as capture, \
            SignalStop(threading.Event(), lambda message: None):
        stream = (item for item in plan.batch_stream(target.done_rows, done_keys=target.done_keys,
                                                     same_as=target.same_as) if isinstance(item, Batch))
        while (said := group.receive())[0] != Word.END:
            word, value = said
            if word == Word.RUNG:
                ladder.go_to(value)
                capture.kept.clear()
                continue
            batch = group.check(value, next(stream, None)) if word in (Word.NEXT, Word.PASS) else value
            if word == Word.PASS:
                continue
            with padded_attention(plan.model) if word == Word.ALONE else nullcontext():
                capture.forward(batch, torch.empty((batch.num_tokens, K, H), dtype=torch.bfloat16,
                                                   device=plan.device))
            tokens += batch.num_tokens
    return RunSummary(out=cfg.out, layer_ids=plan.layer_ids, num_layers=plan.info.num_layers, samples=0, tokens=0,
                      trainable_tokens=0, duplicates=0, rejects=0, reject_counts={}, hidden_bytes=0,
                      real_tokens=tokens, padded_tokens=tokens, resumed_rows=len(target.done_rows),
                      seconds=time.perf_counter() - started[0], stage_seconds={}, queue_fill={}, rank=rank.rank,
                      tp_rank=rank.tp_rank, cpu_seconds=time.process_time() - started[1], cores=available_cores())


def rows_to_run(num_rows: int, done: Collection[int], sort_window: int, rank: Rank) -> int:
    """The source rows this rank runs (the progress bar's total): those of its sorting windows that no earlier
    run committed."""
    owned = sum(min(sort_window, num_rows - w * sort_window)
                for w in range(rank.rank, -(-num_rows // sort_window), rank.world_size))
    ids = np.fromiter(done, dtype=np.int64, count=len(done))
    return owned - int(((ids < num_rows) & (ids // sort_window % rank.world_size == rank.rank)).sum())


def available_cores() -> int:
    """The cores this process may run on: its affinity (taskset, Slurm, a container's cpuset) where the OS has one."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def close_parts_of_no_rank(path: str, target: RunStore, world_size: int, log: Callable[[str], None]) -> list[str]:
    """A resume with fewer ranks than the run it resumes: the ranks of this world compute every row left, but
    the parts of the ranks beyond it (part-N, N >= world_size) stay open, and the store would never read as
    complete. Once the store holds every row of its data, close them (each under its lock, its writer fenced
    as any writer is) and remove those a killed run left half-created (nothing in them is committed). A part
    whose lock a live process holds is left as it is. Returns the parts closed or removed."""
    state = Store(path, target.root).completeness()
    if state.source_rows is None or state.missing_rows.size:
        return []
    parts, done = target.root[PARTS], []
    for name in sorted({*state.open_parts, *state.half_made}):
        if int(name.removeprefix("part-")) < world_size:  # a rank of this world's own: it closes it
            continue
        try:
            with OwnedPart(path, name):
                if name in state.half_made:
                    del parts[name]
                    log(f"removed {name}, left half-made by a killed rank: no rank of this world of {world_size} "
                        "writes it")
                else:
                    PartWriter(parts[name]).close(True, state.source_rows)
                    log(f"closed {name}: no rank of this world of {world_size} writes it, and every row of the "
                        "data is committed")
        except LockedError as err:
            log(f"left {name} open: {err}")
            continue
        done.append(name)
    return done

