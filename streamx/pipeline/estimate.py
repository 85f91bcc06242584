"""What a run will write, before it starts: `streamx plan`, and the free-space check of `streamx run`.

The run's own tokenizer and sample builder go over the rows (`sample_rows` of them drawn at random
when there are more) and the store's bytes and files follow from its layout (store.py),
for each storage choice. No weights are read: the layer count and hidden size come from the
model's config. With --sharing, sampled rows share little with each other, so what the store keeps is
measured apart, on runs of consecutive rows within sorting windows (`runs_of_rows`), and scaled up. The rows
tokenized in order (all of them, or those runs) also show fanned-out rows that sharing cannot fold
(streamx.data.fanout).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from ..base.units import gb
from ..config import RunConfig, resolve_layer_ids
from ..data.batching import iter_windows
from ..data.fanout import FanOut
from ..data.sharing import Segment, covered_rows, pieces, share
from ..data.source import Row, Source, open_source
from ..data.tokenize import DIGEST_BYTES, Reject, Repeats, Sample, SampleBuilder
from ..model.flops import DEFAULT_MFU, H100_BF16_TFLOPS, assumed_rate, token_cost
from ..model.footprint import Footprint, fit_lines, footprints
from ..model.load import meta_model, model_tokenizer, read_config, resolve_dtype, resolve_model_path
from ..model.quantized import describe
from ..model.residual import config_layers, residual_of
from ..model.support import support_of
from ..store import STORAGES, Layout, free_bytes, make_layout
from ..store.format import (
    GROUP_DOCUMENTS,
    INDEX_CHUNK,
    REJECT_ARRAYS,
    SAME_AS_ARRAYS,
    SAMPLE_ARRAYS,
    SHARING_ARRAYS,
    TOKEN_ID_ARRAYS,
    SharedKinds,
    entry_bytes,
)
from ..store.shards import shard_index_bytes

RUNS = 16  # runs of consecutive rows that a sampled estimate measures --sharing on
GROUP_METADATA_BYTES = 4 << 10  # the store's zarr.json (metadata with the config), parts/ and the part (commit)
ARRAY_METADATA_BYTES = 1 << 10  # each array's zarr.json


@dataclass
class StoreSize:
    bytes: int  # on disk
    files: int
    bytes_per_token: int  # hidden states only


@dataclass
class SharedTokens:
    """The tokens --sharing on computes and stores, of all the rows' tokens, found as the run finds them; where the
    rows were sampled, measured on `sampled_runs` runs of rows and scaled up (`sampled_sharing`: an upper bound)."""

    prefix_rows: int  # when only duplicates and prefix rows are shared (the model cannot continue a state)
    leading_runs: int  # when common leading runs are computed once too (packed, and the model's probe passes)
    kinds: SharedKinds = SharedKinds()  # what is not computed again, by kind (with leading runs)
    sampled_runs: int = 0  # 0: every row was tokenized


@dataclass
class Estimate:
    rows: int | None  # source rows (None: a stream whose length is not known)
    sampled_rows: int  # rows tokenized
    samples: int  # rows that become samples (scaled up from the sample)
    rejects: dict[str, int]  # reason -> rows
    tokens: int
    trainable_tokens: int
    longest_sample: int  # tokens, in the sample
    duplicates: int | None  # samples whose content repeats an earlier row's (None: not counted)
    shared: SharedTokens | None  # what --sharing on computes and stores (None: off, or a stream's first rows)
    layer_ids: list[int]
    num_layers: int
    hidden_size: int
    stored_tokens: int  # what the store holds and the forward computes, as expected (`stored`)
    stored_as: str  # why: what sharing the expectation counts on
    sizes: dict[str, StoreSize]  # storage choice -> the store it makes (of stored_tokens)
    fanout: str | None  # rows that extend an earlier row's messages but not its tokens (FanOut.note; None: none seen)
    residual: str = ""  # what the stored width per token and id is (model.residual)
    cut_rows: int = 0  # samples whose row is longer than --max-length, cut there (scaled up from the sample)
    cut_tokens: int = 0  # their tokens past it, which the store would not hold
    keeps_all: int = 0  # the --max-length that keeps every sampled row whole
    keeps_99: int = 0  # ... 99% of them

    @property
    def exact(self) -> bool:  # every row was tokenized
        return self.rows is not None and self.sampled_rows == self.rows

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "exact": self.exact}

def store_size(layout: Layout, tokens: int, samples: int, rejects: int, cut_rows: int = 0) -> StoreSize:
    """Bytes and files of a one-part store of `tokens` tokens: shards of the token arrays (a partial last
    chunk is stored whole, each shard ends with its index), the per-sample and per-reject index arrays
    (counted uncompressed; `sample_cut` has chunk files only where `cut_rows` are), and the zarr.json documents."""
    shard, chunk = layout.shard_tokens, layout.chunk_tokens
    shards = -(-tokens // shard)
    stored_tokens = (shards - 1) * shard + -(-(tokens - (shards - 1) * shard) // chunk) * chunk if shards else 0
    token_arrays = len(layout.storage.token_arrays)
    nbytes = (stored_tokens * (layout.bytes_per_token + entry_bytes(TOKEN_ID_ARRAYS))
              + shards * token_arrays * shard_index_bytes(shard // chunk)
              + samples * (entry_bytes(SAMPLE_ARRAYS) + DIGEST_BYTES) + rejects * entry_bytes(REJECT_ARRAYS))
    sample_arrays = len(SAMPLE_ARRAYS) + 1  # and sample_digest
    index_files = ((sample_arrays - (not cut_rows)) * -(-samples // INDEX_CHUNK)
                   + len(REJECT_ARRAYS) * -(-rejects // INDEX_CHUNK))
    # --sharing's arrays hold only their fill values where no row shares (no chunk files): the unshared bound
    arrays = token_arrays + sample_arrays + len(REJECT_ARRAYS) + len(SHARING_ARRAYS) + len(SAME_AS_ARRAYS)
    nbytes += GROUP_METADATA_BYTES + arrays * ARRAY_METADATA_BYTES
    return StoreSize(nbytes, GROUP_DOCUMENTS + arrays + shards * token_arrays + index_files, layout.bytes_per_token)


def sampled(source: Source, sample_rows: int, seed: int = 0) -> tuple[list, int | None]:
    """`sample_rows` rows drawn at random (seeded) from the whole source, in source order, and its row count;
    all rows when there are no more; the first `sample_rows` rows of a stream whose length is unknown."""
    total = source.num_rows
    if total is None or total <= sample_rows:
        return list(itertools.islice(source, sample_rows if total is None else None)), total
    chosen = np.sort(np.random.default_rng(seed).choice(total, sample_rows, replace=False))
    return list(source.rows_at(chosen.tolist())), total


def estimate(config: RunConfig, source: Source | None = None, builder: SampleBuilder | None = None,
             sample_rows: int = 4096, count_duplicates: bool = False) -> Estimate:
    """Tokenize (a sample of) the rows as the run will and size the store for every storage choice.
    The source and sample builder are opened from `config` unless given. `count_duplicates`: also count the
    rows whose content repeats an earlier row's, over every row (a pass of hashing, no tokenizing, when the
    rows were sampled); --skip-duplicates then sizes the store without them, and --sharing without their tokens
    (sampled rows without that pass: a repeat of a row in another sorting window counts as stored)."""
    source = source or open_source(config.data, config.split, config.max_samples)
    builder = builder or SampleBuilder(model_tokenizer(resolve_model_path(config.model), config.tokenizer),
                                       config.max_length, config.truncation, config.train_turns)
    checkpoint = read_config(config.model)
    text_config = checkpoint.get_text_config()
    L, H = config_layers(text_config), residual_of(text_config).width
    layer_ids = resolve_layer_ids(config.layers, L)
    rows, total = sampled(source, sample_rows)
    exact = total is not None and len(rows) == total
    shared = SharedTokens(0, 0) if exact and config.sharing != "off" else None
    repeats: set[int] = set()
    if (count_duplicates or shared is not None) and total is not None:
        seen = Repeats()
        for window in iter_windows(rows if exact else source, 1024):
            repeats |= {row for row, (_, first) in seen.of(window).items() if first is not None}
    samples, tokens, trainable, longest, rejects, duplicates, cut_rows, cut_tokens = 0, 0, 0, 0, {}, 0, 0, 0
    whole: list[int] = []  # each sample's row length before any cut
    fanout = FanOut(builder.tokenizer)
    builder.fanout = fanout if exact else None  # rows drawn at random hardly ever extend one another: not fed
    window: list[Sample] = []
    for row in rows:
        if shared is not None and window and row.row_id // config.sort_window != window[0].row_id // config.sort_window:
            shared = _add_shared(shared, window, config)
            window = []
        item = builder(row)
        repeat = exact and row.row_id in repeats and not isinstance(item, Reject)  # as the run marks them
        if repeat:
            duplicates += 1
            if config.skip_duplicates:
                item = Reject(row.row_id, "duplicate_content", "")
        if isinstance(item, Reject):
            rejects[item.reason] = rejects.get(item.reason, 0) + 1
            continue
        samples += 1
        if repeat and shared is not None:  # not computed: it reads the first row with its content
            shared = _add_duplicate(shared, len(item.input_ids))
        else:
            window.append(item)
        tokens += len(item.input_ids)
        trainable += int(item.loss_mask.sum())
        longest = max(longest, len(item.input_ids))
        cut_rows, cut_tokens = cut_rows + (item.cut > 0), cut_tokens + item.cut
        whole.append(len(item.input_ids) + item.cut)
    if shared is not None and window:
        shared = _add_shared(shared, window, config)
    scale = (total / len(rows)) if total and rows else 1.0
    if not exact and repeats:  # sampled: the repeats were counted over every row
        duplicates = len(repeats)
        if config.skip_duplicates:  # their share comes out of what the sample stands for
            scale = (total - duplicates) / len(rows)
    samples, tokens, trainable, cut_rows, cut_tokens = (round(n * scale) for n in (samples, tokens, trainable,
                                                                                    cut_rows, cut_tokens))
    keeps_all, keeps_99 = (int(np.percentile(whole, q, method="higher")) if whole else 0 for q in (100, 99))
    if config.sharing != "off" and not exact and total is not None:
        builder.fanout = fanout  # the runs of consecutive rows
        shared = sampled_sharing(config, source, builder, repeats, tokens, samples, sample_rows)
    builder.fanout = None
    rejects = {reason: round(n * scale) for reason, n in rejects.items()}
    if not exact and repeats and config.skip_duplicates:
        rejects["duplicate_content"] = duplicates
    stored, stored_as = expected_stored(config, shared, tokens, checkpoint)

    def size(storage: str, tokens: int) -> StoreSize:
        return store_size(make_layout(len(layer_ids), H, config.chunk_tokens, config.shard_tokens, config.compressor,
                                      storage), tokens, samples, sum(rejects.values()), cut_rows)

    return Estimate(total, len(rows), samples, rejects, tokens, trainable, longest,
                    duplicates if count_duplicates and total is not None else None, shared, layer_ids, L, H, stored,
                    stored_as, {storage: size(storage, stored) for storage in STORAGES},
                    fanout.note(config.train_turns), residual=residual_of(text_config).describe(), cut_rows=cut_rows,
                    cut_tokens=cut_tokens, keeps_all=keeps_all, keeps_99=keeps_99)


def expected_stored(config: RunConfig, shared: SharedTokens | None, tokens: int, checkpoint: Any) -> tuple[int, str]:
    """The tokens a run is expected to compute and store, and why: with --sharing, the common leading runs too
    where batches are packed and the support table says the family continues a shared prefix (the start-up check
    decides on the loaded model: where it finds otherwise, prefix rows only; the run's space guard then stops it
    cleanly, with what it wrote committed, if the disk fills)."""
    if shared is None:
        return tokens, "every row's tokens" if config.sharing == "off" else "every row's tokens (sharing not estimated)"
    support = support_of(checkpoint)  # (a multimodal checkpoint's own row)
    if config.packing == "on" and config.sharing == "on" and support is not None and support.continued:
        return shared.leading_runs, f"shared leading runs ({support.family}: packed and shared, docs/support.md)"
    why = "--packing off" if config.packing != "on" else "--sharing rows" if config.sharing == "rows" else \
        f"{support.family}: {support.path}" if support is not None else \
        f"{checkpoint.model_type} is not in the support table: the start-up check decides"
    return shared.prefix_rows, f"prefix rows and duplicates only ({why})"


def runs_of_rows(source: Source, sort_window: int, sample_rows: int, seed: int = 0) -> list[list[Row]]:
    """About `sample_rows` rows of a source of known length as up to RUNS runs of consecutive rows, drawn at random
    (seeded) among the runs that cut each sorting window into equal runs. A run lies in one window, as the rows
    the run shares do, and finds at most the sharing its rows have in their window (a run shorter than its window
    finds less: the safe side)."""
    size = min(sort_window, -(-sample_rows // RUNS))
    per_window, total = -(-sort_window // size), source.num_rows
    slots = np.arange(-(-total // sort_window) * per_window)
    starts = slots // per_window * sort_window + slots % per_window * size
    starts = starts[starts < total]
    chosen = np.sort(np.random.default_rng(seed).choice(starts, min(RUNS, len(starts)), replace=False)).tolist()
    ids = [i for s in chosen for i in range(s, min(s + size, (s // sort_window + 1) * sort_window, total))]
    runs = itertools.groupby(source.rows_at(ids), key=lambda row: (row.row_id // sort_window,
                                                                   row.row_id % sort_window // size))
    return [list(rows) for _, rows in runs]


def sampled_sharing(config: RunConfig, source: Source, builder: SampleBuilder, repeats: set[int], tokens: int,
                    samples: int, sample_rows: int) -> SharedTokens:
    """What --sharing stores of `tokens` row tokens (`samples` samples) where the rows were sampled: the stored
    share of the row tokens in runs of consecutive rows (`runs_of_rows`), each as its own window, 2 standard errors
    above the runs' ratio (the runs differ as the data's windows do); the kinds scaled from the runs as they are.
    `repeats`: the rows that repeat an earlier row anywhere in the data, where every row was hashed."""
    runs = [_run_shared(run, builder, repeats, config) for run in runs_of_rows(source, config.sort_window,
                                                                               sample_rows)]
    run_tokens = [t for _, t, _ in runs]
    prefix_rows = round(tokens * upper_ratio([s.prefix_rows for s, _, _ in runs], run_tokens))
    leading_runs = min(prefix_rows, round(tokens * upper_ratio([s.leading_runs for s, _, _ in runs], run_tokens)))
    per_token, per_row = tokens / max(1, sum(run_tokens)), samples / max(1, sum(n for _, _, n in runs))
    totals = {f.name: sum(getattr(s.kinds, f.name) for s, _, _ in runs) for f in fields(SharedKinds)}
    kinds = SharedKinds(**{name: round(n * (per_row if name.endswith("rows") else per_token))
                           for name, n in totals.items()})
    return SharedTokens(prefix_rows, leading_runs, kinds, len(runs))


def _run_shared(run: list[Row], builder: SampleBuilder, repeats: set[int], config: RunConfig,
                ) -> tuple[SharedTokens, int, int]:
    """A run of rows shared as a window of its own: what is stored, and its samples' tokens and count."""
    shared, window, tokens, samples = SharedTokens(0, 0), [], 0, 0
    for row in run:
        item = builder(row)
        if isinstance(item, Reject) or (row.row_id in repeats and config.skip_duplicates):
            continue
        tokens, samples = tokens + len(item.input_ids), samples + 1
        if row.row_id in repeats:  # not computed: it reads the first row with its content
            shared = _add_duplicate(shared, len(item.input_ids))
        else:
            window.append(item)
    return _add_shared(shared, window, config), tokens, samples


