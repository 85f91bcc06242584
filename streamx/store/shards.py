"""How a shard file is laid out, and the two ways the writer fills one.

With no compressor, the Zarr v3 sharding codec lays a shard of a token-major array out as its
chunks' raw bytes in token order (chunk i = tokens [i*c, (i+1)*c) verbatim), then an index of one
(offset, nbytes) little-endian uint64 pair per chunk, then the index's crc32c. So the writer can
stream a shard's bytes from the host batch straight into the file (`StreamedShards`), without
zarr's per-chunk encode, fill-value scan and concatenation, and zarr reads the file as if it had
written it (tests/test_writer.py compares the bytes). Anything else (compressed arrays, object
stores) is collected in host memory and written through zarr (`BufferedShards`).

Readers go to the files too where zarr's per-read cost would weigh: `ShardFiles` (token ranges as views of
mapped shard files) and `ChunkCache` (rows' own loss masks, zstd chunks decompressed here), both kept within
one budget per process (`ProcessCache`).
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import google_crc32c
import numpy as np
import zarr
from numcodecs import Zstd
from zarr.storage import LocalStore

from ..base import durable

_UNUSED_CHUNK = np.iinfo(np.uint64).max  # index entry of a chunk that holds nothing (reads as fill value)
_INDEX_ENTRY_BYTES = 2 * 8  # (offset, nbytes) as little-endian uint64
_CHECKSUM_BYTES = 4  # the index's crc32c
_ZSTD = Zstd()
V = TypeVar("V")


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


def zstd_chunk_dir(arr: zarr.Array) -> Path | None:
    """The local directory of a one-dimensional array stored as plain zstd-compressed chunks (the index arrays,
    `codecs("zstd")`), whose chunk files a reader may decompress itself: through zarr a read costs about a
    millisecond however short, the file and the decode ~0.1 ms. None for any other layout or store."""
    store = arr.store_path.store
    codecs = json.loads(json.dumps(arr.metadata.to_dict()["codecs"]))
    plain = {"name": "bytes"} if arr.dtype.itemsize == 1 else {"name": "bytes", "configuration": {"endian": "little"}}
    if not isinstance(store, LocalStore) or sys.byteorder != "little" or arr.ndim != 1 or len(codecs) != 2 \
            or codecs[0] != plain or codecs[1]["name"] != "zstd":
        return None
    return Path(store.root) / arr.path


def shard_key(arr: zarr.Array, shard: int) -> str:
    """The key of shard number `shard` (along tokens), relative to the array's directory."""
    return arr.metadata.encode_chunk_key((shard,) + (0,) * (arr.ndim - 1))


def shard_index_bytes(chunks_per_shard: int) -> int:
    """The size of the index a shard file ends with."""
    return chunks_per_shard * _INDEX_ENTRY_BYTES + _CHECKSUM_BYTES


def shard_index(filled_chunks: int, chunks_per_shard: int, chunk_nbytes: int) -> bytes:
    """The index a shard file ends with when its first `filled_chunks` chunks hold data, in order."""
    index = np.full((chunks_per_shard, 2), _UNUSED_CHUNK, dtype="<u8")
    index[:filled_chunks, 0] = np.arange(filled_chunks, dtype="<u8") * chunk_nbytes
    index[:filled_chunks, 1] = chunk_nbytes
    return index.tobytes() + np.uint32(google_crc32c.value(index.tobytes())).astype("<u4").tobytes()


