"""What a run will do, decided once: the RunPlan that `streamx run`, `streamx bench` and
`streamx plan --calibrate` share.

    settings -> data source -> output check -> layer ids (from the model's config) -> model and
    tokenizer -> sample builder -> store layout and metadata

The cheap checks come first, so that a wrong data path, an output folder that is not a store or
a layer id out of range fails in a second, before any weights are loaded. `RunPlan.batch_stream`
is the one way from the source to the model's batches: source -> windows this rank owns ->
tokenize -> batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
import zarr
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import __version__
from ..base.units import gb
from ..config import RunConfig, resolve_layer_ids, untrainable_layers
from ..data.batching import Batch, iter_batches, iter_windows, to_run
from ..data.provenance import RowDigests, fingerprint, regenerated
from ..data.sharing import Sharing
from ..data.source import Row, Source, open_source
from ..data.tokenize import (
    REJECT_REASONS,
    Duplicate,
    Reject,
    Repeats,
    Sample,
    SampleBuilder,
    vocabulary_fingerprint,
)
from ..model.capture import READ_AT_INPUTS
from ..model.carry import kept_bytes_per_token
from ..model.footprint import held_share
from ..model.kernels import kernel_note
from ..model.load import (
    ModelInfo,
    check_tensor_parallel,
    load_model,
    model_tokenizer,
    read_config,
    read_text_config,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from ..model.packing import Packing, hand_states_over, keep_samples_apart_natively, sample_wise_layers
from ..model.packing import configure as configure_packing
from ..model.residual import config_layers, residual_of
from ..model.support import note as family_note
from ..proof.audit import tolerance_of
from ..proof.check import check_continuation, check_prefix_rows
from ..proof.ids import prove_ids
from ..proof.tolerance import Tolerance
from ..store import (
    Compat,
    DoneKeys,
    Layout,
    Output,
    StoreError,
    StoreMetadata,
    check_compatible,
    free_bytes,
    make_layout,
)
from .estimate import Estimate, estimate
from .metrics import StageTimes
from .ranks import Rank, init_from_env


@dataclass
class RunPlan:
    config: RunConfig
    rank: Rank  # this process under torchrun (rank 0 of 1 otherwise)
    source: Source
    layer_ids: list[int]  # speculators convention, ascending (docs/layers.md)
    packing: Packing  # packed or padded batches (streamx.model.packing.configure)
    sharing: Sharing  # what rows share is computed once (streamx.data.sharing)
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    builder: SampleBuilder
    layout: Layout
    metadata: StoreMetadata
    rows_seen: int = 0  # the source rows batch_stream has passed, owned by this rank or not
    tokens_to_compute: int | None = None  # the sizing pass's, for what is left (None: not sized): the ETA's

    @property
    def source_rows(self) -> int:
        """The data's rows (up to --max-samples), once batch_stream has run to the end."""
        return self.source.num_rows if self.source.num_rows is not None else self.rows_seen

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tokenize(self, window: list[Row]) -> list[Sample | Reject]:
        return [self.builder(row) for row in window]

    def batches(self, samples: list[Sample | Reject | Duplicate], packed: bool | None = None,
                ) -> Iterator[Batch | Reject | Duplicate]:
        """A window's samples as the run batches them (packed when packing is on), or as asked."""
        packed = self.packing.on if packed is None else packed
        split = self.packing.split
        return iter_batches(samples, self.config.token_budget, 1 if self.packing.alone else self.config.max_batch_size,
                            self.pad_token_id, packed=packed, sharing=self.sharing.on,
                            min_shared_tokens=self.sharing.min_shared_tokens if packed else None,
                            split_at=split.limit if split else None, alone_past_split=bool(split and split.alone))

    def batch_stream(self, done: Collection[int] = frozenset(), packed: bool | None = None,
                     times: StageTimes | None = None, done_keys: DoneKeys | None = None,
                     same_as: bool = True, digests: RowDigests | None = None) -> Iterator[Batch | Reject | Duplicate]:
        """This rank's batches and rejects, in run order: the sorting windows of source rows it owns,
        tokenized and batched (packed as the run does, or as asked). Windows and batches whose rows are
        all in `done` are left out (`to_run`); a batch with some done rows comes whole (the writer drops those).
        Every row of every window has its content key taken, in source order, so that every rank and every
        resume agree on which rows repeat an earlier one; with `done_keys` (a resume's, from the store), the
        windows it holds whole are not even parsed where the source can skip rows (jsonl): their keys come
        from the store. With --sharing (and `same_as`: a store whose parts record it), a row whose content repeats
        an earlier row's, anywhere in the data, is not computed: it comes as a Duplicate naming that row. With
        `digests` (a run's), every row read is digested, and a resume on data that changed stops at the first
        window that did (data.provenance.RowDigests), before any row of it is batched."""
        times, sort_window, seen = times or StageTimes(), self.config.sort_window, Repeats()
        rows = self.source.rows(skip=done_keys.in_whole_windows(sort_window, self.source.num_rows)
                                if done_keys else None, digests=digests)
        if digests is not None:
            rows = digests.held(rows)
        next_window = 0
        for window in iter_windows(rows, sort_window):
            w = window[0].row_id // sort_window
            self.rows_seen = max(self.rows_seen, window[-1].row_id + 1)
            with times.measure("source_tokenize"):
                if done_keys:  # the windows the source skipped, in order
                    seen.add(*done_keys.between(next_window * sort_window, w * sort_window))
                next_window = w + 1
                keys = seen.of(window)  # every window, owned or done or not: "earlier" is in source order
            if not self.rank.owns(w):
                continue
            if all(row.row_id in done for row in window):
                continue
            with times.measure("source_tokenize"):
                samples = [self.with_key(s, *keys.get(s.row_id, (0, None)), same_as, seen, done_keys)
                           for s in self.tokenize(window)]
            with times.measure("batching"):
                items = list(self.batches(samples, packed))
            yield from to_run(items, done)

    def with_key(self, item: Sample | Reject, key: int, first: int | None, same_as: bool, seen: Repeats,
                 done_keys: DoneKeys | None = None) -> Sample | Reject | Duplicate:
        """The item with its row's content key. A sample that repeats an earlier row (`first`) becomes, with
        --skip-duplicates, a reject; with --sharing (and `same_as`), a Duplicate of that row; else it is marked.
        A repeat whose tokens differ from its first row's (a crafted key collision, a template that renders
        otherwise) is a row of its own, where this process knows the first row's tokens (tokenized here, or
        committed before); where it does not (another rank's row, this run), the store compares the two digests
        when it reads the repeat, and a repeat that differs reads as missing: the next run computes it."""
        if isinstance(item, Reject):
            return dataclasses.replace(item, content_key=key)
        item.content_key = key
        digest = item.digest
        if first is None:
            if key:
                seen.digests[item.row_id] = digest
            return item
        if done_keys is not None and done_keys.differs(item.row_id):  # a run before found it is not that row
            return item
        known = seen.digests.get(first) or (done_keys.digest(first) if done_keys is not None else None)
        if known is not None and known != digest:
            return item
        if self.config.skip_duplicates:
            return Reject(item.row_id, "duplicate_content", "the same content as an earlier row", key)
        if same_as and self.sharing.on:
            return Duplicate(item.row_id, first, len(item.input_ids), int(item.loss_mask.sum()), key, digest,
                             item.cut)
        item.duplicate = True
        return item

    def unshared(self) -> RunPlan:
        """The same plan with --sharing off: every row computed in full (bench's A/B arm)."""
        config = self.config.replace(sharing="off")
        compat = dataclasses.replace(self.metadata.compat, sharing="off")
        return dataclasses.replace(self, config=config, sharing=Sharing(False), metadata=dataclasses.replace(
            self.metadata, config=config.to_dict(), sharing="off", compat=compat))

    def unaudited(self) -> RunPlan:
        """The same plan with --audit-every 0 (bench's arm for the audit's cost)."""
        config = self.config.replace(audit_every=0)
        return dataclasses.replace(self, config=config, metadata=dataclasses.replace(self.metadata,
                                                                                      config=config.to_dict()))

    def with_output(self, out: str, overwrite: bool = False) -> RunPlan:
        """The same plan into another store (bench's rounds): nothing is loaded, probed or fingerprinted again."""
        config = self.config.replace(out=out, overwrite=overwrite)
        return dataclasses.replace(self, config=config,
                                   metadata=dataclasses.replace(self.metadata, config=config.to_dict()))


