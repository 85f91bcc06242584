"""What a streamx store is: one Zarr v3 group, token-major ragged arrays, real tokens only.

    OUT.zarr/                      attrs["streamx"]: StoreMetadata (docs/store.md)
      parts/part-00000/            one append-only part per writer; attrs["commit"]: a Commit, what is valid
        hidden_states  uint16 [T, K, H]   bf16 bit patterns (uint8: fp8 e4m3fn, --storage fp8); sharded along tokens
        hidden_states_scales float32 [T]  fp8 storage only: dequantised = fp8 * scale (streamx.store.fp8)
        input_ids      int64  [T]
        loss_mask      uint8  [T]
        sample_row_id  int64  [N]         source row of each sample
        sample_offset  int64  [N]         first token of each sample in this part
        sample_length  int64  [N]
        sample_content_key uint64 [N]     its row's content key (tokenize.content_key; 0: none)
        sample_way     uint8  [N]         how the run computed it (proof.audit.Way.code; 0: not recorded, a part
                                          from before streamx 0.8.1): a resume that finds a way wrong heals its rows
        sample_cut     int64  [N]         its row's tokens past --max-length, cut there and not stored (a part
                                          from before streamx 0.8.2 lacks it)
        sample_range_start int64 [N]      --sharing: its first entry in the range table, when it has several
        sample_range_count int64 [N]      0: its tokens are sample_length tokens from sample_offset; else so many
                                          ranges, in order, from range_offset/range_length[sample_range_start:]
        sample_mask_offset int64 [N]      -1: its loss mask is loss_mask over its tokens; else its own, in
                                          row_loss_mask[offset : offset + sample_length]
        range_offset   int64  [G]         ranges of rows that share tokens with other rows (a shared prefix)
        range_length   int64  [G]
        row_loss_mask  uint8  [M]         the own loss masks of rows whose mask differs from loss_mask's
        sample_same_as int64  [N]         -1; else the source row whose content it repeats (format /4): it reads
                                          that row's sample, wherever it lies, and its own offset and ranges mean
                                          nothing
        sample_digest  uint64 [N, 2]      its tokens' 128-bit digest (tokenize.tokens_digest; 0: not recorded,
                                          format /5): a repeat reads its row only where the two are equal
        reject_row_id  int64  [R]
        reject_reason  uint8  [R]         index into metadata["reject_reasons"]
        reject_content_key uint64 [R]

Only the prefixes named by a part's commit record are valid: anything beyond was written by
a run that stopped before committing it and is overwritten on resume. Readers use the read API
(streamx.store.reader), never the arrays' shapes.

With --sharing (format streamx-store/3), a row that is a prefix of another, or that starts like others, reads
the tokens they share where they lie once: its states are the concatenation of its ranges, and the token
arrays' loss_mask is, on a shared token, the union of the masks of the rows that read it (each row keeps its
own mask where it differs). Format /4 adds `sample_same_as`: a row whose content repeats an earlier row's, anywhere
in the data, is not computed and reads that row; /5 adds `sample_digest`, which proves it is that row (a
repeat whose digest differs reads as missing, and the next run computes it). Format /2 added fp8 storage;
/1 to /4 stores are read and resumed as they are (parts without the range arrays: every sample is contiguous;
without `sample_same_as`: every repeated row is computed in its sorting window; without `sample_digest`: a
repeat of its first row's length is read as that row).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
import zarr

from .fp8 import FP8, dequantize_fp8, quantize_fp8

STORE_FORMAT = "streamx-store/5"
READABLE_FORMATS = ("streamx-store/1", "streamx-store/2", "streamx-store/3", "streamx-store/4", STORE_FORMAT)
PARTS = "parts"
GROUP_DOCUMENTS = 3  # zarr.json of the store, of parts/ and of the part
INDEX_CHUNK = 65536  # entries per chunk of the per-sample / per-reject index arrays
# each entry's content key (tokenize.content_key; 0: none, e.g. an unreadable row): what a resume needs of the
# rows it does not read again. Parts written before streamx 0.4 lack the two key arrays (CONTENT_KEY_ARRAYS),
# those before 0.8.1 `sample_way`, those before 0.8.2 `sample_cut` (the writer passes over an array a part lacks).
SAMPLE_ARRAYS = {"sample_row_id": "int64", "sample_offset": "int64", "sample_length": "int64",
                 "sample_content_key": "uint64", "sample_way": "uint8", "sample_cut": "int64"}
REJECT_ARRAYS = {"reject_row_id": "int64", "reject_reason": "uint8", "reject_content_key": "uint64"}
CONTENT_KEY_ARRAYS = ("sample_content_key", "reject_content_key")
# --sharing's (streamx >= 0.5): where each row's tokens lie when it shares them, and the rows' own masks
SHARING_SAMPLE_ARRAYS = {"sample_range_start": "int64", "sample_range_count": "int64", "sample_mask_offset": "int64"}
RANGE_ARRAYS = {"range_offset": "int64", "range_length": "int64"}
ROW_MASK_ARRAYS = {"row_loss_mask": "uint8"}
SHARING_ARRAYS = (*SHARING_SAMPLE_ARRAYS, *RANGE_ARRAYS, *ROW_MASK_ARRAYS)
# format /4 (streamx >= 0.6): the row a repeated row reads (-1: none), so that repeats anywhere in the data share
SAME_AS_ARRAYS = {"sample_same_as": "int64"}
# format /5 (streamx >= 0.7): each sample's tokens_digest, two uint64 words (little-endian halves of its 16 bytes)
DIGEST_ARRAY = "sample_digest"


def digest_words(digests: list[bytes]) -> np.ndarray:
    """Digests (16 bytes each; b"": not recorded, stored as zeros) as DIGEST_ARRAY's [N, 2] uint64 rows."""
    raw = b"".join(d or bytes(16) for d in digests)
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 2).astype(np.uint64)
TOKEN_ID_ARRAYS = {"input_ids": "int64", "loss_mask": "uint8"}
SCALE_DTYPE = "float32"  # hidden_states_scales, one per token (fp8 storage)

