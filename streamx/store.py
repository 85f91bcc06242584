"""The streamx store: one Zarr v3 group, token-major ragged arrays, real tokens only.

    OUT.zarr/                      attrs["streamx"]: metadata (docs/store.md)
      parts/part-00000/            one append-only part per writer; attrs["commit"] says what is valid
        hidden_states  uint16 [T, K, H]   bf16 bit patterns (uint8: fp8 e4m3fn, --storage fp8); sharded along tokens
        hidden_states_scales float32 [T]  fp8 storage only: dequantised = fp8 * scale (streamx.fp8)
        input_ids      int64  [T]
        loss_mask      uint8  [T]
        sample_row_id  int64  [N]         source row of each sample
        sample_offset  int64  [N]         first token of each sample in this part
        sample_length  int64  [N]
        reject_row_id  int64  [R]
        reject_reason  uint8  [R]         index into metadata["reject_reasons"]

Only the prefixes named by a part's commit record are valid: anything beyond was written by
a run that stopped before committing it and is overwritten on resume. Readers use this
module (`open_store(path).sample(row_id)`), never the arrays' shapes.

Format streamx-store/2 added fp8 storage; /1 stores (bf16 only) are read and resumed as they are.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import torch
import zarr
from zarr.storage import LocalStore

from . import __version__
from .fp8 import FP8, dequantize_fp8
from .metrics import gb

STORE_FORMAT = "streamx-store/2"
READABLE_FORMATS = ("streamx-store/1", STORE_FORMAT)
PARTS = "parts"
TOKEN_ARRAYS = ("hidden_states", "hidden_states_scales", "input_ids", "loss_mask")  # the scales: fp8 stores only
SAMPLE_ARRAYS = ("sample_row_id", "sample_offset", "sample_length")
REJECT_ARRAYS = ("reject_row_id", "reject_reason")
INDEX_CHUNK = 65536  # entries per chunk of the per-sample / per-reject index arrays
TOKEN_ID_BYTES = 8 + 1  # input_ids int64 and loss_mask uint8, per token

CONVENTION_TEXT = (
    "speculators: id 0 = embeddings output (input of layer 0); id k = output of decoder layer k-1 "
    "(input of layer k); id L = output of the last decoder layer, before the final norm"
)


class StoreError(RuntimeError):
    pass


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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

    def differences(self, theirs: dict[str, Any]) -> list[str]:
        ours = asdict(self)
        theirs = {"storage": "bf16", "packing": "off", **theirs}  # records from before fp8 storage and packing
        return [f"{k}: store has {theirs.get(k)!r}, this run {ours.get(k)!r}"
                for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]


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
    storage: str = "bf16"  # or fp8
    packing: str = "off"  # "on": packed forwards; "off"; "off: why" when the model cannot keep packed samples apart

    @property
    def num_slots(self) -> int:  # K
        return len(self.layer_ids)

    @property
    def bytes_per_token(self) -> int:
        return state_bytes_per_token(self.num_slots, self.hidden_size, self.storage)

    @property
    def hidden_states_dtype(self) -> str:  # as stored: bfloat16 or float8_e4m3fn
        return HIDDEN_STATES_ENCODING[self.storage]["hidden_states_dtype"]

    @property
    def random_weights(self) -> bool:
        return bool(self.model.get("random_weights"))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "num_slots": self.num_slots, "bytes_per_token": self.bytes_per_token,
                **HIDDEN_STATES_ENCODING[self.storage]}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StoreMetadata:
        known = {f.name for f in fields(cls)}
        values = {k: copy.deepcopy(v) for k, v in record.items() if k in known}
        return cls(**{**values, "compat": Compat(**values["compat"])})


@dataclass
class Commit:
    """A part's attrs["commit"]: how much of its arrays is valid. Replaced atomically, as one document."""

    samples: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    rejects: int = 0
    reject_counts: dict[str, int] = field(default_factory=dict)
    reject_examples: dict[str, str] = field(default_factory=dict)  # one example per reason
    closed: bool = False  # set by a clean close(); False: the part was interrupted
    updated: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Commit:
        known = {f.name for f in fields(cls)}
        return cls(**{k: copy.deepcopy(v) for k, v in record.items() if k in known})  # never alias zarr's attrs