def check_parallel(config: RunConfig) -> None:
    """Refuse --tp and --ep settings the model cannot take, before any weight is read (`plan` refuses the same)."""
    if config.tp > 1:
        if config.device_map:
            raise ValueError("--tp shards the model over processes, --device-map over one process's GPUs: choose one")
        check_tensor_parallel(config.model, config.tp, config.ep)
    elif config.ep:
        raise ValueError("--ep spreads a MoE's experts over a --tp group: give --tp N as well")


def make_plan(config: RunConfig, loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelInfo] | None = None,
              log: Callable[[str], None] = print, rank: Rank | None = None) -> RunPlan:
    """Check and load everything a run needs; `loaded` reuses a model already loaded with these settings, `rank`
    this process's rank where it is known (else from the environment)."""
    rank = rank or init_from_env(config.rank, config.world_size, config.tp)
    check_parallel(config)
    if rank.independent and config.overwrite:
        raise ValueError("--overwrite with several processes or torchrun jobs that share no process group would have "
                         "each delete the others' parts: delete the store first, then start them")
    source = open_source(config.data, config.split, config.max_samples)
    record = regenerated(config.data)
    check_regenerated(config, record, log if rank.is_main else lambda m: None)
    config = resume_unshared(config, log if rank.is_main else lambda m: None)
    sized = None
    if rank.prepares:  # a torchrun job's other processes would race its first creating the store
        output = preflight(config, rank.device(config.device), log if rank.is_main else lambda m: None)
        if loaded is None and rank.is_main:
            announce(config, source, output, rank.device(config.device), log, rank)
            if config.space_check:
                sized = check_space(config, source, output, log)
    model, tokenizer, info = loaded or load_model(config.model, config.dtype, rank.device(config.device),
                                                  config.attn_implementation, config.device_map,
                                                  config.random_weights, config.tokenizer, config.tp, config.ep,
                                                  config.dequantize)
    ids = prove_ids(model)  # (refuses a model whose ids the hooks cannot read as its own tuple holds them)
    setattr(model, READ_AT_INPUTS, ids.inputs)
    layer_ids = resolve_layer_ids(config.layers, info.num_layers)
    check_trainable(config, layer_ids, info.num_layers)
    packing = configure_packing(model, config.packing, config.max_length, config.max_batch_size,
                                config.token_budget)
    sharing = decide_sharing(config, packing, model)
    if rank.is_main and loaded is None:
        if info.weights:
            log(f"  weights {info.weights}")
        log(f"  ids     {ids.note()}")
        log(f"  packing {packing.note()}")
        log(f"  sharing {sharing.note()}")
        checkpoint = read_config(info.path)
        own = (checkpoint.architectures or [type(model).__name__])[0]
        family = family_note(checkpoint, packing.on, sharing.min_shared_tokens is not None, packing.alone,
                             sharing.on, run_as=type(model).__name__ if own != type(model).__name__ else None)
        log(f"  family  {family}")
        log(f"  kernels {kernel_note(model, next(model.parameters()).device.type, packing.on)}")
        if config.tp > 1:
            log(f"  tp      {held_share(model, config.tp)}")
        log(f"  audit   {audit_note(config, tolerance_of(model, packing))}")
    check_vocabulary(config.data, record, tokenizer)
    builder = SampleBuilder(tokenizer, config.max_length, config.truncation, config.train_turns)
    layout = make_layout(len(layer_ids), info.hidden_size, config.chunk_tokens, config.shard_tokens, config.compressor,
                         config.storage)
    metadata = store_metadata(config, info, builder, layer_ids, layout, packing, sharing)
    check_shared_resume(config, sharing, metadata.compat)
    return RunPlan(config, rank, source, layer_ids, packing, sharing, model, tokenizer, info, builder, layout,
                   metadata, tokens_to_compute=tokens_to_compute(sized, sharing))


