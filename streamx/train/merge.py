"""`streamx convert --merge-prefix-rows`: each row whose tokens are a prefix of another row's (fanned-out turns,
agent steps, duplicates) folded into that row, with the union of their loss masks, so that training computes
each token once as well. The states of the row it folds into hold its own (the model is causal), so nothing
is lost; the data has fewer, longer rows. Rows are grouped as `streamx run --sharing` groups them: by
sorting window (the store's --sort-window), sorted by token ids (streamx.data.sharing)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..data.sharing import share
from ..data.tokenize import Sample
from ..store import Store


@dataclass(frozen=True)
class PrefixFolds:
    """Which rows fold into which: leaf row -> the rows that are prefixes of it (duplicates too)."""

    into: dict[int, list[int]]

    @property
    def folded(self) -> set[int]:
        return {row for rows in self.into.values() for row in rows}

    def loss_mask(self, store: Store, row: int, own: torch.Tensor) -> torch.Tensor:
        """`row`'s loss mask with those of the rows folded into it (each over its own, leading, tokens)."""
        mask = own.clone()
        for other in self.into.get(row, ()):
            theirs = store.tokens_at(store.position(other))[1]
            mask[: theirs.numel()] |= theirs
        return mask


def prefix_folds(store: Store, window: int | None = None) -> PrefixFolds:
    """The store's rows that are prefixes of another row of their sorting window (`window` rows: by default the
    store's --sort-window), and the row each folds into; a row that repeats an earlier row's content anywhere
    (format /4: `Store.same_as`) folds where that row does."""
    window = window or int(store.metadata.config.get("sort_window", 1024))
    repeated = store.same_as >= 0
    rows = np.sort(store.index.rows[~repeated])  # ascending: each window's rows are one run
    into: dict[int, list[int]] = {}
    for mine in np.split(rows, np.flatnonzero(np.diff(rows // window)) + 1) if rows.size else []:
        samples = []
        for row in mine.tolist():
            ids, mask = store.tokens_at(store.position(row))
            samples.append(Sample(row, ids, mask))
        for leaf in share(samples, None):
            if leaf.covered:
                into[leaf.leaf.row_id] = sorted(s.row_id for s in leaf.covered)
    if repeated.any():
        leaf_of = {row: leaf for leaf, folded in into.items() for row in folded}
        for row, first in zip(store.index.rows[repeated].tolist(), store.same_as[repeated].tolist(), strict=True):
            into.setdefault(leaf_of.get(first, first), []).append(row)
        into = {leaf: sorted(folded) for leaf, folded in into.items()}
    return PrefixFolds(into)
