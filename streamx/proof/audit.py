"""The in-run audit: a run proves itself on its own batches, at a cost it can afford.

The start-up check (streamx.proof.check) proves each way of computing rows on a few probe rows; a feature it does
not reach (a length it never probed, a batch of more rows than it packed) would pass it. So, while the run goes,
some of the rows it computes are computed again alone, through the model's own forward (its own attention and
layers, one row in a forward: the reference by definition), and compared token by token with what the run
computed for them, before the batch is handed to the writer (the states before an fp8 store quantizes them: the
quantization's rounding is verify's to check).

Which rows: a row audited covers every position up to its length, and a wrong way shows on rows placed after
others (packed after another row, padded beside a longer one). So per way of computing rows (packed or padded,
beside other rows or alone, continued from a shared prefix, a prefix row, past a length limit) and forward size
(segments, in powers of 2) the audit takes, among the rows placed after others, its first row (the one placed after
the most others that the budget allows), then the longest row at least twice as long as every row of that way
audited so far that the budget allows; besides, per way, the shortest of the first rows past each length limit the
config declares (whatever the budget: the start-up check's few rows may not have crossed it that way), and each row
whose id is a multiple of `every` (the same rows on a resume).

What it may cost: the audit's forwards stay within `share` of the run's forward time (of the tokens it plans to
compute, or has computed where more), plus as much again from the start (so that a short run audits too, and each
way's first rows are seen early; START_TOKENS tokens' worth where the run cannot plan): within twice the share. A
row that does not fit waits for a later row of its way (a short run may leave ways or lengths unaudited: the record
says which). A share of 0 audits every row picked, whatever it costs.

How it judges: each token against its own scale (relative_error), within the tolerance of the model's dtype, or in
reduced precision of the model's own noise measured at start-up (streamx.proof.tolerance: no token past it, no
row's median token past its typical part). In reduced precision a model that picks by ranking (a MoE router, a
sparse attention's top-k) may pick otherwise for a token batched otherwise when two candidates nearly tie: there,
and only there, a row may have one token (or 1%) over the tolerance, and a way is judged across its rows: ties are
rare, a wrong way shows in many rows, so the next FOLLOW_UP rows of a way after a row with a token over SUSPECT of
the tolerance are audited whatever the budget, and a second row of it with a token over the tolerance finds the way
wrong.

A way found wrong is a `Finding`; the run (streamx.proof.ladder) drops it and recomputes what it computed so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..data.batching import Batch, make_batch
from ..model.capture import LayerCapture
from ..model.gather import gather_into_torch
from ..model.packing import Packing, padded_attention
from ..store import Audited
from .check import declared_spans, served_states
from .tolerance import TIE_SHARE, Noise, Tolerance, largest, picks_by_ranking, reduced_precision, relative_error

EVERY = 512  # one row in this many audited by default, besides the ladder of lengths of each way
SHARE = 0.01  # the audit's forwards at most this share of the run's forward time, by default
START_TOKENS = 256  # the allowance besides the share where the run cannot say what it will compute (a stream)
COST_GUESS = 1.0  # a row's forward alone per token against the run's batched forward, until the audit measured one
# a token differs when its distance from the model's own forward, relative to its size, exceeds this (or, in reduced
# precision, what the model's own noise allows where more: streamx.proof.tolerance): float32 compute differs by
# ~1e-6; a broken way of computing rows moves states by 0.1 to O(1)
FLOAT32_FLOOR, LOW_PRECISION_FLOOR = 1e-2, 5e-2
FOLLOW_UP = 4  # rows of a way audited, whatever the budget, after one with a token near or over the tolerance
SUSPECT = 0.5  # near: over this share of the tolerance (a right way stays well below it: rounding)
RECORDED = 1 << 7  # a row's recorded way (Way.code); 0: not recorded (a part written before streamx recorded it)


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
    def code(self) -> int:
        """The way as the store records it per row (`sample_way`): RECORDED and a bit per feature."""
        flags = (self.packed, self.beside, self.carried, self.continued, self.prefix_row, self.past_limit is not None)
        return RECORDED | sum(1 << i for i, flag in enumerate(flags) if flag)

    @classmethod
    def of_code(cls, code: int, packing: Packing) -> Way:
        """The way a row's recorded `code` says (its length limit: the run's split's, as the store's settings)."""
        flags = [bool(code >> i & 1) for i in range(6)]
        return cls(*flags[:5], packing.split.limit if flags[5] and packing.split is not None else None)

    @property
    def shared(self) -> bool:
        """It reads states another row's computation made (a shared prefix, or a longer row)."""
        return self.carried or self.continued or self.prefix_row

    @property
    def reference(self) -> bool:
        """A row padded alone and read whole: the reference forward itself."""
        return not (self.packed or self.beside or self.shared)

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