class ProcessCache(Generic[V]):
    """What this process keeps of the files it reads (shard maps, decoded chunks), least recently used dropped
    first, under one budget for the whole process (every store, array and part it reads; each DataLoader worker
    is a process of its own): at most `max_items` values and `max_bytes` as `size` counts them. Keys are a
    reader's own number and what it read. Thread-safe (convert's threads read one store at once)."""

    def __init__(self, size: Callable[[V], int], max_items: int, max_bytes: int):
        self.size, self.max_items, self.max_bytes = size, max_items, max_bytes
        self.items: OrderedDict[tuple[int, int], V] = OrderedDict()
        self.held = 0  # bytes, as `size` counts them
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a fork while another thread held it would leave it held forever

    def get(self, key: tuple[int, int], load: Callable[[], V]) -> V:
        """The value kept under `key`, else `load()`'s, kept."""
        with self._lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
            value = self.items[key] = load()
            self.held += self.size(value)
            while len(self.items) > 1 and (len(self.items) > self.max_items or self.held > self.max_bytes):
                self.held -= self.size(self.items.popitem(last=False)[1])
            return value


ShardMap = tuple["mmap.mmap | None", np.ndarray]  # a shard file's map (None: no file) and its chunk index


class ShardMaps(ProcessCache[ShardMap]):
    """The shard files this process keeps mapped: at most `max_maps` files and `max_bytes` mapped. A map costs no
    descriptor and its pages are read on use, but the pages read count in the process's RSS (page cache,
    reclaimable) until it is unmapped. Small shards get many maps for shuffled reads (64 remapped 97% of reads
    over 2k shards, bench/RESULTS.md "Flat costs at scale"); 256 MiB shards a few, where one remap is small
    beside one sample's read. A returned view keeps its own map alive."""

    def __init__(self, max_maps: int = 4096, max_bytes: int = 1 << 30):
        super().__init__(lambda entry: len(entry[0]) if entry[0] is not None else 0, max_maps, max_bytes)

    def shard(self, key: tuple[int, int], path: Path, chunks: int) -> ShardMap:
        """The map of the shard file at `path` and its index of `chunks` (offset, nbytes) entries, its checksum
        checked (a reader opened later maps the files anew, as they are then); a file that is not there (zarr
        leaves out a shard that is all fill value) maps to None with every chunk unused."""
        return self.get(key, lambda: _map_shard(path, chunks))


PROCESS_MAPS = ShardMaps()  # the one budget of this process
PROCESS_CHUNKS: ProcessCache[np.ndarray] = ProcessCache(lambda values: values.nbytes, 1 << 20, 32 << 20)
_READERS = itertools.count()  # each reader's number: its part of the keys


def _map_shard(path: Path, chunks: int) -> tuple[mmap.mmap | None, np.ndarray]:
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views, never written
    except FileNotFoundError:
        return None, np.full((chunks, 2), _UNUSED_CHUNK, dtype="<u8")
    size = shard_index_bytes(chunks)
    raw = mapped[len(mapped) - size :] if len(mapped) >= size else b""
    table, checksum = raw[:-_CHECKSUM_BYTES], raw[-_CHECKSUM_BYTES:]
    if len(raw) != size or np.frombuffer(checksum, "<u4")[0] != google_crc32c.value(table):
        raise OSError(f"{path}: the shard index does not match its checksum")
    return mapped, np.frombuffer(table, "<u8").reshape(chunks, 2)


