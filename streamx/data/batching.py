"""Batches under a token budget, from a window of source rows.

Packed (the default where the model allows it, streamx.model.packing): the samples' real tokens side by
side in one row, position ids restarting at each sample, boundaries in `cu_seq_lens`; a window's
samples are bin-packed longest first (first fit) so that each batch holds up to `token_budget` real
tokens and nothing is padding.

Padded (--packing off, or a model that cannot keep packed samples apart): samples sorted by length
and cut greedily into right-padded batches whose padded size (batch x longest) stays within
`token_budget`. Right padding keeps positions 0..T-1 of every real token exact under causal
attention, so the real tokens' states do not depend on the padding.

With --sharing (streamx.data.sharing) the units batched are pieces of segment trees rather than samples: a
row that is a prefix of another is served by that row's computed tokens, and a segment that continues
another starts at its parent's end position. Each batch says which computed tokens make up each row it
serves (`row_ranges`). A tree too large for one batch is cut into pieces that run alone and in order, each
continuing what the ones before it computed (`Carry`).

Either way rejects pass straight through, and batches depend only on the window's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from .sharing import Piece, Segment, pieces, row_ranges, share
from .source import Row
from .tokenize import Duplicate, Reject, Sample


@dataclass
class Carry:
    """What a batch shares with the other batches of a tree cut into several (streamx.data.sharing): the
    segments it continues from states an earlier batch kept, those it keeps for later ones, and the rows'
    tokens that an earlier batch computed."""

    parents: dict[int, Segment]  # its segment -> the earlier batch's segment it continues
    exports: dict[int, Segment]  # its segment -> kept (its states and where it is stored) for later batches
    releases: list[Segment]  # earlier batches' segments that no later batch continues: let go after this one
    rows: list[list[tuple[Segment, int]]]  # per row served: the earlier batches' segments it starts with, and how
    # many of each one's tokens it reads (its `row_ranges` follow them)


@dataclass
class Batch:
    """One forward pass: the sequences it computes (segments: a row each, or with --sharing a row's part that
    other rows share), and the rows it serves, each a run of ranges over the computed tokens."""

    samples: list[Sample]  # the rows it serves, in the order they are stored
    input_ids: torch.Tensor  # int64 [B, S] right-padded, or [1, N] packed
    attention_mask: torch.Tensor | None  # int64 [B, S]; None when packed
    token_index: torch.Tensor  # int64 [N]: flat b * S + t of every computed token, segment after segment
    segment_index: torch.Tensor  # int64 [N]: which segment (0..B-1) each computed token belongs to
    segment_lengths: list[int]
    row_ranges: list[list[tuple[int, int]]]  # per sample: (first computed token, length) of each of its parts
    # here (after those an earlier batch computed, `carry`)
    position_ids: torch.Tensor | None = None  # packed: int64 [1, N], each segment from its first token's position
    cu_seq_lens: torch.Tensor | None = None  # packed: int32 [B + 1], where each segment starts, then N
    segment_parents: list[int] | None = None  # packed, with shared prefixes: the segment each continues (-1: none)
    carry: Carry | None = None  # packed, one of several batches of a tree

    @property
    def packed(self) -> bool:
        return self.cu_seq_lens is not None

    def pin_memory(self) -> None:
        for name in ("input_ids", "attention_mask", "token_index", "segment_index", "position_ids", "cu_seq_lens"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).pin_memory())

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor | int]:
        """The decoder's keyword arguments: ids with their padding mask, or with the packed boundaries
        (flash-attention's and flash-linear-attention's names, which transformers passes down). A segment that
        continues another gets its ancestors' keys from streamx.model.packing (`segment_parents`)."""
        inputs: dict[str, torch.Tensor | int] = {"input_ids": self.input_ids.to(device, non_blocking=True)}
        if not self.packed:
            inputs["attention_mask"] = self.attention_mask.to(device, non_blocking=True)
            return inputs
        cu = self.cu_seq_lens.to(device, non_blocking=True)
        longest = max(self.segment_lengths)
        return {**inputs, "position_ids": self.position_ids.to(device, non_blocking=True), "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    @property
    def shape_key(self) -> tuple:
        """What a forward's kernels depend on: the padded shape, or the packed segments' lengths (and tree)."""
        if not self.packed:
            return tuple(self.input_ids.shape)
        tree = ("tree", *self.segment_parents) if self.segment_parents else ()
        carried = ("carried", *((s, p.end) for s, p in sorted(self.carry.parents.items()))) if self.carry else ()
        return ("packed", *self.segment_lengths, *tree, *carried)

    @property
    def num_tokens(self) -> int:
        """Tokens computed (and stored)."""
        return int(self.token_index.numel())

    @property
    def row_tokens(self) -> int:
        """Tokens of the rows served."""
        return sum(len(s.input_ids) for s in self.samples)

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def computed_ids(self) -> np.ndarray:
        """The token ids of the computed tokens, in order (what the store keeps beside their states)."""
        return self.input_ids.numpy().reshape(-1)[self.token_index.numpy()]

    def stored_loss_mask(self) -> np.ndarray:
        """uint8 [N]: 1 where some row served trains on the computed token (a shared token: the union)."""
        mask = np.zeros(self.num_tokens, dtype=np.uint8)
        for k, (sample, ranges) in enumerate(zip(self.samples, self.row_ranges, strict=True)):
            own, done = sample.loss_mask.numpy(), self.carried_tokens(k)
            for start, n in ranges:
                mask[start : start + n] |= own[done : done + n].astype(np.uint8)
                done += n
        return mask

    def carried_tokens(self, row: int) -> int:
        """How many leading tokens of row `row` (its index here) an earlier batch computed."""
        return sum(n for _, n in self.carry.rows[row]) if self.carry is not None else 0

    def row_segments(self) -> list[list[int]]:
        """The segments each row served reads."""
        segment_of = self.segment_index.numpy()
        return [[int(segment_of[start]) for start, _ in ranges] for ranges in self.row_ranges]


# Batches are built with numpy: the producer thread must not run a multi-threaded torch op (repeat_interleave,
# or arange and fill past 32k elements), which would give it an OpenMP thread team of its own for the rest of
# the run; with more OpenMP threads than cores, libgomp stops spin-waiting and the model's CPU forward pass
# slows by ~5% (bench/RESULTS.md, "A CPU forward pass beside the pipeline's threads").

def alone(samples: list[Sample]) -> list[Piece]:
    """Each sample computed on its own (no sharing): one piece of one segment each."""
    return [Piece([leaf], [(s, leaf)]) for s in samples for leaf in [Segment(len(s.input_ids), s, leaf=s)]]


def _served(pieces: list[Piece], starts: dict[int, int]) -> tuple[list[Sample], list[list[tuple[Segment, int]]],
                                                                  list[list[tuple[int, int]]]]:
    rows = [(sample, leaf) for piece in pieces for sample, leaf in piece.rows]
    found = [row_ranges(len(s.input_ids), leaf, starts) for s, leaf in rows]
    return [s for s, _ in rows], [earlier for earlier, _ in found], [ranges for _, ranges in found]


def make_batch(samples: list[Sample], pad_token_id: int) -> Batch:
    return padded_batch(alone(samples), pad_token_id)


def padded_batch(pieces: list[Piece], pad_token_id: int) -> Batch:
    """Right-padded rows, one per segment (pieces of parentless segments: padded batches hand no state over)."""
    segments = [s for p in pieces for s in p.segments]
    if any(s.parent is not None for s in segments):
        raise ValueError("a padded batch cannot continue a segment from another")
    lengths = np.array([s.length for s in segments])
    B, S = len(segments), int(lengths.max())
    input_ids = np.full((B, S), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((B, S), dtype=np.int64)
    for b, segment in enumerate(segments):
        input_ids[b, : lengths[b]] = segment.source.input_ids.numpy()[: lengths[b]]
        attention_mask[b, : lengths[b]] = 1
    samples, _, ranges = _served(pieces, _starts(segments))
    return Batch(samples, torch.from_numpy(input_ids), torch.from_numpy(attention_mask),
                 torch.from_numpy(np.flatnonzero(attention_mask)), _segment_index(lengths), lengths.tolist(), ranges)


def make_packed_batch(samples: list[Sample]) -> Batch:
    return packed_batch(alone(samples))


def packed_batch(pieces: list[Piece]) -> Batch:
    """The pieces' segments side by side in one row, each at its own positions (a continuing segment from its
    parent's end, which an earlier batch computed where the parent is not here: `Carry`)."""
    segments = [s for p in pieces for s in p.segments]
    lengths = np.array([s.length for s in segments])
    cu_seq_lens = np.zeros(len(segments) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seq_lens[1:])
    token_index = np.arange(cu_seq_lens[-1], dtype=np.int64)
    depths = np.array([s.depth for s in segments])
    position_ids = token_index - np.repeat(cu_seq_lens[:-1] - depths, lengths)
    input_ids = np.concatenate([s.source.input_ids.numpy()[s.depth : s.end] for s in segments])
    number = {id(s): k for k, s in enumerate(segments)}
    parents = [number.get(id(s.parent), -1) if s.parent is not None else -1 for s in segments]
    samples, earlier, ranges = _served(pieces, _starts(segments))
    carry = None
    if any(p.cut for p in pieces):
        continued = {k: s.parent for k, s in enumerate(segments) if s.parent is not None and id(s.parent) not in number}
        carry = Carry(continued, {number[id(s)]: s for p in pieces for s in p.exports},
                      [s for p in pieces for s in p.releases], earlier)
    return Batch(samples, torch.from_numpy(input_ids)[None], None, torch.from_numpy(token_index),
                 _segment_index(lengths), lengths.tolist(), ranges, torch.from_numpy(position_ids)[None],
                 torch.from_numpy(cu_seq_lens), parents if any(p >= 0 for p in parents) else None, carry)


def _starts(segments: list[Segment]) -> dict[int, int]:
    """Each segment's first computed token (by id), segment after segment."""
    out, start = {}, 0
    for s in segments:
        out[id(s)] = start
        start += s.length
    return out


def _segment_index(lengths: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))


T = TypeVar("T")


def first_fit(items: list[T], size: Callable[[T], int], count: Callable[[T], int], token_budget: int,
              max_batch_size: int) -> list[list[T]]:
    """Longest first, each item joins the first batch with room for its tokens and its sequences."""
    groups: list[list[T]] = []
    room: list[int] = []
    seqs: list[int] = []
    for item in sorted(items, key=size, reverse=True):
        n, c = size(item), count(item)
        k = next((i for i, r in enumerate(room) if r >= n and seqs[i] + c <= max_batch_size), None)
        if k is None:
            groups.append([])
            room.append(token_budget)
            seqs.append(0)
            k = len(groups) - 1
        groups[k].append(item)
        room[k] -= n
        seqs[k] += c
    return groups


def cut(items: list[T], size: Callable[[T], int], token_budget: int, max_batch_size: int) -> list[list[T]]:
    """Longest first, each batch takes items while batch x longest fits the budget."""
    groups: list[list[T]] = []
    for item in sorted(items, key=size, reverse=True):
        group = groups[-1] if groups else None
        if group and len(group) < max_batch_size and (len(group) + 1) * size(group[0]) <= token_budget:
            group.append(item)
        else:
            groups.append([item])
    return groups


def iter_windows(rows: Iterable[Row], sort_window: int) -> Iterator[list[Row]]:
    """Consecutive source rows grouped by row_id // sort_window.

    Windows, and so batches, depend only on the source rows, not on what an earlier run
    committed: a resumed run recomputes any batch exactly as an uninterrupted run would
    (same shapes, same kernels, bit-identical states), and skips windows already done."""
    window: list[Row] = []
    for row in rows:
        if window and row.row_id // sort_window != window[0].row_id // sort_window:
            yield window
            window = []
        window.append(row)
    if window:
        yield window


def iter_batches(items: list[Sample | Reject | Duplicate], token_budget: int, max_batch_size: int,
                 pad_token_id: int, packed: bool = False, sharing: bool = False,
                 min_shared_tokens: int | None = None, split_at: int | None = None,
                 alone_past_split: bool = False) -> Iterator[Batch | Reject | Duplicate]:
    """One window's samples as batches, packed or padded; rejects (nothing to compute) pass straight through,
    and duplicates (nothing to compute, read from an earlier row) come after the batches, so that a run stopped
    part way never commits a repeat before the row it reads. With `sharing`, rows that are prefixes of others
    (duplicates too) are served by those rows' states (streamx.data.sharing), and, packed, common leading runs
    of `min_shared_tokens` (None: none) are computed once (a tree too large for one batch in pieces, each alone
    in its batch and after the ones it continues). With `split_at` (streamx.model.lengths), rows of at most that
    many tokens never share a forward or a prefix with longer ones; these share prefix rows only, or with
    `alone_past_split` nothing, one row per forward."""
    samples, duplicates = [], []
    for item in items:
        if isinstance(item, Reject):
            yield item
        elif isinstance(item, Duplicate):
            duplicates.append(item)
        elif len(item.input_ids) > token_budget:
            raise ValueError(f"row {item.row_id}: {len(item.input_ids)} tokens exceed token_budget {token_budget}")
        else:
            samples.append(item)
    if split_at is None:
        yield from _batches(samples, token_budget, max_batch_size, pad_token_id, packed, sharing, min_shared_tokens)
    else:
        yield from _batches([s for s in samples if len(s.input_ids) <= split_at], token_budget, max_batch_size,
                            pad_token_id, packed, sharing, min_shared_tokens)
        yield from _batches([s for s in samples if len(s.input_ids) > split_at], token_budget,
                            1 if alone_past_split else max_batch_size, pad_token_id, packed,
                            sharing and not alone_past_split, None)
    yield from duplicates


def rebatch(samples: list[Sample], token_budget: int, max_batch_size: int, pad_token_id: int,
            packed: bool) -> list[Batch]:
    """`samples` batched whole, nothing shared: packed, or padded (longest first, under the budget)."""
    return list(_batches(samples, token_budget, max_batch_size, pad_token_id, packed, False, None))


def _batches(samples: list[Sample], token_budget: int, max_batch_size: int, pad_token_id: int, packed: bool,
             sharing: bool, min_shared_tokens: int | None) -> Iterator[Batch]:
    units = pieces(share(samples, min_shared_tokens if packed else None), token_budget) if sharing \
        else alone(samples)
    if packed:
        whole = [p for p in units if not p.cut]
        groups = first_fit(whole, lambda p: p.num_tokens, lambda p: len(p.segments), token_budget, max_batch_size)
        yield from (packed_batch(group) for group in groups)
        yield from (packed_batch([p]) for p in units if p.cut)  # in order: each after the pieces it continues
    else:
        yield from (padded_batch(group, pad_token_id) for group in cut(units, lambda p: p.num_tokens, token_budget,
                                                                       max_batch_size))


def to_run(items: list[Batch | Reject | Duplicate], done: Collection[int]) -> Iterator[Batch | Reject | Duplicate]:
    """A window's batches, rejects and duplicates less those whose rows are all in `done` (an earlier run
    committed them), but for a batch that keeps a segment a later batch to run continues (`Carry`): it runs
    again, and what it computes is stored again (a resume's only repeat)."""
    needed: set[Segment] = set()  # segments continued by a batch that runs after this one
    runs: list[bool] = []
    for item in reversed(items):
        rows = [s.row_id for s in item.samples] if isinstance(item, Batch) else [item.row_id]
        carry = item.carry if isinstance(item, Batch) else None
        runs.append(not all(r in done for r in rows) or
                    (carry is not None and any(s in needed for s in carry.exports.values())))
        if runs[-1] and carry is not None:
            needed.update(s for parent in carry.parents.values() for s in parent.chain())
    yield from (item for item, run in zip(items, reversed(runs), strict=True) if run)