@dataclass(frozen=True)
class Finding:
    """A way of computing rows found wrong: the row that showed it and where."""

    way: Way
    row: int
    length: int
    layer_id: int
    token: int
    difference: float
    tokens_over: int
    median: float  # its median token's difference
    tolerance: Tolerance

    def __str__(self) -> str:
        return (f"row {self.row} ({self.way}) differs from the model's own forward of it alone: layer id "
                f"{self.layer_id}, token {self.token} of {self.length}, relative difference {self.difference:.3g} "
                f"({self.tokens_over} of its tokens over {self.tolerance.token:.2g}, its median token "
                f"{self.median:.2g}; the tolerance {self.tolerance})")

    def to_json(self) -> dict:
        return {"row": self.row, "way": str(self.way), "layer_id": self.layer_id, "token": self.token,
                "length": self.length, "difference": self.difference, "tokens_over": self.tokens_over,
                "median": self.median}


def tolerance_of(model: nn.Module, packing: Packing) -> Tolerance:
    """What the audit judges rows of `model` by: its dtype's floor, or in reduced precision what its own noise, which
    the start-up check measured, allows where more."""
    low = reduced_precision(next(model.parameters()).dtype)
    noise = packing.probes.noise if packing.probes is not None else Noise()
    return Tolerance.of(LOW_PRECISION_FLOOR if low else FLOAT32_FLOOR, noise)


def declared_limits(model: nn.Module, packing: Packing) -> list[int]:
    """The length limits the model's config declares (windows, chunks, sparse attention's reach, a length split):
    past them a row is computed otherwise, and the start-up check's rows may not have crossed them each way (its
    rows are few, and capped by the budget)."""
    spans = list(declared_spans(model.config.get_text_config()).values())
    if packing.split is not None:
        spans.append(packing.split.limit)
    return sorted(set(spans))


def placed_after_others(batch: Batch, ks: list[int]) -> list[int]:
    """Of rows `ks` of `batch`, those placed after others: packed after another row, padded beside a longer one
    (where a wrong way of batching rows shows); all of them where none is."""
    width = batch.input_ids.shape[1]
    return [k for k in ks if (batch.row_ranges[k][-1][0] > 0 if batch.packed else
                              len(batch.samples[k].input_ids) < width)] or ks


def ways_of(batch: Batch, packing: Packing) -> list[Way]:
    """How `batch` computes each of its rows, in order."""
    ends = np.cumsum(batch.segment_lengths).tolist()
    return [Way.of(batch, k, segments, ends, packing) for k, segments in enumerate(batch.row_segments())]


def not_reference(ways: list[Way]) -> dict[int, Way]:
    """Of the ways a batch computes its rows (ways_of), those other than the reference's, by row index."""
    return {k: way for k, way in enumerate(ways) if not way.reference}