HIDDEN_STATES_ENCODING = {  # recorded in the metadata for readers without streamx
    "bf16": {"hidden_states_dtype": "bfloat16",
             "hidden_states_encoding": "uint16 bit pattern of bfloat16 (zarr 3.1 has no bfloat16); bit-exact"},
    "fp8": {"hidden_states_dtype": "float8_e4m3fn",
            "hidden_states_encoding": "uint8 bit pattern of float8_e4m3fn; hidden_states_scales float32 [T], one per "
                                      "token; dequantised = bfloat16(fp8) * bfloat16(scale), as speculators' fp8 "
                                      "backend"},
}


def state_bytes_per_token(num_slots: int, hidden_size: int, storage: str) -> int:
    """Hidden-state bytes one token takes: K x H bf16 values, or K x H fp8 values and a float32 scale."""
    return num_slots * hidden_size * 2 if storage == "bf16" else num_slots * hidden_size + 4


@dataclass(frozen=True)
class Layout:
    num_slots: int  # K, one per layer id
    hidden_size: int  # H
    chunk_tokens: int
    shard_tokens: int
    compressor: str = "none"
    storage: str = "bf16"

    @property
    def bytes_per_token(self) -> int:
        return state_bytes_per_token(self.num_slots, self.hidden_size, self.storage)


def make_layout(num_slots: int, hidden_size: int, chunk_tokens: int = 0, shard_tokens: int = 0,
                compressor: str = "none", storage: str = "bf16") -> Layout:
    """Defaults: ~4 MiB chunks (what a reader fetches at once) in ~256 MiB shard files (what
    the filesystem sees), so 50 TiB is ~200k files whatever the number of samples."""
    per_token = state_bytes_per_token(num_slots, hidden_size, storage)
    chunk = chunk_tokens or max(1, (4 << 20) // per_token)
    shard = shard_tokens or max(1, (256 << 20) // per_token // chunk) * chunk
    if shard % chunk:
        raise ValueError(f"shard_tokens ({shard}) must be a multiple of chunk_tokens ({chunk})")
    return Layout(num_slots, hidden_size, chunk, shard, compressor, storage)


@dataclass
class StoredSample:
    row_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T]
    hidden_states: torch.Tensor  # bfloat16 [T, K, H], slots in ascending layer id (raw fp8: float8_e4m3fn)
    hidden_states_scales: torch.Tensor | None = None  # raw fp8 reads only: float32 [T]


def bf16_to_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def stored_bits(t: torch.Tensor) -> np.ndarray:
    """Host states as the store holds them: bf16 as uint16 bit patterns, fp8 as uint8."""
    return bf16_to_bits(t) if t.dtype == torch.bfloat16 else t.contiguous().view(torch.uint8).numpy()


def bits_to_bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def _codecs(compressor: str) -> Any:
    """The zarr codecs of a --compressor choice (bench/RESULTS.md, "Lossless codecs", measures each)."""
    if compressor == "none":
        return None
    if compressor == "zstd":
        return [zarr.codecs.ZstdCodec(level=1)]
    shuffle, cname = compressor.split("-")  # blosc: byte or bit shuffle (typesize from the dtype), then lz4 or zstd
    return [zarr.codecs.BloscCodec(cname=cname, clevel=1 if cname == "zstd" else 5, shuffle=shuffle)]


def create_part(root: zarr.Group, name: str, layout: Layout) -> zarr.Group:
    part = root.require_group(PARTS).create_group(name, attributes={"commit": Commit().to_json()})
    K, H, c, s = layout.num_slots, layout.hidden_size, layout.chunk_tokens, layout.shard_tokens
    part.create_array("hidden_states", shape=(0, K, H), dtype="uint16" if layout.storage == "bf16" else "uint8",
                      chunks=(c, K, H), shards=(s, K, H), compressors=_codecs(layout.compressor), fill_value=0)
    if layout.storage == "fp8":
        part.create_array("hidden_states_scales", shape=(0,), dtype="float32", chunks=(c,), shards=(s,),
                          compressors=None, fill_value=0)
    # token ids and masks share the states' token grid and stay uncompressed, so the writer streams them
    # too (store.streamable_dir); compressing them would save ~0.1% of the store for a zarr encode per shard
    for name_, dtype in (("input_ids", "int64"), ("loss_mask", "uint8")):
        part.create_array(name_, shape=(0,), dtype=dtype, chunks=(c,), shards=(s,), compressors=None, fill_value=0)
    for name_, dtype in (*((a, "int64") for a in (*SAMPLE_ARRAYS, "reject_row_id")), ("reject_reason", "uint8")):
        part.create_array(name_, shape=(0,), dtype=dtype, chunks=(INDEX_CHUNK,), compressors=_codecs("zstd"),
                          fill_value=0)
    return part


# -- shard files written directly (writer.StreamedShards)
#
# With no compressor, the Zarr v3 sharding codec lays a shard of a token-major array out as its
# chunks' raw bytes in token order (chunk i = tokens [i*c, (i+1)*c) verbatim), then an index of one
# (offset, nbytes) little-endian uint64 pair per chunk, then the index's crc32c. So the writer can
# stream a shard's bytes from the host batch straight into the file, without zarr's per-chunk
# encode, fill-value scan and concatenation, and zarr reads the file as if it had written it.

_UNUSED_CHUNK = np.iinfo(np.uint64).max  # index entry of a chunk that holds nothing (reads as fill value)


def _streamable_codecs(arr: zarr.Array) -> list[dict[str, Any]]:
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    inner = {"name": "bytes"} if arr.dtype.itemsize == 1 else little  # one-byte values have no byte order
    return [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(arr.chunks), "codecs": [inner], "index_codecs": [little, {"name": "crc32c"}],
        "index_location": "end"}}]


