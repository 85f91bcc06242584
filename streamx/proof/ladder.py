"""The ladder of ways a run computes its rows, walked down when the in-run audit finds a way wrong.

The start-up check picks the fastest way it proves (packed and shared, else less); the audit may still find one
wrong on the run's own rows (a length or a batch the probes did not reach). The run then does not stop: it drops
that way for the rest of the run, down to the first rung that no longer takes it, and computes the batch again
so, as every later batch; the rows it had committed that way are computed again before the run ends
(streamx.pipeline.heal), so that the finished store holds no row computed a way found wrong.

    rung 0  as planned (the start-up check's choice)
    rung 1  nothing shared: each row computed whole (packed or padded, as planned)
    rung 2  padded batches of whole rows, through the model's own attention
    rung 3  one row per forward: the model's own forward of each row, right by definition

The producer keeps making the planned batches (cheap); the model stage rebuilds each from its rows at the rung
it stands on. A resume starts on the rung its store records.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from ..data.batching import Batch, rebatch
from ..data.tokenize import Sample
from ..model.packing import Packing, disable
from .audit import Way

RUNGS = ("as planned", "with nothing shared (each row computed whole)", "in padded batches of whole rows",
         "one row per forward (the model's own forward of each row)")


@dataclass
class Ladder:
    """Where a run stands on the ladder, and the rows it computed each way meanwhile (to heal a way dropped)."""

    model: nn.Module
    packing: Packing
    token_budget: int
    max_batch_size: int
    pad_token_id: int
    rung: int = 0
    # rows this run handed to the writer, by way (8 bytes a row: a week's run holds millions)
    computed: dict[Way, array] = field(default_factory=dict)

    def allows(self, way: Way, rung: int | None = None) -> bool:
        """Whether rows computed `way` are computed as rung `rung` (this one by default) computes them."""
        rung = self.rung if rung is None else rung
        if rung == 0:
            return True
        if rung == 1:
            return not way.shared
        if rung == 2:
            return not (way.shared or way.packed)
        return way.reference

    def drop(self, way: Way) -> str:
        """Go down to the first rung that does not compute rows `way`; returns what the run does now."""
        self.go_to(next((r for r in range(self.rung + 1, len(RUNGS)) if not self.allows(way, r)), len(RUNGS) - 1))
        return RUNGS[self.rung]

    def start_at(self, rung: str | None) -> None:
        """A resume: the rung its store records (None: as planned)."""
        if rung in RUNGS and RUNGS.index(rung) > self.rung:
            self.go_to(RUNGS.index(rung))

    def go_to(self, rung: int) -> None:
        """Stand on `rung` from now on (a tensor-parallel group's other processes: where the first one went)."""
        self.rung = rung
        if rung >= 2:
            disable(self.model)  # the model's own attention and layers from now on

    @property
    def name(self) -> str | None:
        return RUNGS[self.rung] if self.rung else None

    def batches(self, batch: Batch, done: Collection[int] = ()) -> list[Batch]:
        """`batch` as this rung computes it: itself as planned, else its rows not in `done`, whole, batched anew."""
        if not self.rung:
            return [batch]
        return self.batched([row for row in batch.samples if row.row_id not in done])

    def batched(self, rows: list[Sample]) -> list[Batch]:
        """Whole rows batched as this rung (past the first) computes them: nothing shared, and rows past a length
        split never beside shorter ones (as planned)."""
        split, batches = self.packing.split, []
        for past in (False, True) if split is not None else (False,):
            group = [row for row in rows if split is None or split.past(len(row.input_ids)) == past]
            alone = self.rung == 3 or self.packing.alone or (past and split.alone)
            batches += rebatch(group, self.token_budget, 1 if alone else self.max_batch_size, self.pad_token_id,
                               self.rung == 1 and self.packing.on)
        return batches

    def record(self, batch: Batch, ways: dict[int, Way]) -> None:
        """The ways a batch handed to the writer computed its rows (index -> way)."""
        for k, way in ways.items():
            self.computed.setdefault(way, array("q")).append(batch.samples[k].row_id)

    def recorded(self, rows: np.ndarray, codes: np.ndarray) -> None:
        """A resume: the rows earlier runs of the part committed, with the way each was computed (Way.code; 0: not
        recorded). Those computed a way this rung takes are healed too if this run drops it (the others were
        computed again when their way was dropped, or wait to be: the part's record names them)."""
        for code in np.unique(codes[codes != 0]).tolist():
            way = Way.of_code(code, self.packing)
            if not way.reference and self.allows(way):
                self.computed.setdefault(way, array("q")).extend(rows[codes == code].astype(np.int64).tolist())

    def suspects(self) -> np.ndarray:
        """The rows this run computed a way the rung it stands on no longer takes, ascending."""
        rows = [np.frombuffer(ids, dtype=np.int64) for way, ids in self.computed.items() if not self.allows(way)]
        return np.unique(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)

    def healed(self) -> None:
        """The rows computed a way dropped were computed again: forget them."""
        self.computed = {way: rows for way, rows in self.computed.items() if self.allows(way)}