def upper_ratio(stored: list[int], tokens: list[int]) -> float:
    """The share of the row tokens stored, from runs of rows drawn at random: the ratio of the sums, 2 standard
    errors up (a ratio estimator's over clusters), at most 1 (every token stored; so too with nothing to measure)."""
    s, t, k = np.asarray(stored, dtype=float), np.asarray(tokens, dtype=float), len(tokens)
    if k < 2 or not t.sum():
        return 1.0
    ratio = s.sum() / t.sum()
    error = np.sqrt(((s - ratio * t) ** 2).sum() / (k * (k - 1))) / t.mean()
    return min(1.0, float(ratio + 2 * error))


def _add_duplicate(shared: SharedTokens, length: int) -> SharedTokens:
    """A row that repeats an earlier row's content (anywhere in the data): nothing computed or stored."""
    k = shared.kinds
    return replace(shared, kinds=replace(
        k, duplicate_rows=k.duplicate_rows + 1, duplicate_tokens=k.duplicate_tokens + length))


def _add_shared(shared: SharedTokens, window: list[Sample], config: RunConfig) -> SharedTokens:
    """One sorting window's rows as --sharing groups them (streamx.data.sharing), with and without leading runs."""
    def computed(roots: list[Segment]) -> int:
        return sum(p.num_tokens for p in pieces(roots, config.token_budget))

    leading_min = config.min_shared_tokens if config.packing == "on" else None
    roots = share(window, leading_min)
    covered = list(covered_rows(roots))
    duplicates = [len(row.input_ids) for row, duplicate in covered if duplicate]
    prefixes = [len(row.input_ids) for row, duplicate in covered if not duplicate]
    leading = sum(len(s.input_ids) for s in window) - sum(duplicates) - sum(prefixes) - computed(roots)
    k = shared.kinds
    kinds = SharedKinds(k.duplicate_rows + len(duplicates), k.duplicate_tokens + sum(duplicates),
                        k.prefix_rows + len(prefixes), k.prefix_row_tokens + sum(prefixes),
                        k.leading_run_tokens + leading)
    rows_only = roots if leading_min is None else share(window, None)
    return SharedTokens(shared.prefix_rows + computed(rows_only), shared.leading_runs + computed(roots), kinds)