def streamable_dir(arr: zarr.Array) -> Path | None:
    """The array's local directory when its shard files may be written directly: a local store and
    exactly the uncompressed layout above. None otherwise (zarr writes its shards)."""
    store = arr.store_path.store
    codecs = json.loads(json.dumps(arr.metadata.to_dict()["codecs"]))
    if not isinstance(store, LocalStore) or sys.byteorder != "little" or codecs != _streamable_codecs(arr):
        return None
    return Path(store.root) / arr.path


def shard_key(arr: zarr.Array, shard: int) -> str:
    """The key of shard number `shard` (along tokens), relative to the array's directory."""
    return arr.metadata.encode_chunk_key((shard,) + (0,) * (arr.ndim - 1))


def shard_index(filled_chunks: int, chunks_per_shard: int, chunk_nbytes: int) -> bytes:
    """The index a shard file ends with when its first `filled_chunks` chunks hold data, in order."""
    index = np.full((chunks_per_shard, 2), _UNUSED_CHUNK, dtype="<u8")
    index[:filled_chunks, 0] = np.arange(filled_chunks, dtype="<u8") * chunk_nbytes
    index[:filled_chunks, 1] = chunk_nbytes
    return index.tobytes() + np.uint32(google_crc32c.value(index.tobytes())).astype("<u4").tobytes()


# -- free space