CONVENTION_TEXT = (
    "speculators: id 0 = embeddings output (input of layer 0); id k = output of decoder layer k-1 "
    "(input of layer k); id L = output of the last decoder layer, before the final norm"
)


def entry_bytes(arrays: dict[str, str]) -> int:
    """Bytes one entry (a token, a sample, a reject) takes across `arrays`, uncompressed."""
    return sum(np.dtype(dtype).itemsize for dtype in arrays.values())


class StoreError(RuntimeError):
    pass


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- how the hidden states are stored


_BITS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16)}  # same-width integers: bit patterns move as is


@dataclass(frozen=True)
class Storage:
    """One --storage choice: the states' dtype as stored, the arrays it adds, and the way to and from it."""

    name: str  # the --storage value
    dtype: torch.dtype  # the states as stored
    zarr_dtype: str  # the hidden_states array's (zarr 3.1 has neither bfloat16 nor float8: their bit patterns)
    scaled: bool  # one float32 scale per token in hidden_states_scales
    lossless: bool  # bit-exact with the bf16 states the capture packs
    encoding: str  # recorded in the metadata for readers without streamx

    @property
    def token_arrays(self) -> tuple[str, ...]:
        return ("hidden_states", *(("hidden_states_scales",) if self.scaled else ()), *TOKEN_ID_ARRAYS)

    def bytes_per_token(self, num_slots: int, hidden_size: int) -> int:
        """Hidden-state bytes one token takes: K x H values, and its scale."""
        scale = np.dtype(SCALE_DTYPE).itemsize if self.scaled else 0
        return num_slots * hidden_size * self.dtype.itemsize + scale

    def encode(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """bf16 states [N, K, H] -> (values as stored, float32 scales [N] or None), on the states' device."""
        return quantize_fp8(states) if self.scaled else (states, None)

    def to_bits(self, values: torch.Tensor) -> np.ndarray:
        """Host values as stored (encode's) -> the array's bit patterns, without a copy."""
        signed, _ = _BITS[self.dtype.itemsize]
        return values.contiguous().view(signed).numpy().view(self.zarr_dtype)

    def from_bits(self, bits: np.ndarray) -> torch.Tensor:
        _, signed = _BITS[self.dtype.itemsize]
        return torch.from_numpy(np.ascontiguousarray(bits).view(signed)).view(self.dtype)

    def decode(self, bits: np.ndarray, scales: np.ndarray | None) -> torch.Tensor:
        """Stored bits (and scales) -> bf16 states, as speculators' loaders read them."""
        values = self.from_bits(bits)
        return dequantize_fp8(values, torch.from_numpy(scales)) if self.scaled else values

    def decode_float32(self, bits: np.ndarray, scales: np.ndarray | None) -> torch.Tensor:
        """Stored bits (and scales) -> float32 states, exactly decode's values."""
        if self.scaled:
            return self.decode(bits, scales).float()
        return torch.from_numpy(bits.astype(np.int32) << 16).view(torch.float32)  # bf16 bits are float32's top half


BF16 = Storage("bf16", torch.bfloat16, "uint16", scaled=False, lossless=True,
               encoding="uint16 bit pattern of bfloat16 (zarr 3.1 has no bfloat16); bit-exact")
FP8_STORAGE = Storage("fp8", FP8, "uint8", scaled=True, lossless=False,
                      encoding="uint8 bit pattern of float8_e4m3fn; hidden_states_scales float32 [T], one per token; "
                               "dequantised = bfloat16(fp8) * bfloat16(scale), as speculators' fp8 backend")
STORAGES = {s.name: s for s in (BF16, FP8_STORAGE)}


def storage_named(name: str) -> Storage:
    if name not in STORAGES:
        raise StoreError(f"storage must be one of {', '.join(STORAGES)}; got {name!r}")
    return STORAGES[name]


def part_storage(part: zarr.Group) -> Storage:
    """The storage a part was created with, from its hidden_states array."""
    dtype = str(part["hidden_states"].dtype)
    return next(s for s in STORAGES.values() if s.zarr_dtype == dtype)


def bf16_to_bits(t: torch.Tensor) -> np.ndarray:
    return BF16.to_bits(t)


# -- the records


@dataclass(frozen=True)
class Compat:
    """What a re-run must match to resume a store; any difference is refused, naming the field."""

    model: str  # the weights fingerprint (models.fingerprint_weights)
    compute_dtype: str
    layer_ids: list[int]
    tokenization: str  # the tokenizer fingerprint (tokenize.tokenizer_fingerprint)
    data: str
    split: str
    storage: str = "bf16"
    packing: str = "off"  # on or off: packed and padded forwards round differently, so a resume must not mix them
    skip_duplicates: bool = False  # a resume must not mix kept repeats with left-out ones
    data_fingerprint: str = ""  # data.provenance.fingerprint: the same bytes wherever they lie ("": not local)
    sharing: str = "off"  # data.sharing.Sharing.setting: which rows are computed together decides their rounding
    train_turns: str = "all"  # the turns a chat row's mask trains (in `tokenization` too: here so a refusal names it)

    def differences(self, theirs: dict[str, Any], unknown: Collection[str] = ()) -> list[str]:
        """What differs from a store's record `theirs`, one "field: store has X, this run Y" each; the fields in
        `unknown` are not compared (not known yet: a check before the model loads)."""
        ours = asdict(self)
        # records from before fp8 storage, packing, --skip-duplicates, data fingerprints, sharing and --train-turns
        theirs = {"storage": BF16.name, "packing": "off", "skip_duplicates": False, "data_fingerprint": "",
                  "sharing": "off", "train_turns": "all", **theirs}
        if theirs["data_fingerprint"] and ours["data_fingerprint"]:  # the data is its bytes, not its path
            theirs, ours = {**theirs, "data": None}, {**ours, "data": None}
        else:
            theirs, ours = {**theirs, "data_fingerprint": None}, {**ours, "data_fingerprint": None}
        return [f"{k}: store has {theirs.get(k)!r}, this run {ours.get(k)!r}"
                for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k) and k not in unknown]


