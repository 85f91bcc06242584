"""Length-bucketed batches under a token budget, from a sorting window.

Samples are sorted by length inside a window of `sort_window` source rows and cut greedily into
right-padded batches whose padded size (batch x longest) stays within `token_budget`. Right
padding keeps positions 0..T-1 of every real token exact under causal attention, so the
real tokens' states do not depend on the padding. Rejects pass straight through.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .source import Row
from .tokenize import Reject, Sample


@dataclass
class Batch:
    samples: list[Sample]
    input_ids: torch.Tensor  # int64 [B, S], right-padded
    attention_mask: torch.Tensor  # int64 [B, S]
    token_index: torch.Tensor  # int64 [N]: flat b * S + t of every real token, sample after sample
    sample_index: torch.Tensor  # int64 [N]: which sample (0..B-1) each real token belongs to

    def pin_memory(self) -> None:
        self.input_ids = self.input_ids.pin_memory()
        self.attention_mask = self.attention_mask.pin_memory()
        self.token_index = self.token_index.pin_memory()
        self.sample_index = self.sample_index.pin_memory()

    @property
    def lengths(self) -> list[int]:
        return [len(s.input_ids) for s in self.samples]

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.numel())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


def make_batch(samples: list[Sample], pad_token_id: int) -> Batch:
    lengths = [len(s.input_ids) for s in samples]
    B, S = len(samples), max(lengths)
    input_ids = torch.full((B, S), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, S), dtype=torch.long)
    for b, sample in enumerate(samples):
        input_ids[b, : lengths[b]] = sample.input_ids
        attention_mask[b, : lengths[b]] = 1
    token_index = torch.nonzero(attention_mask.flatten(), as_tuple=True)[0]
    sample_index = torch.repeat_interleave(torch.arange(B), torch.tensor(lengths))
    return Batch(samples, input_ids, attention_mask, token_index, sample_index)


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
                 pad_token_id: int) -> Iterator[Batch | Reject]:
    """One window's samples as batches; rejects pass straight through."""
    samples = []
    for item in items:
        if isinstance(item, Reject):
            yield item
        elif len(item.input_ids) > token_budget:
            raise ValueError(f"row {item.row_id}: {len(item.input_ids)} tokens exceed token_budget {token_budget}")
        else:
            samples.append(item)
    for group in cut_window(samples, token_budget, max_batch_size):
        yield make_batch(group, pad_token_id)