def audit_note(config: RunConfig, tolerance: Tolerance) -> str:
    """The run's log line on its in-run audit (proof.audit), which judges rows by `tolerance`."""
    if not config.audit_every:
        return "off (--audit-every 0)"
    budget = (f"within {config.audit_share:.0%} of the forward time" if config.audit_share else
              "whatever it costs (--audit-share 0)")
    return (f"rows of each way of computing rows, doubling in length, the first past each declared length limit and "
            f"one row id in {config.audit_every:,}, recomputed alone through the model's own forward before its batch "
            f"is written, {budget}; a row differs past {tolerance.explained()}; a way found wrong is dropped and its "
            "rows computed again")


def decide_sharing(config: RunConfig, packing: Packing, model: PreTrainedModel) -> Sharing:
    """--sharing on this model: prefix rows always; common leading runs where the packed forward continues a
    segment from another's state (padded batches hand no state over), proved by a probe."""
    if config.sharing == "off":
        return Sharing(False)
    unlike = check_prefix_rows(packing.probes)
    if unlike is not None:
        return Sharing(False, reason=unlike)
    if config.sharing == "rows":
        return Sharing(True, None, "leading runs are computed in every row (--sharing rows)")
    if not packing.on:
        return Sharing(True, None, "padded batches hand no state from one segment to another, so leading runs "
                                   "are computed in every row")
    why = check_continuation(model, packing.probes)
    handing_over = 0
    if why is not None and hand_states_over(model):  # e.g. flash-linear-attention's varlen kernels
        why = check_continuation(model, packing.probes)
        if why is None:
            handing_over = sample_wise_layers(model)
        else:
            keep_samples_apart_natively(model)
    if why is not None:
        return Sharing(True, None, why)
    # a kept chain is a row's start: at most the longest row
    kept = min(config.token_budget, config.max_length) * kept_bytes_per_token(model)
    return Sharing(True, config.min_shared_tokens, kept_bytes=kept, handing_over=handing_over)