@dataclass
class Forecast:
    """`streamx plan`: the estimate, the free space at --out, and the time at a rate (`how`: given or calibrated)."""

    estimate: Estimate
    config: RunConfig
    tokens_per_s: float | None
    how: str
    gpu_bytes: int = 80 * 10**9  # the GPUs the footprints are fitted to
    footprints: list[Footprint] = field(default_factory=list)  # per GPU at each --tp (streamx.model.footprint)
    quantized: str | None = None  # what of the checkpoint is quantized (streamx.model.quantized.describe)
    free: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.free = free_bytes(self.config.out)

    @property
    def disk_fits(self) -> bool:
        return self.free is None or self.free >= self.estimate.sizes[self.config.storage].bytes

    @property
    def fits(self) -> bool:
        """The store fits the free space at --out, and some --tp the GPUs (`plan` exits 1 otherwise)."""
        return self.disk_fits and (not self.footprints or any(f.fits(self.gpu_bytes) for f in self.footprints
                                                              if not f.refused))

    def ways_out(self) -> list[str]:
        """Where the store does not fit: the settings that make it smaller, each with the store it makes."""
        e, config, free = self.estimate, self.config, self.free or 0
        needed = e.sizes[config.storage].bytes
        ways: list[tuple[str, float]] = []
        if config.storage != "fp8":
            ways.append(("--storage fp8 (half the bytes a state; speculators' fp8 backend reads it)",
                         e.sizes["fp8"].bytes))
        fewest = 4  # EAGLE-3's three auxiliary layers and the last state
        if len(e.layer_ids) > fewest:
            ways.append((f"--layers eagle3 ({fewest} ids instead of {len(e.layer_ids)}: about)",
                         needed * fewest / len(e.layer_ids)))
        if config.sharing == "off" and e.shared is not None:
            ways.append(("--sharing on (as measured on these rows)", needed * e.shared.leading_runs / max(1, e.tokens)))
        rows = int(e.samples * free / needed * 0.95) if needed else 0
        if rows:
            ways.append((f"--max-samples {rows:,} (a subset; the same command with a larger one later goes on)",
                         needed * rows / max(1, e.samples)))
        lines = [f"  ways out  each the store it makes, against {gb(free)} free:"]
        lines += [f"    {way}: {gb(size)} " + ("fits" if size <= free else "too small") for way, size in ways]
        lines.append("    and to train: `streamx convert --hidden-states store` lets speculators read this store, with "
                     f"no second copy of it (any other convert writes about {gb(needed)} more)")
        return lines

    @property
    def seconds(self) -> float | None:
        e = self.estimate  # the forward pass computes what sharing leaves
        return e.stored_tokens / self.tokens_per_s if self.tokens_per_s else None

    def to_json(self) -> dict[str, Any]:
        return {**self.estimate.to_json(), "storage": self.config.storage, "free_bytes": self.free,
                "tokens_per_s": self.tokens_per_s, "seconds": self.seconds, "gpu_bytes": self.gpu_bytes,
                "footprints": [asdict(f) for f in self.footprints]}

    def _cut_line(self) -> str:
        """Rows longer than --max-length: how many, the tokens cut, and the --max-length that keeps them whole."""
        e, max_length = self.estimate, self.config.max_length
        if not e.cut_rows:
            return f"cut          none: no row is longer than --max-length {max_length:,}" + (
                "" if e.exact else " in the sample")
        keeps = f"--max-length {e.keeps_all:,} keeps every row whole" + (
            f", {e.keeps_99:,} keeps 99% of them" if e.keeps_99 != e.keeps_all else "")
        share = e.cut_tokens / max(1, e.tokens + e.cut_tokens)
        return (f"cut          {e.cut_rows:,} rows ({e.cut_rows / max(1, e.samples):.1%}) are longer than --max-length "
                f"{max_length:,}: their ends past it, {e.cut_tokens:,} tokens ({share:.1%} of the data's), would not "
                f"be stored{'' if e.exact else ' (scaled from the sample)'}; {keeps}")

    def lines(self) -> list[str]:
        """What `streamx plan` prints: rows, samples, tokens, the store per storage choice, free space, time."""
        config, free, tokens_per_s, how, e = self.config, self.free, self.tokens_per_s, self.how, self.estimate
        scaled = "" if e.exact else (f" (scaled from {e.sampled_rows:,} sampled rows)" if e.rows else
                                     f" in the first {e.sampled_rows:,} rows (the stream's length is not known)")
        rejects = ", ".join(f"{k} {v:,}" for k, v in sorted(e.rejects.items())) or "none"
        lines = [
            f"rows         {e.rows:,}" if e.rows is not None else "rows         unknown (a stream)",
            f"samples      {e.samples:,}, rejected {rejects}{scaled}",
            *([f"duplicates   {e.duplicates:,} rows repeat an earlier row's content ("
               + ("left out: --skip-duplicates)" if config.skip_duplicates else "kept; --skip-duplicates leaves them "
                  "out)")] if e.duplicates else []),
            f"tokens       {e.tokens:,} ({e.trainable_tokens:,} trainable); longest sample "
            f"{e.longest_sample:,}",
            self._cut_line(),
            *([f"sharing      {e.shared.leading_runs:,} tokens computed and stored "
               f"({e.shared.leading_runs / max(1, e.tokens):.1%}) where the model continues shared prefixes, else "
               f"{e.shared.prefix_rows:,} ({e.shared.prefix_rows / max(1, e.tokens):.1%}: prefix rows and duplicates "
               "only)" + (f", at most: measured on {e.shared.sampled_runs} runs of consecutive rows"
                          if e.shared.sampled_runs else ""),
               f"  shared     {e.shared.kinds.phrase(e.tokens)} of the tokens"] if e.shared is not None else
              ["sharing      on: not estimated from the first rows of a stream (the store below is the unshared "
               "bound)"]
              if config.sharing != "off" else []),
            *(["fan-out      " + (f"in {e.shared.sampled_runs} runs of consecutive rows, " if e.shared and
                                    e.shared.sampled_runs else "") + e.fanout] if e.fanout else []),
            f"stored       {e.stored_tokens:,} tokens ({e.stored_as}): the store and the time below",
            f"layers       {e.layer_ids} of {e.num_layers}, {e.residual or f'hidden {e.hidden_size}'}",
            "storage      bytes/token   store        files" + ("   (uncompressed: an upper bound)"
                                                              if config.compressor != "none" else ""),
        ]
        for storage, size in e.sizes.items():
            chosen = "   <- --storage" if size is e.sizes[config.storage] else ""
            lines.append(f"  {storage:<10} {size.bytes_per_token:>11,}   {gb(size.bytes):<12} {size.files:,}{chosen}")
        if free is not None:
            needed = e.sizes[config.storage].bytes
            lines.append(f"free         {gb(free)} at {config.out}: " + ("fits" if free >= needed else
                                                                         f"TOO SMALL for {gb(needed)}"))
            if free < needed:
                lines += self.ways_out()
        if tokens_per_s:
            note = "; streamx measured 0.99x of the forward pass on CPU (bench/RESULTS.md)" \
                if how.startswith("calibrated") else ""
            lines.append(f"time         {duration(self.seconds)} at {tokens_per_s:,.0f} tokens/s ({how}{note})")
        else:
            lines.append("time         pass --tokens-per-s N (e.g. from streamx bench) or --calibrate")
        if self.footprints:
            lines += fit_lines(self.footprints, self.gpu_bytes, resolve_dtype(config.dtype, "cuda"),
                               config.token_budget, self.quantized)
        return lines


