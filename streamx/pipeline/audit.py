"""The in-run audit: a run proves itself on its own batches.

The start-up check (streamx.model.check) proves each way of computing rows on a few probe rows; a feature it does
not reach (a length it never probed, a batch of more rows than it packed) would pass it. So, while the run goes,
a sample of the rows it computes is computed again alone, through the model's own forward (its own attention and
layers, one row in a forward: the reference by definition), and compared token by token with what the run
computed for them, before the batch is handed to the writer. It audits the first row of each way a row is computed
(packed or padded, beside other rows or alone, a prefix row served from a longer row, continued from a shared
prefix in its forward or in a later one, past a length limit) in forwards of each size and for rows of each length
(powers of 2 and 4: tens to a few hundred rows in a whole run, however long), the last row of that shape in its
batch, and each row whose id is a multiple of `every` (so that a resume audits the same rows). It compares the
states before an fp8 store quantizes them (the quantization's own rounding is verify's to check).

A row that differs stops the run at once: nothing of its batch is written, what was committed stays, and the error
names the row, the layer, the token, the way it was computed and the setting that avoids that way. The figures
(rows and tokens audited, the worst difference, the time it took against the forward's) go into the store's
commit records, and `streamx verify` reports them.

It runs on the main thread between forwards: the model is one object whose attention the run switched to its
packed path, and the audit switches it back to the model's own for its forward (streamx.model.packing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..data.batching import Batch, make_batch
from ..model.capture import LayerCapture
from ..model.check import largest, relative_error, served_states
from ..model.gather import gather_into_torch
from ..model.packing import Packing, padded_attention
from ..store import Audited

EVERY = 512  # one row in this many audited by default, besides the first of each way (about 0.2% of the tokens)
# a token differs when its distance from the model's own forward, relative to its size, exceeds this: the bf16
# states round by at most 2**-9 per value (float32 compute differs by less), bf16 compute by more; a broken way of
# computing rows moves states by 0.1 to O(1)
TOLERANCE = {torch.float32: 1e-2, torch.float64: 1e-2}
LOW_PRECISION_TOLERANCE = 5e-2
# in reduced precision a MoE router near a tie may pick another expert for a token batched otherwise (the model's own
# rounding): a row differs when more than this share of its tokens (and more than one) do; a broken path moves most
LOW_PRECISION_TOKEN_SHARE = 0.01


class AuditError(RuntimeError):
    """A row the run computed differs from the model's own forward of it alone."""


@dataclass(frozen=True)
class Way:
    """How the run computed a row."""

    packed: bool  # in a packed forward (else padded)
    beside: bool  # beside other rows in its forward (else alone)
    carried: bool = False  # continued from a shared prefix an earlier forward computed
    continued: bool = False  # continued from a shared prefix in its forward
    prefix_row: bool = False  # served from a longer row's states
    past_limit: int | None = None  # the length limit it is past (a LengthSplit's)

    @classmethod
    def of(cls, batch: Batch, k: int, segments: list[int], ends: list[int], packing: Packing) -> Way:
        """Row k of `batch`, which reads `segments` of it (whose computed tokens end at `ends`)."""
        start, n = batch.row_ranges[k][-1]
        split = packing.split
        return cls(batch.packed, len(batch.segment_lengths) > 1, batch.carried_tokens(k) > 0,
                   len(segments) > 1 and not batch.carried_tokens(k), start + n < ends[segments[-1]],
                   split.limit if split is not None and split.past(len(batch.samples[k].input_ids)) else None)

    @property
    def reference(self) -> bool:
        """A row padded alone and read whole: the reference forward itself."""
        return not (self.packed or self.beside or self.carried or self.continued or self.prefix_row)

    def fallback(self) -> str:
        """The setting that keeps a run off this way."""
        if self.carried or self.continued:
            return "--sharing rows (prefix rows only) or --sharing off"
        if self.prefix_row:
            return "--sharing off"
        if self.packed:
            return "--packing off (padded batches)"
        return "--packing off --max-batch-size 1 (one row per forward)"

    def __str__(self) -> str:
        kind = "packed" if self.packed else "padded"
        parts = [f"{kind} beside other rows" if self.beside else f"{kind} alone"]
        if self.carried:
            parts.append("continued from a shared prefix computed in an earlier forward")
        if self.continued:
            parts.append("continued from a shared prefix in its forward")
        if self.prefix_row:
            parts.append("a prefix row served from a longer row's states")
        if self.past_limit is not None:
            parts.append(f"past the {self.past_limit:,}-token limit")
        return ", ".join(parts)