@dataclass(frozen=True)
class Layout:
    num_slots: int  # K, one per layer id
    hidden_size: int  # H
    chunk_tokens: int
    shard_tokens: int
    compressor: str = "none"
    storage: Storage = BF16

    @property
    def bytes_per_token(self) -> int:
        return self.storage.bytes_per_token(self.num_slots, self.hidden_size)


def make_layout(num_slots: int, hidden_size: int, chunk_tokens: int = 0, shard_tokens: int = 0,
                compressor: str = "none", storage: str = "bf16") -> Layout:
    """Defaults: ~4 MiB chunks (what a reader fetches at once) in ~256 MiB shard files (what
    the filesystem sees), so 50 TiB is ~200k files whatever the number of samples."""
    kind = storage_named(storage)
    per_token = kind.bytes_per_token(num_slots, hidden_size)
    chunk = chunk_tokens or max(1, (4 << 20) // per_token)
    shard = shard_tokens or max(1, (256 << 20) // per_token // chunk) * chunk
    if shard % chunk:
        raise ValueError(f"shard_tokens ({shard}) must be a multiple of chunk_tokens ({chunk})")
    return Layout(num_slots, hidden_size, chunk, shard, compressor, kind)


@dataclass
class StoreMetadata:
    """The store's attrs["streamx"] (docs/store.md, "Metadata")."""

    layer_ids: list[int]  # ascending; slot j of hidden_states holds layer_ids[j]
    num_layers: int  # L
    hidden_size: int  # H
    chunk_tokens: int
    shard_tokens: int
    compressor: str
    model: dict[str, Any]  # models.ModelInfo: name, resolved path, revision, weights fingerprint, ...
    tokenizer: dict[str, Any]  # name_or_path, fingerprint, chat_template_sha256
    max_length: int
    truncation: str
    config: dict[str, Any]  # the resolved RunConfig
    versions: dict[str, str]
    reject_reasons: list[str]  # reject_reason codes index this list
    compat: Compat
    created: str = field(default_factory=_now)
    format: str = STORE_FORMAT
    layer_convention: str = "speculators"
    layer_convention_text: str = CONVENTION_TEXT
    last_id_is_pre_norm: bool = True
    storage: str = "bf16"  # a STORAGES name
    packing: str = "off"  # "on": packed forwards; "off"; "off: why" when the model cannot keep packed samples apart
    sharing: str = "off"  # data.sharing.Sharing as recorded: "off", "on", or "rows: why" (no shared leading runs)

    @property
    def num_slots(self) -> int:  # K
        return len(self.layer_ids)

    @property
    def layout(self) -> Layout:
        return Layout(self.num_slots, self.hidden_size, self.chunk_tokens, self.shard_tokens, self.compressor,
                      storage_named(self.storage))

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @property
    def hidden_states_dtype(self) -> str:  # as stored: bfloat16 or float8_e4m3fn
        return str(self.layout.storage.dtype).removeprefix("torch.")

    @property
    def random_weights(self) -> bool:
        return bool(self.model.get("random_weights"))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "num_slots": self.num_slots, "bytes_per_token": self.bytes_per_token,
                "hidden_states_dtype": self.hidden_states_dtype,
                "hidden_states_encoding": self.layout.storage.encoding}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StoreMetadata:
        known = {f.name for f in fields(cls)}
        values = {k: copy.deepcopy(v) for k, v in record.items() if k in known}
        return cls(**{**values, "compat": Compat(**values["compat"])})


@dataclass
class Audited:
    """What a run's in-run audit did (streamx.proof.audit), as each part's commit record keeps it (summed over
    the runs that wrote the part)."""

    rows: int = 0
    tokens: int = 0
    worst: float = 0.0  # the largest relative difference of an audited token
    worst_row: int | None = None
    seconds: float = 0.0  # the audit's forwards and comparisons
    forward_seconds: float = 0.0  # the run's forwards meanwhile, for the audit's share
    ways: list[str] | None = None  # the ways of computing rows it audited
    # per way the run computed rows: [rows audited, longest audited, rows computed, longest computed]
    coverage: dict[str, list[int]] | None = None
    found: list[dict] | None = None  # the ways found wrong: row, way, layer id, token, difference (audit.Finding)
    rung: str | None = None  # how the run computed its rows after dropping them (proof.ladder; None: as planned)
    recomputed: int = 0  # rows computed again the safe way after a way was found wrong
    to_heal: list[list[int]] | None = None  # [first, last] row id ranges committed a way found wrong, waiting
    tolerance: dict | None = None  # what it judged by (proof.tolerance.Tolerance.to_json): the model's own noise

    def saw(self, way: str, length: int) -> None:
        """The run computed a row of `length` tokens `way`."""
        entry = self.coverage.setdefault(way, [0, 0, 0, 0])
        entry[2], entry[3] = entry[2] + 1, max(entry[3], length)

    def add(self, way: str, row: int, length: int, compared: int, worst: float) -> None:
        """An audited row of `length` tokens (`compared` of them computed here), its worst token `worst`."""
        entry = self.coverage.setdefault(way, [0, 0, 0, 0])
        entry[0], entry[1] = entry[0] + 1, max(entry[1], length)
        self.rows, self.tokens = self.rows + 1, self.tokens + compared
        self.ways = sorted(set(self.ways or []) | {way})
        if worst > self.worst or self.worst_row is None:
            self.worst, self.worst_row = worst, row

    def merged(self, earlier: dict | None) -> Audited:
        """This run's figures added to an earlier run's of the same part (a resume); what is left to heal and how
        rows are computed are this run's."""
        if not earlier:
            return self
        before = Audited.from_json(earlier)
        worst = max((self.worst, self.worst_row), (before.worst, before.worst_row), key=lambda w: w[0])
        coverage = {way: list(entry) for way, entry in (before.coverage or {}).items()}
        for way, entry in (self.coverage or {}).items():
            was = coverage.get(way, [0, 0, 0, 0])
            coverage[way] = [was[0] + entry[0], max(was[1], entry[1]), was[2] + entry[2], max(was[3], entry[3])]
        return Audited(self.rows + before.rows, self.tokens + before.tokens, worst[0], worst[1],
                       self.seconds + before.seconds, self.forward_seconds + before.forward_seconds,
                       sorted(set(self.ways or []) | set(before.ways or [])), coverage,
                       [*(before.found or []), *(self.found or [])] or None, self.rung or before.rung,
                       self.recomputed + before.recomputed, self.to_heal, self.tolerance or before.tolerance)

    @classmethod
    def from_json(cls, record: dict) -> Audited:
        known = {f.name for f in fields(cls)}  # (a newer streamx's record may hold more)
        return cls(**{k: v for k, v in record.items() if k in known})

    @property
    def share(self) -> float:
        """The audit's time over the run's forwards."""
        return self.seconds / self.forward_seconds if self.forward_seconds else 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def unaudited(self) -> list[str]:
        """The ways (and lengths) the run computed rows that no audited row covers: a way never audited, or rows
        more than twice as long as its longest audited one."""
        out = []
        for way, (rows, longest, _, computed) in sorted((self.coverage or {}).items()):
            if not rows:
                out.append(f"{way} (rows up to {computed:,} tokens)")
            elif computed > 2 * longest:
                out.append(f"{way} past {longest:,} tokens (rows up to {computed:,})")
        return out

    def phrase(self) -> str:
        found = [f"found wrong: row {f['row']} ({f['way']}), layer id {f['layer_id']}, token {f['token']}, relative "
                 f"difference {f['difference']:.3g}"
                 + (f" ({f['earlier_rows']:,} rows an earlier run computed that way not recomputed: which ones is not "
                    "recorded)" if f.get("earlier_rows") else "") for f in self.found or []]
        healed = ([f"then computed {self.rung}; {self.recomputed:,} rows computed again that way"]
                  if self.rung else [])
        waiting = ([f"{sum(b - a + 1 for a, b in self.to_heal):,} rows computed a way found wrong wait to be "
                    "computed again: run the same command"] if self.to_heal else [])
        if not self.rows:
            return "; ".join(["no row audited", *found, *healed, *waiting])
        unaudited = self.unaudited()
        return "; ".join([
            f"{self.rows:,} rows ({self.tokens:,} tokens) recomputed alone through the model's own forward, worst "
            f"token {self.worst:.2g} of its own size away (row {self.worst_row}{self.judged()}); {self.share:.1%} of "
            "the forward time",
            f"ways: {' | '.join(self._covered() if self.coverage else self.ways or [])}",
            *([f"not audited (the budget, --audit-share): {' | '.join(unaudited)}"] if unaudited else []),
            *found, *healed, *waiting])

    def judged(self) -> str:
        """What the audit judged by, where the model's own noise set it (reduced precision): "; within ..." or ""."""
        judged = self.tolerance or {}
        if not judged.get("dtype"):
            return ""
        return (f"; within {judged['token']:.2g} on a token and {judged['typical']:.2g} on a row's median token: "
                f"{judged['dtype']} noise of this model {judged['noise_worst']:.2g} at worst, "
                f"{judged['noise_typical']:.2g} typically")

    def _covered(self) -> list[str]:
        return [f"{way} ({rows:,} of {computed_rows:,} rows, up to {longest:,} tokens)"
                for way, (rows, longest, computed_rows, _) in sorted((self.coverage or {}).items()) if rows]


@dataclass
class Commit:
    """A part's attrs["commit"]: how much of its arrays is valid. Replaced atomically, as one document."""

    samples: int = 0
    tokens: int = 0  # tokens stored (the token arrays' committed length)
    trainable_tokens: int = 0
    row_tokens: int | None = None  # the samples' tokens (None: a record from before --sharing, where they are `tokens`)
    ranges: int = 0  # entries of the range table in use
    row_masks: int = 0  # entries of row_loss_mask in use
    duplicates: int = 0  # samples whose content repeats an earlier row's (kept: --skip-duplicates was off)
    cut_rows: int | None = None  # samples whose row was longer than --max-length, cut there (None: not counted,
    # a part from before streamx 0.8.2)
    cut_tokens: int | None = None  # their tokens past it, not stored
    rejects: int = 0
    reject_counts: dict[str, int] = field(default_factory=dict)
    reject_examples: dict[str, str] = field(default_factory=dict)  # one example per reason
    closed: bool = False  # set by a close() at the end of the data; False: interrupted (killed, or stopped by a signal)
    source_rows: int | None = None  # the data's rows (up to --max-samples), recorded by that close (streamx >= 0.4)
    updated: str | None = None
    writer: dict[str, Any] | None = None  # who made this commit: {"id", "host", "pid"} (pipeline.writer's fencing)
    fanout: str | None = None  # rows that extend an earlier row's messages but not its tokens (data.fanout), as a run
    # that tokenized them found
    audit: dict[str, Any] | None = None  # the in-run audit's figures, summed over the runs of the part
    # (store.format.Audited)
    data_digests: dict[str, list] = field(default_factory=dict)  # {first row: [rows, digest]} of the source windows
    # whose rows the part holds, as read when it committed them (data.provenance.RowDigests: a resume's edit check)

    @property
    def samples_tokens(self) -> int:
        """The committed samples' tokens, shared or not."""
        return self.tokens if self.row_tokens is None else self.row_tokens

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Commit:
        known = {f.name for f in fields(cls)}
        return cls(**{k: copy.deepcopy(v) for k, v in record.items() if k in known})  # never alias zarr's attrs

    def since(self, earlier: Commit) -> Commit:
        """What was committed after `earlier` (this part's record when a run opened it)."""
        return Commit(samples=self.samples - earlier.samples, tokens=self.tokens - earlier.tokens,
                      trainable_tokens=self.trainable_tokens - earlier.trainable_tokens,
                      row_tokens=self.samples_tokens - earlier.samples_tokens, ranges=self.ranges - earlier.ranges,
                      row_masks=self.row_masks - earlier.row_masks,
                      duplicates=self.duplicates - earlier.duplicates,
                      cut_rows=(self.cut_rows or 0) - (earlier.cut_rows or 0),
                      cut_tokens=(self.cut_tokens or 0) - (earlier.cut_tokens or 0),
                      rejects=self.rejects - earlier.rejects,
                      reject_counts={k: n - earlier.reject_counts.get(k, 0) for k, n in self.reject_counts.items()
                                     if n > earlier.reject_counts.get(k, 0)}, closed=self.closed,
                      updated=self.updated)


@dataclass(frozen=True)
class SharedKinds:
    """Row tokens that --sharing computes and stores once, by kind: rows not computed at all (exact duplicates,
    and rows that are a strict prefix of another row) and the rest of the common leading runs rows continue."""

    duplicate_rows: int = 0  # rows whose tokens are another row's (all but one of each set)
    duplicate_tokens: int = 0
    prefix_rows: int = 0  # rows whose tokens start another, longer row (fanned-out turns, agent steps)
    prefix_row_tokens: int = 0
    leading_run_tokens: int = 0  # the other rows' tokens in leading runs beyond the first time each is computed

    def phrase(self, row_tokens: int) -> str:
        """The share of each kind, of `row_tokens`: what run's summary, inspect, plan and bench print."""
        def pct(n: int) -> str:
            return f"{n / max(1, row_tokens):.1%}"

        def rows(n: int) -> str:
            return f"{n:,} row" + ("" if n == 1 else "s")
        return (f"duplicates {pct(self.duplicate_tokens)} ({rows(self.duplicate_rows)}), prefix rows "
                f"{pct(self.prefix_row_tokens)} ({rows(self.prefix_rows)}), leading runs "
                f"{pct(self.leading_run_tokens)}")


# -- a part's arrays


def codecs(compressor: str) -> Any:
    """The zarr codecs of a --compressor choice (bench/RESULTS.md, "Lossless codecs", measures each)."""
    if compressor == "none":
        return None
    if compressor == "zstd":
        return [zarr.codecs.ZstdCodec(level=1)]
    shuffle, cname = compressor.split("-")  # blosc: byte or bit shuffle (typesize from the dtype), then lz4 or zstd
    return [zarr.codecs.BloscCodec(cname=cname, clevel=1 if cname == "zstd" else 5, shuffle=shuffle)]


def create_part(root: zarr.Group, name: str, layout: Layout) -> zarr.Group:
    """A new, empty part. Its commit record is written last, once every array is there: a part without one
    was being created when its writer was killed, and readers pass it over (`committed_parts`)."""
    part = root.require_group(PARTS).create_group(name)
    K, H, c, s = layout.num_slots, layout.hidden_size, layout.chunk_tokens, layout.shard_tokens
    part.create_array("hidden_states", shape=(0, K, H), dtype=layout.storage.zarr_dtype, chunks=(c, K, H),
                      shards=(s, K, H), compressors=codecs(layout.compressor), fill_value=0)
    # the scales, token ids and masks share the states' token grid and stay uncompressed, so the writer streams
    # them too (store.shards); compressing them would save ~0.1% of the store for a zarr encode per shard
    token_arrays = {**({"hidden_states_scales": SCALE_DTYPE} if layout.storage.scaled else {}), **TOKEN_ID_ARRAYS}
    for array, dtype in token_arrays.items():
        part.create_array(array, shape=(0,), dtype=dtype, chunks=(c,), shards=(s,), compressors=None, fill_value=0)
    for array, dtype in {**SAMPLE_ARRAYS, **REJECT_ARRAYS, **SHARING_SAMPLE_ARRAYS, **SAME_AS_ARRAYS, **RANGE_ARRAYS,
                         **ROW_MASK_ARRAYS}.items():
        # (their fill values are what a sample that shares nothing holds: no chunk files when nothing is shared)
        part.create_array(array, shape=(0,), dtype=dtype, chunks=(INDEX_CHUNK,), compressors=codecs("zstd"),
                          fill_value=-1 if array in ("sample_mask_offset", "sample_same_as") else 0)
    # (zstd for the chunk's padding past the last sample: zarr writes whole chunks, 1 MiB each here)
    part.create_array(DIGEST_ARRAY, shape=(0, 2), dtype="uint64", chunks=(INDEX_CHUNK, 2), compressors=codecs("zstd"),
                      fill_value=0)
    part.attrs["commit"] = Commit(row_tokens=0).to_json()
    return part


LAST_ARRAY = "reject_reason"  # the last array every format's create_part made (the content keys came later)


def part_is_complete(part: zarr.Group) -> bool:
    """Whether the part has its commit record and its arrays: not a part being created, nor one a killed writer
    left half-created (streamx before 0.4 wrote the record first, then the arrays in order, `LAST_ARRAY` last).
    Read without listing the part, whose folder may hold a killed writer's temporary files."""
    return "commit" in part.attrs and LAST_ARRAY in part


def committed_parts(root: zarr.Group) -> tuple[dict[str, zarr.Group], list[str]]:
    """The complete parts, by name, and the names of the others (being created, or left half-created by a
    killed writer: nothing in them is committed, and a resume creates them anew). A root without its `parts`
    group (left by streamx before 0.7, killed between prepare's two writes) has none."""
    parts = dict(sorted(root[PARTS].groups())) if PARTS in root else {}
    committed = {name: part for name, part in parts.items() if part_is_complete(part)}
    return committed, [name for name in parts if name not in committed]