class Audit:
    """The audit of one run: inside `with`, call `batch` after each forward with the batch's states, on the main
    thread. `forward_seconds` says the run's forward time so far (its budget); `announce` is told each batch (a row)
    the audit computes, before its forward (--tp: the group's other processes run the forward with it)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], packing: Packing, pad_token_id: int,
                 every: int = EVERY, share: float = SHARE, forward_seconds: Callable[[], float] = lambda: 0.0,
                 planned_tokens: int | None = None, announce: Callable[[Batch], None] = lambda batch: None):
        self.model, self.packing, self.pad_token_id, self.every = model, packing, pad_token_id, every
        self.announce = announce
        self.layer_ids, self.share, self.forward_seconds = layer_ids, share, forward_seconds
        self.planned_tokens = planned_tokens or 0  # the tokens the run plans to compute: its budget from the start
        self.capture: LayerCapture | None = None  # its own hooks, idle in the run's forwards (while in `with`)
        self.tolerance = tolerance_of(model, packing)
        self.ties = bool(self.tolerance.noise.dtype) and picks_by_ranking(model)  # a token over may be a near tie
        self.limits = declared_limits(model, packing)
        self.audited = Audited(ways=[], coverage={}, tolerance=self.tolerance.to_json())
        self.longest: dict[tuple[Way, int], int] = {}  # (way, forward size class) -> its longest row audited
        self.crossed: set[tuple[Way, int]] = set()  # (way, declared limit) a row past it was audited
        self.flagged: dict[Way, int] = {}  # rows of a way audited with a token over the tolerance
        self.follow_ups: dict[Way, int] = {}  # rows of a way still to audit after one such row, whatever the budget
        self.computed_tokens = 0

    def chosen(self, batch: Batch, ways: dict[int, Way]) -> dict[int, Way]:
        """The rows of `batch` to audit (by index), each with its way; `ways`: how it computed its rows."""
        size = len(batch.segment_lengths).bit_length()
        self.computed_tokens += batch.num_tokens
        rows: dict[int, Way] = {}
        candidates: dict[tuple[Way, int], list[int]] = {}  # (way, size class) -> its rows here
        crossing: dict[tuple[Way, int], list[int]] = {}  # (way, limit) first crossed -> its rows past it here
        for k, how in ways.items():
            row = batch.samples[k]
            n = len(row.input_ids)
            self.audited.saw(str(how), n)
            for limit in self.limits:
                if n > limit and (how, limit) not in self.crossed:
                    crossing.setdefault((how, limit), []).append(k)
            candidates.setdefault((how, size), []).append(k)
        for (how, limit), ks in crossing.items():  # nothing else proves it: whatever the budget, the shortest
            if not any(k in rows and len(batch.samples[k].input_ids) > limit for k in ks):
                k = min(placed_after_others(batch, ks), key=lambda k: len(batch.samples[k].input_ids))
                rows[k] = how
                self.longest[how, size] = max(len(batch.samples[k].input_ids), self.longest.get((how, size), 0))
            self.crossed.add((how, limit))
        for k, how in ways.items():
            n = len(batch.samples[k].input_ids)
            if self.every and batch.samples[k].row_id % self.every == 0 and k not in rows \
                    and self.affords(n + self.pending(batch, rows)):
                rows[k] = how
        for key, ks in candidates.items():
            for k in self._picks(batch, key, [k for k in ks if k not in rows], self.pending(batch, rows)):
                rows[k] = key[0]
                self.longest[key] = max(len(batch.samples[k].input_ids), self.longest.get(key, 0))
        return rows

    def _picks(self, batch: Batch, key: tuple[Way, int], ks: list[int], pending: int) -> list[int]:
        """Of rows `ks` of `batch` computed one way (`key`: the way, the forward's size class), those to audit:
        among the rows placed after others (packed after another row, padded beside a longer one: where a wrong
        way shows), else all, the longest at least twice as long as every row of the key audited so far that the
        budget allows (beside `pending` tokens picked already), and the key's first row (the one placed after the most
        others that the budget allows); whatever the budget, the longest row of a way after one with a token near or
        over the tolerance (a near tie or a wrong way: FOLLOW_UP rows tell)."""
        exposed = placed_after_others(batch, ks)
        if not exposed:
            return []
        longest = sorted(exposed, key=lambda k: -len(batch.samples[k].input_ids))
        picks: list[int] = []

        def fits(k: int) -> bool:
            return self.affords(len(batch.samples[k].input_ids) + pending
                                + sum(len(batch.samples[p].input_ids) for p in picks))

        if self.follow_ups.get(key[0]):  # whatever the budget
            self.follow_ups[key[0]] -= 1
            picks.append(longest[0])
        if key not in self.longest:  # its first: the row placed after the most others that fits
            first = next((k for k in sorted(exposed, key=lambda k: -batch.row_ranges[k][-1][0])
                          if k not in picks and fits(k)), None)
            picks += [] if first is None else [first]
        for k in longest:  # then the longest that doubles the key's longest audited, if it fits
            if len(batch.samples[k].input_ids) < 2 * max([self.longest.get(key, 0),
                                                          *(len(batch.samples[p].input_ids) for p in picks)]):
                break
            if k not in picks and fits(k):
                picks.append(k)
                break
        return picks

    @staticmethod
    def pending(batch: Batch, rows: dict[int, Way]) -> int:
        """The tokens of the rows of `batch` chosen so far."""
        return sum(len(batch.samples[k].input_ids) for k in rows)

    def affords(self, tokens: int) -> bool:
        """Whether auditing `tokens` more keeps the audit within its share of the forward time (and the start
        allowance). Reads the forward time only when the tokens could fit at all (on CUDA it waits for the device)."""
        if not self.share:
            return True
        computed = max(self.computed_tokens, 1)
        start = self.share * self.planned_tokens if self.planned_tokens else START_TOKENS
        allowed = self.share * max(computed, self.planned_tokens) + start  # in tokens of the run's forward
        if self.audited.tokens + tokens > allowed:  # (a row alone costs at least what it does batched)
            return False
        per_token = self.forward_seconds() / computed  # the run's forward, per computed token
        cost = self.audited.seconds / self.audited.tokens if self.audited.tokens else COST_GUESS * per_token
        return self.audited.seconds + tokens * cost <= per_token * allowed

    @torch.inference_mode()
    def batch(self, batch: Batch, states: torch.Tensor, ways: dict[int, Way]) -> Finding | None:
        """Audit the chosen rows of `batch`, whose computed tokens' states are `states` [N, K, H] and whose rows it
        computed `ways` (ways_of): the first way found wrong, or None."""
        chosen = self.chosen(batch, ways)
        if not chosen:
            return None
        started = time.perf_counter()
        found = None
        with padded_attention(self.model):
            for k, how in sorted(chosen.items(), key=lambda item: -len(batch.samples[item[0]].input_ids)):
                found = self._row(batch, k, how, states)
                if found is not None:
                    break
        if states.device.type == "cuda":
            torch.cuda.synchronize(states.device)
        self.audited.seconds += time.perf_counter() - started
        return found

    def _row(self, batch: Batch, k: int, how: Way, states: torch.Tensor) -> Finding | None:
        row, done = batch.samples[k], batch.carried_tokens(k)
        got = served_states(batch, k, states)
        own = torch.empty(len(row.input_ids), *states.shape[1:], dtype=next(self.model.parameters()).dtype,
                          device=states.device)
        alone = make_batch([row], self.pad_token_id)
        self.announce(alone)
        self.capture.forward(alone, own)
        own = own[done:]
        if not bool(torch.isfinite(own).all()):
            return None  # the model's own forward overflows on this row: nothing to compare (the writer rejects the
            # row where the run's states do too)
        error = relative_error(got, own).nan_to_num(nan=float("inf"), posinf=float("inf"))
        over, median = self.tolerance.judge(error)
        value, token, slot = largest(error)
        self.audited.add(str(how), row.row_id, len(row.input_ids), len(error), value)
        allowed = max(1, int(TIE_SHARE * len(error))) if self.ties else 0
        if over:
            self.flagged[how] = self.flagged.get(how, 0) + 1
        if value > SUSPECT * self.tolerance.token:  # near the tolerance: more rows of the way before trusting it
            self.follow_ups.setdefault(how, FOLLOW_UP)
        if self.tolerance.past(over, median, allowed) or (over and self.flagged[how] > 1):
            return Finding(how, row.row_id, len(row.input_ids), self.layer_ids[slot], done + token, value, over,
                           median, self.tolerance)
        return None

    def __enter__(self) -> Audit:
        self.capture = LayerCapture(self.model, self.layer_ids, gather_into_torch)
        return self

    def __exit__(self, *exc) -> None:
        self.capture.close()
