"""Batches under a token budget, from a window of source rows.

Packed (the default where the model allows it, streamx.model.packing): the samples' real tokens side by
side in one row, position ids restarting at each sample, boundaries in `cu_seq_lens`; a window's
samples are bin-packed longest first (first fit) so that each batch holds up to `token_budget` real
tokens and nothing is padding.

Padded (--packing off, or a model that cannot keep packed samples apart): samples sorted by length
and cut greedily into right-padded batches whose padded size (batch x longest) stays within
`token_budget`. Right padding keeps positions 0..T-1 of every real token exact under causal
attention, so the real tokens' states do not depend on the padding.

Either way rejects pass straight through, and batches depend only on the window's rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .source import Row
from .tokenize import Reject, Sample


@dataclass
class Batch:
    samples: list[Sample]
    input_ids: torch.Tensor  # int64 [B, S] right-padded, or [1, N] packed
    attention_mask: torch.Tensor | None  # int64 [B, S]; None when packed
    token_index: torch.Tensor  # int64 [N]: flat b * S + t of every real token, sample after sample
    sample_index: torch.Tensor  # int64 [N]: which sample (0..B-1) each real token belongs to
    position_ids: torch.Tensor | None = None  # packed: int64 [1, N], 0.. for each sample
    cu_seq_lens: torch.Tensor | None = None  # packed: int32 [B + 1], where each sample starts, then N

    @property
    def packed(self) -> bool:
        return self.cu_seq_lens is not None

    def pin_memory(self) -> None:
        for name in ("input_ids", "attention_mask", "token_index", "sample_index", "position_ids", "cu_seq_lens"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).pin_memory())

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor | int]:
        """The decoder's keyword arguments: ids with their padding mask, or with the packed boundaries
        (flash-attention's and flash-linear-attention's names, which transformers passes down)."""
        inputs: dict[str, torch.Tensor | int] = {"input_ids": self.input_ids.to(device, non_blocking=True)}
        if not self.packed:
            inputs["attention_mask"] = self.attention_mask.to(device, non_blocking=True)
            return inputs
        cu = self.cu_seq_lens.to(device, non_blocking=True)
        longest = max(self.lengths)
        return {**inputs, "position_ids": self.position_ids.to(device, non_blocking=True), "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    @property
    def shape_key(self) -> tuple:
        """What a forward's kernels depend on: the padded shape, or the packed samples' lengths."""
        return ("packed", *self.lengths) if self.packed else tuple(self.input_ids.shape)

    @property
    def lengths(self) -> list[int]:
        return [len(s.input_ids) for s in self.samples]

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.numel())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


# Batches are built with numpy: the producer thread must not run a multi-threaded torch op (repeat_interleave,
# or arange and fill past 32k elements), which would give it an OpenMP thread team of its own for the rest of
# the run; with more OpenMP threads than cores, libgomp stops spin-waiting and the model's CPU forward pass
# slows by ~5% (bench/RESULTS.md, "A CPU forward pass beside the pipeline's threads").

def make_batch(samples: list[Sample], pad_token_id: int) -> Batch:
    lengths = np.array([len(s.input_ids) for s in samples])
    B, S = len(samples), int(lengths.max())
    input_ids = np.full((B, S), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((B, S), dtype=np.int64)
    for b, sample in enumerate(samples):
        input_ids[b, : lengths[b]] = sample.input_ids.numpy()
        attention_mask[b, : lengths[b]] = 1
    return Batch(samples, torch.from_numpy(input_ids), torch.from_numpy(attention_mask),
                 torch.from_numpy(np.flatnonzero(attention_mask)), _sample_index(lengths))


def make_packed_batch(samples: list[Sample]) -> Batch:
    lengths = np.array([len(s.input_ids) for s in samples])
    cu_seq_lens = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seq_lens[1:])
    token_index = np.arange(cu_seq_lens[-1], dtype=np.int64)
    position_ids = token_index - np.repeat(cu_seq_lens[:-1], lengths)
    input_ids = np.concatenate([s.input_ids.numpy() for s in samples])
    return Batch(samples, torch.from_numpy(input_ids)[None], None, torch.from_numpy(token_index),
                 _sample_index(lengths), torch.from_numpy(position_ids)[None], torch.from_numpy(cu_seq_lens))


def _sample_index(lengths: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))


def pack_window(samples: list[Sample], token_budget: int, max_batch_size: int) -> list[list[Sample]]:
    """First fit, longest first: each sample joins the first batch with room for its tokens."""
    groups: list[list[Sample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        n = len(sample.input_ids)
        k = next((i for i, r in enumerate(room) if r >= n and len(groups[i]) < max_batch_size), None)
        if k is None:
            groups.append([])
            room.append(token_budget)
            k = len(groups) - 1
        groups[k].append(sample)
        room[k] -= n
    return groups


def cut_window(samples: list[Sample], token_budget: int, max_batch_size: int) -> list[list[Sample]]:
    """Longest first, each batch takes samples while batch x longest fits the budget."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids), reverse=True)
    groups: list[list[Sample]] = []
    for sample in ordered:
        group = groups[-1] if groups else None
        if group and len(group) < max_batch_size and (len(group) + 1) * len(group[0].input_ids) <= token_budget:
            group.append(sample)
        else:
            groups.append([sample])
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


def iter_batches(items: list[Sample | Reject], token_budget: int, max_batch_size: int,
                 pad_token_id: int, packed: bool = False) -> Iterator[Batch | Reject]:
    """One window's samples as batches, packed or padded; rejects pass straight through."""
    samples = []
    for item in items:
        if isinstance(item, Reject):
            yield item
        elif len(item.input_ids) > token_budget:
            raise ValueError(f"row {item.row_id}: {len(item.input_ids)} tokens exceed token_budget {token_budget}")
        else:
            samples.append(item)
    if packed:
        yield from (make_packed_batch(group) for group in pack_window(samples, token_budget, max_batch_size))
    else:
        yield from (make_batch(group, pad_token_id) for group in cut_window(samples, token_budget, max_batch_size))
