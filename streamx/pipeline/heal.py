"""Rows committed a way the in-run audit later found wrong, computed again and written over in place.

A way of computing rows found wrong at batch N (streamx.proof.audit) may have computed rows of earlier batches,
already committed. Before the run ends they are computed again on the rung the run stands on (whole rows, nothing
shared: streamx.proof.ladder) and their states written over where they lie in the part: a row keeps its tokens,
so it keeps its place, and rows that read the same stored tokens (a shared prefix) read the states the row's own
forward gives them, which are theirs too (a token's states depend on the tokens before it alone).

Crash safety: the part's commit record names the rows waiting (`Audited.to_heal`) and stays open until they are
written; a shard is written whole (the store writes every file durably, under a temporary name), so a kill leaves
each shard old or new, and the resume computes the rows named again. Shards are read and written once per group of
rows that starts in them (bounded memory: one shard's worth of rows at a time).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import zarr

from ..data.batching import Batch
from ..data.tokenize import Sample
from ..model.capture import LayerCapture
from ..model.gather import select_gather_fn
from ..proof.check import served_states
from ..proof.ladder import Ladder
from ..store import Store
from .plan import RunPlan


def ranged(rows: np.ndarray) -> list[list[int]]:
    """Ascending row ids as [first, last] runs of consecutive ids (the commit record keeps them short)."""
    if not rows.size:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1)
    firsts, lasts = rows[np.r_[0, breaks + 1]], rows[np.r_[breaks, rows.size - 1]]
    return [[int(a), int(b)] for a, b in zip(firsts, lasts, strict=True)]


def unranged(ranges: list[list[int]] | None) -> np.ndarray:
    """The row ids of `ranged`'s runs, ascending."""
    if not ranges:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b + 1, dtype=np.int64) for a, b in ranges])


@torch.inference_mode()
def heal(plan: RunPlan, part: zarr.Group, part_name: str, rows: np.ndarray, ladder: Ladder,
         log: Callable[[str], None] = print, announce: Callable[[Batch], None] = lambda batch: None) -> int:
    """Compute `rows` of the part `part_name` (opened for writing: `part`) again as `ladder` computes rows now, and
    write their states over the stored ones. Rows the part does not hold (rejected as non-finite) are passed over.
    `announce` is told each batch before its forward (--tp: the group's other processes run it too). Returns the
    rows written."""
    store = Store(plan.config.out)
    groups = _by_shard(store, rows, part_name, part["hidden_states"].shards[0])
    if not groups:
        return 0
    log(f"audit: computing {sum(map(len, groups.values())):,} committed rows again {ladder.name}, and writing them "
        f"over in {part_name}")
    storage, K, H = plan.layout.storage, len(plan.layer_ids), plan.info.hidden_size
    names = ["hidden_states", *(["hidden_states_scales"] if storage.scaled else [])]
    with LayerCapture(plan.model, plan.layer_ids, select_gather_fn(plan.config.kernel, plan.device)) as capture:
        for group in groups.values():
            samples = {row: Sample(row, *store.tokens_at(position)) for row, (position, _) in group.items()}
            patches: dict[str, list[tuple[int, np.ndarray]]] = {name: [] for name in names}
            for batch in ladder.batched(list(samples.values())):
                states = torch.empty((batch.num_tokens, K, H), dtype=torch.bfloat16, device=plan.device)
                announce(batch)
                capture.forward(batch, states)
                for k, row in enumerate(batch.samples):
                    values, scales = storage.encode(served_states(batch, k, states))
                    stored = {"hidden_states": storage.to_bits(values),
                              "hidden_states_scales": None if scales is None else scales.cpu().numpy()}
                    done = 0
                    for a, b in group[row.row_id][1]:
                        for name in names:
                            patches[name].append((a, stored[name][done : done + b - a]))
                        done += b - a
            for name, pieces in patches.items():
                _write_over(part[name], pieces)
    return sum(map(len, groups.values()))


def _by_shard(store: Store, rows: np.ndarray, part_name: str, shard: int) -> dict[int, dict[int, tuple]]:
    """The samples of `rows` that the part `part_name` stores tokens for (a repeated row reads another's), by the
    shard their first stored token lies in: row -> (position, ranges)."""
    index = list(store.parts).index(part_name)
    groups: dict[int, dict[int, tuple]] = {}
    for row in rows.tolist():
        try:
            position = store.position(row)
        except KeyError:  # rejected
            continue
        if int(store.index.parts[position]) == index and store.index.lengths[position]:
            ranges = store.ranges(position)
            groups.setdefault(ranges[0][0] // shard, {})[row] = (position, ranges)
    return groups


def _write_over(arr: zarr.Array, pieces: list[tuple[int, np.ndarray]]) -> None:
    """Write each (first token, values) of `pieces` into `arr`, reading and writing the span they cover once."""
    lo = min(a for a, _ in pieces)
    hi = max(a + len(values) for a, values in pieces)
    block = arr[lo:hi]
    for a, values in pieces:
        block[a - lo : a - lo + len(values)] = values
    arr[lo:hi] = block