def check_shared_resume(config: RunConfig, sharing: Sharing, compat: Compat) -> None:
    """A store that shares leading runs, resumed where the start-up check finds that the model does not continue a
    shared prefix (another GPU, kernel set or transformers) and all else matches: refused with the check's reason
    and what to do (the store's compat check would name the setting alone, and a flag the user already passes)."""
    if config.overwrite or sharing.setting != "rows":
        return
    output = Output.read(config.out)
    differences = [d.split(":")[0] for d in compat.differences(output.compat)] if output.is_store else []
    if differences == ["sharing"] and output.compat.get("sharing") == "on":
        raise StoreError(f"{config.out} shares leading runs, computed where the model continued a shared prefix's "
                         f"state, but here the start-up check finds that {sharing.reason}; resume it where the check "
                         "passes (the GPU, kernels and transformers it was written with), or pass --overwrite to start "
                         "over here (sharing prefix rows only), or choose another --out")


def preflight(config: RunConfig, device: str, log: Callable[[str], None] = lambda m: None) -> Output:
    """Everything that can refuse a run before its weights load (`streamx plan` checks the same): the output,
    the layer ids, and a store at --out that this run could not resume, field by field but for the weights'
    fingerprint and packing, which are compared once the model is loaded and probed."""
    output = Output.checked(config.out, config.overwrite)
    path = resolve_model_path(config.model, log)
    L = config_layers(read_text_config(path))
    layer_ids = resolve_layer_ids(config.layers, L)
    check_trainable(config, layer_ids, L)
    if output.is_store and not config.overwrite:
        builder = SampleBuilder(model_tokenizer(path, config.tokenizer), config.max_length, config.truncation,
                                config.train_turns)
        ours = Compat(model="", compute_dtype=str(resolve_dtype(config.dtype, device)).removeprefix("torch."),
                      layer_ids=layer_ids, tokenization=builder.fingerprint, data=config.data, split=config.split,
                      storage=config.storage, skip_duplicates=config.skip_duplicates,
                      data_fingerprint=fingerprint(config.data), train_turns=config.train_turns)
        check_compatible(output.compat, config.out, ours, unknown=("model", "packing", "sharing"))
    return output