class ShardFiles:
    """Token ranges of an uncompressed local array read straight from its shard files: each file is mapped
    into memory once (mmap, within the process's ShardMaps budget) and a range comes back as a view of it at
    the offsets the shard's index gives, so no byte is copied or even read until it is used, as with
    safetensors' own files (zarr's read path copies and decodes every chunk). A range across two shards, or
    over a chunk or shard that zarr left out because it held only the fill value, is joined (a copy). The
    index of a shard is read once and its checksum checked. For arrays `streamable_dir` accepts only."""

    def __init__(self, arr: zarr.Array, maps: ShardMaps = PROCESS_MAPS):
        directory = streamable_dir(arr)
        if directory is None:
            raise ValueError(f"{arr.path}: not an uncompressed local array")
        self.arr, self.dir, self.maps = arr, directory, maps
        self.chunk_tokens, self.shard_tokens = arr.chunks[0], arr.shards[0]
        self.token_shape, self.dtype = tuple(arr.shape[1:]), np.dtype(arr.dtype)
        self.token_nbytes = int(np.prod(self.token_shape, dtype=np.int64)) * self.dtype.itemsize
        self.fill = np.asarray(arr.metadata.fill_value, dtype=self.dtype)
        self.number = next(_READERS)  # this reader's maps in the process's ShardMaps

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens a..b (within what the commit covers), as a view of the shard files where they lie in one."""
        pieces, token = [], a
        while token < b:
            shard = token // self.shard_tokens
            stop = min(b, (shard + 1) * self.shard_tokens)
            mapped, index = self.maps.shard((self.number, shard), self.dir / shard_key(self.arr, shard),
                                            self.shard_tokens // self.chunk_tokens)
            for offset, start, end in self._runs(index, token - shard * self.shard_tokens,
                                                 stop - shard * self.shard_tokens):
                if offset is None:  # left out by zarr: the fill value
                    pieces.append(np.full((end - start, *self.token_shape), self.fill, dtype=self.dtype))
                    continue
                count = (end - start) * self.token_nbytes // self.dtype.itemsize
                pieces.append(np.frombuffer(mapped, self.dtype, count, offset).reshape(end - start, *self.token_shape))
            token = stop
        if not pieces:
            return np.empty((0, *self.token_shape), dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _runs(self, index: np.ndarray, a: int, b: int) -> list[tuple[int | None, int, int]]:
        """(file offset, first token, end token) of the reads covering tokens a..b of a shard (tokens relative
        to the shard's first, the first token relative to a), adjacent chunks merged into one read; the
        offset is None for chunks the shard leaves out (the fill value)."""
        runs: list[tuple[int | None, int, int]] = []
        c = self.chunk_tokens
        for chunk in range(a // c, -(-b // c)):
            offset, _ = (int(v) for v in index[chunk])
            lo, hi = max(a, chunk * c), min(b, (chunk + 1) * c)
            start = None if offset == _UNUSED_CHUNK else offset + (lo - chunk * c) * self.token_nbytes
            last = runs[-1] if runs else None
            if last is not None and start is None and last[0] is None:
                runs[-1] = (None, last[1], hi - a)
            elif last is not None and start is not None and last[0] is not None \
                    and last[0] + (last[2] - last[1]) * self.token_nbytes == start:
                runs[-1] = (last[0], last[1], hi - a)
            else:
                runs.append((start, lo - a, hi - a))
        return runs


class ChunkCache:
    """Entries a..b of a one-dimensional compressed array (rows' own loss masks), read whole chunks at a time and
    kept in the process's ProcessCache: rows read in store order (convert, verify, --merge-prefix-rows) read
    each chunk once, not once a row. A local zstd array's chunk files are decompressed here (~0.1 ms a chunk;
    through zarr a read costs ~1 ms however short), so shuffled training reads stay cheap when a million
    rows' masks outgrow the budget."""

    def __init__(self, arr: zarr.Array, pool: ProcessCache[np.ndarray] = PROCESS_CHUNKS):
        self.arr, self.chunk, self.dir, self.pool = arr, arr.chunks[0], zstd_chunk_dir(arr), pool
        self.number = next(_READERS)  # this reader's chunks in the pool

    def read(self, a: int, b: int) -> np.ndarray:
        pieces = [self._chunk(k)[max(a, k * self.chunk) - k * self.chunk : b - k * self.chunk]
                  for k in range(a // self.chunk, -(-b // self.chunk))]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces or [np.zeros(0, self.arr.dtype)])

    def _chunk(self, k: int) -> np.ndarray:
        return self.pool.get((self.number, k), lambda: self._load(k))

    def _load(self, k: int) -> np.ndarray:
        if self.dir is None:
            return self.arr[k * self.chunk : (k + 1) * self.chunk]  # (the last chunk: as far as the array goes)
        try:
            data = (self.dir / self.arr.metadata.encode_chunk_key((k,))).read_bytes()
        except FileNotFoundError:  # zarr leaves out a chunk of nothing but the fill value
            return np.full(self.chunk, self.arr.metadata.fill_value, dtype=self.arr.dtype)
        return np.frombuffer(_ZSTD.decode(data), dtype=self.arr.dtype.newbyteorder("<"))


class ShardSink(Protocol):
    """Receives one token array's values shard by shard, in order."""

    def write(self, values: np.ndarray) -> None: ...  # the next tokens of the current shard

    def seal(self, start: int, tokens: int) -> Callable[[], None]:
        """End the current shard (at token `start`, holding `tokens`); return the work that puts it
        in place, which the committer runs while the next shard is being written."""
        ...


def shard_sink(arr: zarr.Array, start: int) -> ShardSink:
    """Streamed shard files where the layout allows, else shards through zarr; `start` is the first token
    of the shard to be written next."""
    return StreamedShards(arr, start) if streamable_dir(arr) else BufferedShards(arr)


class StreamedShards:
    """Shard files written as their bytes arrive, then renamed into place whole."""

    def __init__(self, arr: zarr.Array, start: int):
        self.arr, self.chunk_tokens, self.shard_tokens = arr, arr.chunks[0], arr.shards[0]
        self.start = start  # first token of the shard being written
        self.dir = streamable_dir(arr)
        self.token_nbytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
        self.fd: int | None = None
        self.tmp: Path | None = None  # (a killed writer's are removed when its part is opened: store.OwnedPart)

    def write(self, values: np.ndarray) -> None:
        if self.fd is None:
            final = self._path(self.start)
            durable.make_dirs(final.parent)
            self.tmp = durable.temporary(final)
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(self.fd, memoryview(np.ascontiguousarray(values)).cast("B"))

    def seal(self, start: int, tokens: int) -> Callable[[], None]:
        fd, tmp, self.fd, self.start = self.fd, self.tmp, None, start + tokens
        return lambda: self.finish(fd, tmp, start, tokens)

    def finish(self, fd: int, tmp: Path, start: int, tokens: int) -> None:
        """Pad the last chunk, append the shard index, and put the file in place durably (streamx.base.durable)."""
        chunks = -(-tokens // self.chunk_tokens)
        padding = (chunks * self.chunk_tokens - tokens) * self.token_nbytes  # a partial last chunk is stored whole
        _write_all(fd, memoryview(bytes(padding)))
        _write_all(fd, memoryview(shard_index(chunks, self.shard_tokens // self.chunk_tokens,
                                              self.chunk_tokens * self.token_nbytes)))
        os.fsync(fd)  # the bytes on disk before the name: the commit after this may name the shard
        os.close(fd)
        # readers see the old file or the whole new one, never a torn one; the rename durable before the commit
        durable.replace(tmp, self._path(start))

    def _path(self, start: int) -> Path:
        """The shard file that holds token `start`."""
        return self.dir / shard_key(self.arr, start // self.shard_tokens)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


class BufferedShards:
    """Shards collected in host memory, then written through zarr (which encodes and compresses);
    two buffers, so that the next shard fills while the committer writes the last one."""

    def __init__(self, arr: zarr.Array):
        self.arr = arr
        self.buffers = [np.empty((arr.shards[0], *arr.shape[1:]), dtype=arr.dtype) for _ in range(2)]
        self.tokens = 0

    def write(self, values: np.ndarray) -> None:
        self.buffers[0][self.tokens : self.tokens + len(values)] = values
        self.tokens += len(values)

    def seal(self, start: int, tokens: int) -> Callable[[], None]:
        sealed = self.buffers[0]
        self.buffers.reverse()  # the committer is done with the other one: one shard in flight at most
        self.tokens = 0
        return lambda: self.arr.__setitem__(slice(start, start + tokens), sealed[:tokens])