def free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem that holds (or will hold) `path`; None for object stores."""
    if "://" in path:
        return None
    target = Path(path).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    return shutil.disk_usage(existing).free


class SpaceGuard:
    """Stops a run cleanly before its filesystem fills up: checked after each shard's commit. The
    reserve covers the shards in flight and leaves room for the commit records."""

    def __init__(self, path: str, reserve: int):
        self.path, self.reserve = path, reserve

    @classmethod
    def for_layout(cls, path: str, layout: Layout) -> SpaceGuard:
        """Room for two shards (one being written, one being put in place) and 64 MiB of records."""
        return cls(path, 2 * layout.shard_tokens * (layout.bytes_per_token + TOKEN_ID_BYTES) + (64 << 20))

    def check(self) -> None:
        free = free_bytes(self.path)
        if free is not None and free < self.reserve:
            raise StoreError(f"stopped: {gb(free)} left on the filesystem of {self.path}, under the {gb(self.reserve)} "
                             "reserve; everything written so far is committed: free space and re-run the same "
                             "command to resume (--no-space-check disables this check)")


def _is_store(path: str) -> bool:
    try:
        return "streamx" in zarr.open_group(path, mode="r").attrs
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, ValueError, KeyError):
        return False


def check_output(path: str, overwrite: bool = False) -> None:
    """Fail early (before a model is loaded) when `path` cannot become or continue a store: a local
    folder holding other files, or a place this process may not write."""
    if "://" in path:
        return  # object stores: credentials and buckets are checked when the store is created
    target = Path(path)
    if target.exists() and not overwrite and any(target.iterdir()) and not _is_store(path):
        raise StoreError(f"{path} exists and is not a streamx store; choose another --out or pass --overwrite")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise StoreError(f"cannot write the store at {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK):
        raise StoreError(f"cannot write the store at {path}: {existing} is not writable")


def commits(path: str) -> list[Commit]:
    """The commit record of each part of the store at `path` (none when there is no store). The records
    alone: a run reads the per-sample index once, when it opens the store."""
    if not _is_store(path):
        return []
    return [Commit.from_json(part.attrs["commit"]) for _, part in zarr.open_group(path, mode="r")[PARTS].groups()]


def output_state(path: str, overwrite: bool = False) -> str:
    """What a run will do with `path`, in words: a new store, a replaced one, or a resumed one."""
    if not _is_store(path):
        return "new store"
    if overwrite:
        return "existing store, replaced (--overwrite)"
    done = commits(path)
    return f"resuming: {sum(c.samples for c in done):,} samples already committed in {len(done)} part(s)"


def prepare(path: str, metadata: StoreMetadata, overwrite: bool = False) -> None:
    """Create the store, or check that an existing one may be resumed by this run (its compat record
    matches) and refresh its metadata. One process (rank 0) calls this before any opens a part."""
    local = "://" not in path
    if overwrite or not _is_store(path):
        check_output(path, overwrite)
        try:
            if local:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            root = zarr.open_group(path, mode="w")
            root.attrs["streamx"] = metadata.to_json()
            root.create_group(PARTS)
        except OSError as err:
            raise StoreError(f"cannot write the store at {path}: {err.strerror or err}") from None
        return
    root = _open_compatible(path, metadata)
    root.attrs["streamx"] = {**metadata.to_json(), "created": root.attrs["streamx"].get("created", metadata.created)}


@dataclass
class RunStore:
    """A prepared store opened by one writer process (a torchrun rank): the source rows some part has
    already committed, as a sample or a reject, which the run must skip, and the way to its own part."""

    root: zarr.Group
    done_rows: set[int]

    def part(self, name: str, layout: Layout) -> zarr.Group:
        """This process's part, created when new. Under torchrun, call it only once every rank has read
        `done_rows`: a part being created is not yet readable."""
        parts = self.root.require_group(PARTS)
        return parts[name] if name in parts else create_part(self.root, name, layout)


def open_for_run(path: str, metadata: StoreMetadata) -> RunStore:
    """Open a prepared store for writing, after checking that this run may resume it."""
    root = _open_compatible(path, metadata)
    return RunStore(root, Store.from_group(root, path).done_row_ids())


def _open_compatible(path: str, metadata: StoreMetadata) -> zarr.Group:
    root = zarr.open_group(path, mode="r+")
    theirs = root.attrs["streamx"].get("compat", {})
    differences = metadata.compat.differences(theirs)
    if differences:
        # e.g. a hybrid model's store from before its linear-attention layers could pack
        resume = f", --packing {theirs.get('packing', 'off')} to resume it" if differences[0].startswith("packing:") \
            and len(differences) == 1 else ""
        raise StoreError(f"{path} was written by an incompatible run ({'; '.join(differences)}); pass --overwrite "
                         f"to start over{resume}, or choose another --out")
    return root


@dataclass(frozen=True)
class SampleIndex:
    rows: np.ndarray  # source row id of each sample
    parts: np.ndarray  # its part's number (in store.parts order)
    offsets: np.ndarray  # its first token in that part
    lengths: np.ndarray


class Store:
    """Read API over a store: samples by source row, counts, rejects, metadata."""

    def __init__(self, path: str):
        try:
            root = zarr.open_group(path, mode="r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError):
            raise StoreError(f"{path} is not a streamx store") from None
        self._load(root, path)

    @classmethod
    def from_group(cls, root: zarr.Group, path: str) -> Store:
        store = cls.__new__(cls)
        store._load(root, path)
        return store

    def _load(self, root: zarr.Group, path: str) -> None:
        if "streamx" not in root.attrs:
            raise StoreError(f"{path} is not a streamx store")
        self.root, self.path = root, path
        record = dict(root.attrs["streamx"])
        if record.get("format") not in READABLE_FORMATS:
            raise StoreError(f"{path} has store format {record.get('format')!r}, which this streamx {__version__} "
                             f"cannot read ({', '.join(READABLE_FORMATS)}); upgrade streamx")
        self.metadata = StoreMetadata.from_json(record)
        self.parts: dict[str, zarr.Group] = dict(sorted(root[PARTS].groups()))
        self.commits = {name: Commit.from_json(part.attrs["commit"]) for name, part in self.parts.items()}
        # row index: for every committed sample, its part, offset and length (sorted by row id)
        rows, offsets, lengths, part_ids = [], [], [], []
        for i, (name, part) in enumerate(self.parts.items()):
            n = self.commits[name].samples
            rows.append(part["sample_row_id"][:n])
            offsets.append(part["sample_offset"][:n])
            lengths.append(part["sample_length"][:n])
            part_ids.append(np.full(n, i))
        self._rows, self._offsets, self._lengths, self._part_ids = (
            np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64) for xs in (rows, offsets, lengths, part_ids)
        )
        self._order = np.argsort(self._rows, kind="stable")
        self._part_list = list(self.parts.values())

    @property
    def layer_ids(self) -> list[int]:
        return list(self.metadata.layer_ids)

    def __len__(self) -> int:
        return int(self._rows.size)

    @property
    def num_tokens(self) -> int:
        return sum(c.tokens for c in self.commits.values())

    def row_ids(self) -> np.ndarray:
        """Committed source rows, ascending (store[i] is the sample of row_ids()[i])."""
        return self._rows[self._order]

    def __getitem__(self, position: int) -> StoredSample:
        """The sample at `position` in ascending row order (0 <= position < len(store))."""
        if not -len(self) <= position < len(self):
            raise IndexError(f"position {position} out of range for a store of {len(self)} samples")
        return self._read(int(self._order[position]))

    @property
    def index(self) -> SampleIndex:
        """Where every committed sample lies, in store order (part by part, as written)."""
        return SampleIndex(self._rows, self._part_ids, self._offsets, self._lengths)

    def read(self, i: int, raw: bool = False) -> StoredSample:
        """The sample at position i in store order (index's order)."""
        return self._read(i, raw)

    def rejected(self) -> list[tuple[int, str]]:
        reasons = self.metadata.reject_reasons
        out = []
        for name, part in self.parts.items():
            n = self.commits[name].rejects
            out += [(int(r), reasons[int(c)]) for r, c in zip(part["reject_row_id"][:n], part["reject_reason"][:n],
                                                                           strict=True)]
        return out

    def done_row_ids(self) -> set[int]:
        """Rows a resumed run must not process again: committed samples and committed rejects."""
        return set(self._rows.tolist()) | {row for row, _ in self.rejected()}

    def _read(self, i: int, raw: bool = False) -> StoredSample:
        part = self._part_list[int(self._part_ids[i])]
        a = int(self._offsets[i])
        b = a + int(self._lengths[i])
        stored = part["hidden_states"][a:b]
        if self.metadata.storage == "bf16":
            hidden, scales = bits_to_bf16(stored), None
        else:
            values = torch.from_numpy(stored).view(FP8)
            token_scales = torch.from_numpy(part["hidden_states_scales"][a:b])
            hidden, scales = (values, token_scales) if raw else (dequantize_fp8(values, token_scales), None)
        return StoredSample(row_id=int(self._rows[i]), input_ids=torch.from_numpy(part["input_ids"][a:b]),
                            loss_mask=torch.from_numpy(part["loss_mask"][a:b].astype(np.int64)),
                            hidden_states=hidden, hidden_states_scales=scales)

    def sample(self, row_id: int, raw: bool = False) -> StoredSample:
        """The sample of source row `row_id`. Its states are bf16; with `raw`, an fp8 store's are the stored
        float8_e4m3fn values with their float32 scales in `hidden_states_scales`."""
        pos = np.searchsorted(self._rows, row_id, sorter=self._order)
        if pos >= self._rows.size or self._rows[self._order[pos]] != row_id:
            raise KeyError(f"source row {row_id} is not in the store")
        return self._read(int(self._order[pos]), raw)

    def samples(self, raw: bool = False) -> Iterator[StoredSample]:
        """Every committed sample, in store order (part by part, as written)."""
        for i in range(len(self)):
            yield self._read(i, raw)

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        examples: dict[str, str] = {}
        for c in self.commits.values():
            for reason, n in c.reject_counts.items():
                counts[reason] = counts.get(reason, 0) + n
            examples.update({k: v for k, v in c.reject_examples.items() if k not in examples})
        return {
            "path": self.path,
            "samples": len(self),
            "tokens": self.num_tokens,
            "trainable_tokens": sum(c.trainable_tokens for c in self.commits.values()),
            "rejected": sum(counts.values()),
            "reject_counts": counts,
            "reject_examples": examples,
            "duplicate_rows": int(self._rows.size - np.unique(self._rows).size),
            "hidden_state_bytes": self.num_tokens * self.metadata.bytes_per_token,
            "parts": {name: {"samples": c.samples, "tokens": c.tokens, "rejects": c.rejects, "closed": c.closed}
                      for name, c in self.commits.items()},
            "metadata": self.metadata.to_json(),
        }


def open_store(path: str) -> Store:
    return Store(path)


def to_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, default=str)
