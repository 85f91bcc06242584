"""One packed forward's segments, as its attention and sample-wise layers need them, built once per forward.

A packed batch (streamx.data.batching) is one row of segments side by side. A segment that continues another
(shared prefixes, streamx.data.sharing) starts at a position past 0; its parent is a segment before it in the row,
or a segment an earlier forward computed and kept (streamx.model.carry: a root here, whose queries also see the
kept keys of that segment's chain). Batches lay each tree out parents first, depth first, so a segment's
descendants are the segments right after it (`subtree_ends`).

`PackedForward` is read on the host from the batch (never from the device, which would stall the GPU in every
layer) and handed to the decoder as a keyword argument (`FORWARD_KWARG`), which transformers passes down to every
attention call the way it passes `cu_seq_lens_q`; the sample-wise layers take it from the decoder's arguments.
Each forward and each model owns its own: nothing lives in globals.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..data.batching import Batch
from ..data.sharing import Segment
from .carry import Kept

FORWARD_KWARG = "streamx_forward"  # the decoder's keyword argument that carries a PackedForward


@dataclass(frozen=True)
class Join:
    """One variable-length attention call that adds keys to some queries: sequence i's queries (the packed tokens
    at `queries[cu_q[i]:cu_q[i+1]]`) attend to the keys of the packed tokens at `keys[cu_k[i]:cu_k[i+1]]`, or (one
    sequence) to a kept segment's whole chain (`kept`, streamx.model.carry)."""

    queries: torch.Tensor  # int64, on the forward's device
    cu_q: torch.Tensor  # int32 [sequences + 1]
    max_q: int
    cu_k: torch.Tensor  # int32 [sequences + 1]
    max_k: int
    keys: torch.Tensor | None = None  # int64 (None: the kept chain's)
    kept: Segment | None = None

    @classmethod
    def of(cls, query_ranges: list[tuple[int, int]], key_ranges: list[tuple[int, int]], device: torch.device,
           kept: Segment | None = None) -> Join:
        """Sequence i: the queries of query_ranges[i] on the keys of key_ranges[i]; or every query of the ranges
        on the chain of `kept` (its tokens 0..kept.end)."""
        queries = _index(query_ranges, device)
        if kept is not None:
            return cls(queries, _cumulative([len(queries)], device), len(queries), _cumulative([kept.end], device),
                       kept.end, kept=kept)
        q_lengths, k_lengths = [b - a for a, b in query_ranges], [b - a for a, b in key_ranges]
        return cls(queries, _cumulative(q_lengths, device), max(q_lengths), _cumulative(k_lengths, device),
                   max(k_lengths), keys=_index(key_ranges, device))


@dataclass(frozen=True)
class Run:
    """Consecutive queries of one segment and the keys they may see: tokens [queries) of the packed row, at
    positions from `position`, on the keys at positions `key_position` up to their last query's, which lie at
    `keys` (ranges of the key source: the packed row, then the kept segments, PackedForward.key_source)."""

    queries: tuple[int, int]
    position: int
    key_position: int
    keys: list[tuple[int, int]]

    @property
    def num_keys(self) -> int:
        return sum(b - a for a, b in self.keys)


@dataclass(frozen=True)
class Runs:
    """A forward's queries as runs (in order: they cover the packed row once), for one kind of attention layer (a
    window, chunks); on CUDA one variable-length call takes them all (`varlen`)."""

    runs: list[Run]
    own_keys: bool  # every run's keys are its own queries: no keys to gather
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def varlen(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, int, int]:
        """(the key source's tokens to gather, or None where each run's keys are its queries; cu_q; cu_k; the
        most queries of a run; the most keys), built once per forward on its device."""
        if device not in self._on_device:
            q_lengths = [b - a for a, b in (run.queries for run in self.runs)]
            k_lengths = [run.num_keys for run in self.runs]
            keys = None if self.own_keys else _index([r for run in self.runs for r in run.keys], device)
            self._on_device[device] = (keys, _cumulative(q_lengths, device), _cumulative(k_lengths, device),
                                       max(q_lengths), max(k_lengths))
        return self._on_device[device]