def gpu_forecast(config: RunConfig, est: Estimate, tokens_per_s: float | None, how: str, gpu_bytes: int,
                 gpus: int = 1, mfu: float = DEFAULT_MFU, gpu_tflops: float = H100_BF16_TFLOPS,
                 card: str = "") -> Forecast:
    """`plan`'s forecast for GPUs, from the target built once on the meta device at the dtype it computes in there:
    its bytes per GPU at each --tp and, where no rate was measured (`tokens_per_s` None), the time at a rate assumed
    from its FLOPs per token (`gpus` GPUs at `mfu` of `gpu_tflops`), said with its assumption."""
    target = meta_model(resolve_model_path(config.model), resolve_dtype(config.dtype, "cuda"))
    quantized = describe(target.config, config.dequantize)
    if config.dequantize:  # its weights at the compute dtype, as loaded
        target.config.quantization_config = None
    if tokens_per_s is None:
        if gpus < 1 or not 0 < mfu <= 1 or gpu_tflops <= 0:
            raise ValueError(f"--gpus must be >= 1, --mfu in (0, 1], --gpu-tflops > 0; got {gpus}, {mfu}, {gpu_tflops}")
        tokens_per_s, how = assumed_rate(token_cost(target, est.tokens / max(1, est.samples) / 2), gpus, mfu,
                                         gpu_tflops, card)
    found = footprints(target, config.token_budget, len(est.layer_ids), config.ep)
    return Forecast(est, config, tokens_per_s, how, gpu_bytes, found, quantized)



def duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours:,} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"