class Audit:
    """The audit of one run: inside `with`, call `batch` after each forward with the batch's states, on the main
    thread."""

    def __init__(self, model: nn.Module, layer_ids: list[int], packing: Packing, pad_token_id: int,
                 every: int = EVERY):
        self.model, self.packing, self.pad_token_id, self.every = model, packing, pad_token_id, every
        self.layer_ids = layer_ids
        self.capture: LayerCapture | None = None  # its own hooks, idle in the run's forwards (while in `with`)
        dtype = next(model.parameters()).dtype
        self.tolerance = TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)
        self.strict = dtype in TOLERANCE  # no token over the tolerance allowed
        self.audited = Audited(ways=[])
        self.seen: set[tuple[Way, int, int]] = set()  # (way, segments and row length to a power of 2 and 4) audited

    def chosen(self, batch: Batch) -> dict[int, Way]:
        """The rows of `batch` to audit (by index), each with its way: the first of each way in a forward of about
        as many segments and for a row of about its length (powers of 2 and 4), the last such row of its batch (a
        leak from the rows before it shows there first), and each row whose id is a multiple of `every`."""
        shapes: dict[tuple[Way, int, int], int] = {}
        rows: dict[int, Way] = {}
        count, ends = len(batch.segment_lengths), np.cumsum(batch.segment_lengths).tolist()
        for k, (row, segments) in enumerate(zip(batch.samples, batch.row_segments(), strict=True)):
            how = Way.of(batch, k, segments, ends, self.packing)
            if how.reference:
                continue
            shape = (how, count.bit_length(), len(row.input_ids).bit_length() // 2)
            if shape not in self.seen:
                shapes[shape] = k
            if row.row_id % self.every == 0:
                rows[k] = how
        self.seen.update(shapes)
        return {**rows, **{k: shape[0] for shape, k in shapes.items()}}

    @torch.inference_mode()
    def batch(self, batch: Batch, states: torch.Tensor) -> None:
        """Audit the chosen rows of `batch`, whose computed tokens' states are `states` [N, K, H]; raises
        AuditError when one differs."""
        chosen = self.chosen(batch)
        if not chosen:
            return
        started = time.perf_counter()
        with padded_attention(self.model):
            for k, how in chosen.items():
                self._row(batch, k, how, states)
        if states.device.type == "cuda":
            torch.cuda.synchronize(states.device)
        self.audited.seconds += time.perf_counter() - started

    def _row(self, batch: Batch, k: int, how: Way, states: torch.Tensor) -> None:
        row, done = batch.samples[k], batch.carried_tokens(k)
        got = served_states(batch, k, states)
        own = torch.empty(len(row.input_ids), *states.shape[1:], dtype=next(self.model.parameters()).dtype,
                          device=states.device)
        self.capture.forward(make_batch([row], self.pad_token_id), own)
        own = own[done:]
        if not bool(torch.isfinite(own).all()):
            return  # the model's own forward overflows on this row: nothing to compare (the writer rejects the
            # row where the run's states do too)
        error = relative_error(got, own).nan_to_num(nan=float("inf"), posinf=float("inf"))
        per_token = error.max(dim=1).values
        over = int((per_token > self.tolerance).sum())
        value, token, slot = largest(error)
        audited = self.audited
        audited.rows += 1
        audited.tokens += int(per_token.numel())
        audited.ways = sorted(set(audited.ways) | {str(how)})
        if value > audited.worst or audited.worst_row is None:
            audited.worst, audited.worst_row = value, row.row_id
        allowed = 0 if self.strict else max(1, int(LOW_PRECISION_TOKEN_SHARE * per_token.numel()))
        if over > allowed:
            raise AuditError(
                f"the in-run audit found row {row.row_id} ({how}) unlike the model's own forward of it alone: layer id "
                f"{self.layer_ids[slot]}, token {done + token} of {len(row.input_ids)}, relative difference "
                f"{value:.3g} ({over} of its {per_token.numel()} tokens over {self.tolerance:g}); the start-up "
                f"check did not catch this way of computing rows on this model. Nothing of its batch was written; "
                f"rows committed before may have been computed the same way: start over (--overwrite) with "
                f"{how.fallback()}, and report the model")

    def __enter__(self) -> Audit:
        self.capture = LayerCapture(self.model, self.layer_ids, gather_into_torch)
        return self

    def __exit__(self, *exc) -> None:
        self.capture.close()