def resume_unshared(config: RunConfig, log: Callable[[str], None]) -> RunConfig:
    """A store made with every row in full (--sharing off, or before streamx shared tokens) resumes as it was
    made: the same command goes on where it stopped, and the store equals an uninterrupted run."""
    if config.sharing == "off" or config.overwrite:
        return config
    output = Output.read(config.out)
    if not output.is_store or output.compat.get("sharing", "off") != "off":
        return config
    log(f"  note    {config.out} computes every row in full (--sharing off, or written before streamx shared "
        "tokens): it resumes so")
    return config.replace(sharing="off")


def check_trainable(config: RunConfig, layer_ids: list[int], num_layers: int) -> None:
    """Layer ids speculators cannot train from are refused unless --any-layers: convert would refuse the store
    only once it is written."""
    problem = None if config.any_layers else untrainable_layers(layer_ids, num_layers)
    if problem:
        raise ValueError(f"--layers {config.layers}: {problem}; or --any-layers to extract them for another use")


def check_regenerated(config: RunConfig, record: dict | None, log: Callable[[str], None]) -> None:
    """A file streamx regenerate wrote is read only once complete (else it may still be growing, or hold a part
    of its rows), unless --allow-partial."""
    if record is None:
        return
    if "complete" not in record:
        log(f"  note    {config.data} was written by a streamx regenerate that did not record whether it is "
            "complete: make sure it ran to its end")
    elif not record["complete"] and not config.allow_partial:
        raise ValueError(f"{config.data} is not complete: streamx regenerate is still writing it, or stopped before "
                         "its end (run the same regenerate command to finish it); --allow-partial reads the rows it "
                         "holds")


def check_vocabulary(data: str, record: dict | None, tokenizer: PreTrainedTokenizerBase) -> None:
    """Token ids regenerate wrote (input_ids + loss_mask) are this run's tokens only under the same vocabulary:
    another model's tokenizer with the same size would read them as other tokens."""
    wrote = (record or {}).get("vocabulary")
    if wrote and wrote != vocabulary_fingerprint(tokenizer):
        raise ValueError(f"{data} holds token ids of another tokenizer (regenerated with {record.get('model')}): "
                         "run it with that model, or its tokenizer (--tokenizer)")


def announce(config: RunConfig, source: Source, output: Output, device: str, log: Callable[[str], None],
             rank: Rank = Rank()) -> None:
    """Say what the run will do before the slow part (converting or loading the model), and check the
    layer ids against the model's config alone."""
    dtype = str(resolve_dtype(config.dtype, device)).removeprefix("torch.")
    log(f"streamx: {config.model} on {resolve_device(device)} in {dtype}"
        + (", random weights (a dry run, not training data)" if config.random_weights else ""))
    if rank.world_size > 1 or rank.tp_size > 1:
        group = f"groups of --tp {rank.tp_size}{' --ep' if config.ep else ''}" if rank.tp_size > 1 else "processes"
        log(f"  ranks   {rank.world_size} data-parallel {group}, each with its share of the rows: this is "
            f"data-parallel rank {rank.rank}, tensor-parallel rank {rank.tp_rank} (process {rank.process})")
    log(f"  data    {source.name}: " + ("rows streamed" if source.num_rows is None else f"{source.num_rows:,} rows"))
    log(f"  out     {config.out}: {output.state(config.overwrite)}")
    path = resolve_model_path(config.model, log)
    if path != config.model:
        log(f"  model   {path}")
    text_config = read_text_config(path)
    L = config_layers(text_config)
    layer_ids = resolve_layer_ids(config.layers, L)
    log(f"  layers  {layer_ids} of {L} ({config.layers}): id 0 = embeddings, id k = output of layer k-1, id {L} = "
        "the last layer's output before the final norm")
    residual = residual_of(text_config)
    if residual.streams > 1:
        log(f"  states  {residual.describe()}")


