"""How a shard file is laid out, and the two ways the writer fills one.

With no compressor, the Zarr v3 sharding codec lays a shard of a token-major array out as its
chunks' raw bytes in token order (chunk i = tokens [i*c, (i+1)*c) verbatim), then an index of one
(offset, nbytes) little-endian uint64 pair per chunk, then the index's crc32c. So the writer can
stream a shard's bytes from the host batch straight into the file (`StreamedShards`), without
zarr's per-chunk encode, fill-value scan and concatenation, and zarr reads the file as if it had
written it (tests/test_writer.py compares the bytes). Anything else (compressed arrays, object
stores) is collected in host memory and written through zarr (`BufferedShards`).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import google_crc32c
import numpy as np
import zarr
from zarr.storage import LocalStore

from ..base import durable

_UNUSED_CHUNK = np.iinfo(np.uint64).max  # index entry of a chunk that holds nothing (reads as fill value)
_INDEX_ENTRY_BYTES = 2 * 8  # (offset, nbytes) as little-endian uint64
_CHECKSUM_BYTES = 4  # the index's crc32c


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


def shard_index_bytes(chunks_per_shard: int) -> int:
    """The size of the index a shard file ends with."""
    return chunks_per_shard * _INDEX_ENTRY_BYTES + _CHECKSUM_BYTES


def shard_index(filled_chunks: int, chunks_per_shard: int, chunk_nbytes: int) -> bytes:
    """The index a shard file ends with when its first `filled_chunks` chunks hold data, in order."""
    index = np.full((chunks_per_shard, 2), _UNUSED_CHUNK, dtype="<u8")
    index[:filled_chunks, 0] = np.arange(filled_chunks, dtype="<u8") * chunk_nbytes
    index[:filled_chunks, 1] = chunk_nbytes
    return index.tobytes() + np.uint32(google_crc32c.value(index.tobytes())).astype("<u4").tobytes()


class ShardFiles:
    """Token ranges of an uncompressed local array read straight from its shard files: each file is mapped
    into memory once (mmap) and a range comes back as a view of it at the offsets the shard's index gives,
    so no byte is copied or even read until it is used, as with safetensors' own files (zarr's read path
    copies and decodes every chunk). A range across two shards is joined (a copy). The index of a shard is
    read once and its checksum checked. For arrays `streamable_dir` accepts only."""

    # shard files kept mapped, up to MAPS files and MAP_BYTES: a map costs no descriptor and its pages are read on
    # use, but the pages read count in the process's RSS (page cache, reclaimable) until it is unmapped. Small
    # shards get many maps for shuffled reads (64 remapped 97% of reads over 2k shards, bench/RESULTS.md "Flat
    # costs at scale"); 256 MiB shards a few, where one remap is small beside one sample's read. A returned view
    # keeps its own map alive.
    MAPS = 4096
    MAP_BYTES = 1 << 30

    def __init__(self, arr: zarr.Array):
        directory = streamable_dir(arr)
        if directory is None:
            raise ValueError(f"{arr.path}: not an uncompressed local array")
        self.arr, self.dir = arr, directory
        self.chunk_tokens, self.shard_tokens = arr.chunks[0], arr.shards[0]
        self.token_shape, self.dtype = tuple(arr.shape[1:]), np.dtype(arr.dtype)
        self.token_nbytes = int(np.prod(self.token_shape, dtype=np.int64)) * self.dtype.itemsize
        self._maps: OrderedDict[int, tuple[mmap.mmap, np.ndarray]] = OrderedDict()  # shard -> (map, index)
        self._mapped = 0  # bytes
        self._lock = threading.Lock()  # convert's threads read one store at once

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens a..b (within what the commit covers), as a view of the shard files where they lie in one."""
        pieces, token = [], a
        while token < b:
            shard = token // self.shard_tokens
            stop = min(b, (shard + 1) * self.shard_tokens)
            mapped, index = self._map(shard)
            for offset, start, end in self._runs(index, token - shard * self.shard_tokens,
                                                 stop - shard * self.shard_tokens):
                count = (end - start) * self.token_nbytes // self.dtype.itemsize
                pieces.append(np.frombuffer(mapped, self.dtype, count, offset).reshape(end - start, *self.token_shape))
            token = stop
        if not pieces:
            return np.empty((0, *self.token_shape), dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _map(self, shard: int) -> tuple[mmap.mmap, np.ndarray]:
        with self._lock:
            return self._mapped_shard(shard)

    def _mapped_shard(self, shard: int) -> tuple[mmap.mmap, np.ndarray]:
        if shard in self._maps:
            self._maps.move_to_end(shard)
            return self._maps[shard]
        path = self.dir / shard_key(self.arr, shard)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views, never written
        chunks = self.shard_tokens // self.chunk_tokens
        size = shard_index_bytes(chunks)
        raw = mapped[len(mapped) - size :] if len(mapped) >= size else b""
        table, checksum = raw[:-_CHECKSUM_BYTES], raw[-_CHECKSUM_BYTES:]
        if len(raw) != size or np.frombuffer(checksum, "<u4")[0] != google_crc32c.value(table):
            raise OSError(f"{path}: the shard index does not match its checksum")
        entry = self._maps[shard] = (mapped, np.frombuffer(table, "<u8").reshape(chunks, 2))
        self._mapped += len(mapped)
        while len(self._maps) > 1 and (len(self._maps) > self.MAPS or self._mapped > self.MAP_BYTES):
            self._mapped -= len(self._maps.popitem(last=False)[1][0])
        return entry

    def _runs(self, index: np.ndarray, a: int, b: int) -> list[tuple[int, int, int]]:
        """(file offset, first token, end token) of the reads covering tokens a..b of a shard (tokens relative
        to the shard's first, the first token relative to a), adjacent chunks merged into one read."""
        runs: list[tuple[int, int, int]] = []
        c = self.chunk_tokens
        for chunk in range(a // c, -(-b // c)):
            offset, nbytes = (int(v) for v in index[chunk])
            if offset == _UNUSED_CHUNK:
                raise OSError(f"{self.arr.path}: chunk {chunk} of a shard holds no data inside the committed tokens")
            lo, hi = max(a, chunk * c), min(b, (chunk + 1) * c)
            start = offset + (lo - chunk * c) * self.token_nbytes
            if runs and runs[-1][0] + (runs[-1][2] - runs[-1][1]) * self.token_nbytes == start:
                runs[-1] = (runs[-1][0], runs[-1][1], hi - a)
            else:
                runs.append((start, lo - a, hi - a))
        return runs


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
        self.tmp: Path | None = None
        for stale in self.dir.glob("streamx-shard-*.partial"):  # a killed writer's; one writer per part
            stale.unlink()

    def write(self, values: np.ndarray) -> None:
        if self.fd is None:
            self.tmp = self.dir / f"streamx-shard-{self.start // self.shard_tokens:06d}.partial"
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
        durable.replace(tmp, self.dir / shard_key(self.arr, start // self.shard_tokens))


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