@dataclass(eq=False)
class PackedForward:
    """The running packed forward: where its segments lie, where each starts (position), which continues which,
    what it continues from earlier forwards and keeps for later ones (and the `Kept` states that hold them)."""

    cu_seq_lens: torch.Tensor  # int32 [S + 1] on the forward's device (the varlen kernels take it)
    bounds: list[int]  # the same on the host
    firsts: list[int]  # each segment's first position
    parents: list[int] | None  # segment -> the segment here it continues (-1: none); None: nothing continues
    carried: dict[int, Segment]  # segment -> the kept segment (an earlier forward's) it continues
    exports: dict[int, Segment]  # segment -> kept for later forwards
    kept: Kept
    position_ids: torch.Tensor | None = None  # int64 [1, T] on the device (None: 0..T-1)
    _cache: dict = field(default_factory=dict)  # what is built once per forward (key ranges, joins, runs)

    @classmethod
    def of(cls, batch: Batch, kept: Kept, cu_seq_lens: torch.Tensor, position_ids: torch.Tensor) -> PackedForward:
        """The forward of packed `batch` (cu_seq_lens, position_ids: its boundaries and positions on the device)."""
        bounds = batch.cu_seq_lens.tolist()
        firsts = batch.position_ids[0, bounds[:-1]].tolist()
        carried = dict(batch.carry.parents) if batch.carry is not None else {}
        exports = dict(batch.carry.exports) if batch.carry is not None else {}
        parents = batch.segment_parents or ([-1] * (len(bounds) - 1) if carried else None)
        for s, first in enumerate(firsts):
            if first and (parents is None or parents[s] < 0) and s not in carried:
                raise ValueError(f"packed segment {s} starts at position {first} after no segment ending there")
        return cls(cu_seq_lens, bounds, firsts, parents, carried, exports, kept, position_ids)

    @classmethod
    def single(cls, length: int, device: torch.device) -> PackedForward:
        """A forward of one sequence from position 0 (an unpacked call of the packed attention)."""
        return cls(torch.tensor([0, length], dtype=torch.int32, device=device), [0, length], [0], None, {}, {}, Kept())

    @property
    def segments(self) -> range:
        return range(len(self.bounds) - 1)

    def length(self, segment: int) -> int:
        return self.bounds[segment + 1] - self.bounds[segment]

    @property
    def reach(self) -> int:
        """The most positions any query's chain spans (a window or chunk at least this long changes nothing)."""
        if "reach" not in self._cache:
            self._cache["reach"] = max(self.firsts[s] + self.length(s) for s in self.segments)
        return self._cache["reach"]

    @property
    def subtree_ends(self) -> list[int]:
        """Segment -> where the tokens of its descendants end (its own end: none)."""
        if "subtree_ends" not in self._cache:
            self._cache["subtree_ends"] = self.bounds[1:] if self.parents is None else _subtree_ends(self.bounds,
                                                                                                     self.parents)
        return self._cache["subtree_ends"]

    def root(self, segment: int) -> int:
        while self.parents is not None and self.parents[segment] >= 0:
            segment = self.parents[segment]
        return segment

    def starts_clean(self, segment: int) -> bool:
        """The segment continues nothing, here or from an earlier forward."""
        return (self.parents is None or self.parents[segment] < 0) and segment not in self.carried

    def lineage(self, segment: int) -> list[int]:
        """The segments of this forward that `segment` continues, root first, then itself."""
        cache = self._cache.setdefault("lineage", {})
        if segment not in cache:
            chain, s = [], segment
            while s >= 0:
                chain.append(s)
                s = self.parents[s] if self.parents is not None else -1
            cache[segment] = chain[::-1]
        return cache[segment]

    def key_ranges(self, segment: int) -> list[tuple[int, int]]:
        """The tokens of this forward that `segment` attends to, as ranges of the packed row: its ancestors', then
        its own."""
        return [(self.bounds[s], self.bounds[s + 1]) for s in self.lineage(segment)]

    def carried_parent(self, segment: int) -> Segment | None:
        """The segment an earlier forward computed that `segment`'s chain here starts from (None: none)."""
        return self.carried.get(self.root(segment))

    def carried_spans(self) -> list[tuple[int, int, Segment]]:
        """(first, end, kept segment): the runs of this forward's tokens whose queries also attend to a kept
        segment's chain (a root continuing it and its descendants; neighbours continuing the same one joined)."""
        spans: list[tuple[int, int, Segment]] = []
        for s in sorted(self.carried):
            a, end, parent = self.bounds[s], self.subtree_ends[s], self.carried[s]
            if spans and spans[-1][2] is parent and spans[-1][1] == a:
                spans[-1] = (spans[-1][0], end, parent)
            else:
                spans.append((a, end, parent))
        return spans

    def varlen_joins(self) -> list[Join]:
        """What the forward's queries attend to besides their own segment's keys, as variable-length attention
        calls: one per tree depth (each segment there with descendants: the queries of its descendants, which
        follow it, on its keys; such segments' subtrees are disjoint), then one per kept chain (the runs of
        queries continuing it, on its keys). Built once per forward, on the forward's device."""
        if "joins" not in self._cache:
            self._cache["joins"] = [] if self.parents is None else self._joins()
        return self._cache["joins"]

    def _joins(self) -> list[Join]:
        device, bounds, depth = self.cu_seq_lens.device, self.bounds, []
        for parent in self.parents:
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
        joins = []
        for level in range(max(depth) + 1):
            pairs = [((bounds[s + 1], end), (bounds[s], bounds[s + 1]))
                     for s, end in enumerate(self.subtree_ends) if depth[s] == level and end != bounds[s + 1]]
            if pairs:
                joins.append(Join.of([q for q, _ in pairs], [k for _, k in pairs], device))
        by_chain: dict[int, tuple[Segment, list[tuple[int, int]]]] = {}
        for a, end, kept in self.carried_spans():
            by_chain.setdefault(id(kept), (kept, []))[1].append((a, end))
        joins += [Join.of(spans, [], device, kept) for kept, spans in by_chain.values()]
        return joins

    @property
    def kept_segments(self) -> list[Segment]:
        """The earlier forwards' segments this one continues (their whole chains), in the key source's order."""
        if "kept_segments" not in self._cache:
            seen: dict[int, Segment] = {}
            for parent in self.carried.values():
                for segment in parent.chain():
                    seen.setdefault(id(segment), segment)
            self._cache["kept_segments"] = list(seen.values())
        return self._cache["kept_segments"]

    def key_source(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values runs read ([1, kv heads, tokens, d]): the packed row's, then each kept segment's."""
        if not self.kept_segments:
            return key, value
        kept = [self.kept.keys[segment][layer] for segment in self.kept_segments]
        return torch.cat([key, *(k for k, _ in kept)], dim=2), torch.cat([value, *(v for _, v in kept)], dim=2)

    def runs(self, window: int | None, chunk: int | None, block: int | None) -> Runs:
        """The forward's queries as runs, for attention layers that see at most `window` positions back (the
        query's own included, as transformers' sliding_window) or only the positions of their own `chunk`
        (Llama 4's chunked attention), at most `block` queries a run (None: any number), each on the keys its
        queries may see: from its window's or chunk's first position (0: the whole chain) to its last query."""
        key = (window, chunk, block)
        cache = self._cache.setdefault("runs", {})
        if key not in cache:
            runs = [run for s in self.segments for run in self._segment_runs(s, window, chunk, block)]
            own = all(run.keys == [run.queries] for run in runs)
            cache[key] = Runs(runs, own)
        return cache[key]

    def _chain(self, segment: int) -> list[tuple[int, int, int]]:
        """(first position, end position, where in the key source) of each part of `segment`'s chain, root first:
        the kept segments it continues, its ancestors here, itself."""
        if "kept_at" not in self._cache:
            kept = self.kept_segments
            starts = itertools.accumulate([s.length for s in kept], initial=self.bounds[-1])
            self._cache["kept_at"] = dict(zip(map(id, kept), starts, strict=False))
        kept_at = self._cache["kept_at"]
        parent = self.carried_parent(segment)
        parts = [(s.depth, s.end, kept_at[id(s)]) for s in parent.chain()] if parent is not None else []
        here = [(self.firsts[s], self.firsts[s] + self.length(s), self.bounds[s]) for s in self.lineage(segment)]
        return parts + here

    def _segment_runs(self, segment: int, window: int | None, chunk: int | None, block: int | None) -> list[Run]:
        chain = self._chain(segment)
        a, first = self.bounds[segment], self.firsts[segment]
        end = first + self.length(segment)
        runs, p = [], first
        while p < end:
            q = end
            if chunk:
                q = min(q, (p // chunk + 1) * chunk)
            if block:
                q = min(q, p + block)
            lo = 0
            if window:
                lo = max(lo, p - window + 1)
            if chunk:
                lo = max(lo, p // chunk * chunk)
            keys: list[tuple[int, int]] = []
            for start, stop, at in chain:
                x, y = max(lo, start), min(q, stop)
                if x < y:
                    if keys and keys[-1][1] == at + x - start:
                        keys[-1] = (keys[-1][0], at + y - start)
                    else:
                        keys.append((at + x - start, at + y - start))
            runs.append(Run((a + p - first, a + q - first), p, lo, keys))
            p = q
        return runs


def _subtree_ends(bounds: list[int], parents: list[int]) -> list[int]:
    ends, open_chain = bounds[1:], []  # the segments whose descendants may still follow, root first
    for s, parent in enumerate(parents):
        while open_chain and open_chain[-1] != parent:
            open_chain.pop()
        if parent >= 0 and not open_chain:
            raise ValueError(f"packed segment {s} does not follow its parent's tree (parents first, depth first)")
        for ancestor in open_chain:
            ends[ancestor] = bounds[s + 1]
        open_chain.append(s)
    return ends


def _index(ranges: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device)


def forward_inputs(batch: Batch, device: torch.device, kept: Kept) -> dict:
    """The decoder's keyword arguments for `batch` (Batch.model_inputs), with its PackedForward when packed."""
    inputs = batch.model_inputs(device)
    if batch.packed:
        inputs[FORWARD_KWARG] = PackedForward.of(batch, kept, inputs["cu_seq_lens_q"], inputs["position_ids"])
    return inputs