def check_space(config: RunConfig, source: Source, output: Output, log: Callable[[str], None],
                ) -> tuple[Estimate, float] | None:
    """Size the store from the tokenized rows (streamx.pipeline.estimate) and refuse to start when the output
    filesystem cannot hold what is left to write. Returns the estimate and the share of the rows left to run
    (for the ETA: `tokens_to_compute`), or None where nothing was sized."""
    free = free_bytes(config.out)
    if free is None or source.num_rows is None:
        log("  space   not checked: " + ("an object store" if free is None else "a stream of unknown length"))
        return None
    plan = estimate(config, source)
    done = 0 if config.overwrite else output.committed_rows
    left = max(0, source.num_rows - done) / max(1, source.num_rows)
    needed = round(plan.sizes[config.storage].bytes * left)
    if config.overwrite and Path(config.out).is_dir():  # the old store's bytes are freed first
        free += sum(f.stat().st_size for f in Path(config.out).rglob("*") if f.is_file())
    how = "" if plan.exact else f", estimated from {plan.sampled_rows:,} rows" + (
        f" and {plan.shared.sampled_runs} runs of rows" if plan.shared is not None else "")
    stored = "" if plan.shared is None else f", {plan.stored_tokens:,} stored: {plan.stored_as}"
    log(f"  space   {gb(needed)} to write ({config.storage}, {plan.tokens:,} tokens{stored}{how}), {gb(free)} free")
    if free < needed:
        raise StoreError(f"{config.out}: its filesystem has {gb(free)} free and the store needs about {gb(needed)}; "
                         "free space, choose another --out, use --storage fp8, or pass --no-space-check")
    return plan, left


def tokens_to_compute(sized: tuple[Estimate, float] | None, sharing: Sharing) -> int | None:
    """The tokens the run will put through the model of what is left (the ETA's), from the sizing pass: the rows'
    tokens, or with --sharing what it computes as the estimate found it (an upper bound where rows were
    sampled); None where nothing was sized."""
    if sized is None:
        return None
    plan, left = sized
    tokens = plan.tokens if not sharing.on or plan.shared is None else \
        plan.shared.leading_runs if sharing.min_shared_tokens is not None else plan.shared.prefix_rows
    return round(tokens * left)


def store_metadata(config: RunConfig, info: ModelInfo, builder: SampleBuilder, layer_ids: list[int],
                   layout: Layout, packing: Packing, sharing: Sharing) -> StoreMetadata:
    template = builder.tokenizer.chat_template or ""
    return StoreMetadata(
        layer_ids=layer_ids,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        chunk_tokens=layout.chunk_tokens,
        shard_tokens=layout.shard_tokens,
        compressor=layout.compressor,
        storage=layout.storage.name,
        packing=str(packing),
        sharing=str(sharing),
        model=asdict(info),
        tokenizer={"name_or_path": builder.tokenizer.name_or_path, "fingerprint": builder.fingerprint,
                   "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()},
        max_length=config.max_length,
        truncation=config.truncation,
        config=config.to_dict(),
        versions={"streamx": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                  "zarr": zarr.__version__},
        reject_reasons=list(REJECT_REASONS),
        compat=Compat(model=info.weights_fingerprint, compute_dtype=info.dtype, layer_ids=layer_ids,
                      tokenization=builder.fingerprint, data=config.data, split=config.split,
                      storage=layout.storage.name, packing=packing.setting,
                      skip_duplicates=config.skip_duplicates, data_fingerprint=fingerprint(config.data),
                      sharing=sharing.setting, train_turns=config.train_turns),
    )
