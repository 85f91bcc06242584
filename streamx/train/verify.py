"""`streamx verify`: prove a finished store right before a drafter trains on it.

Structural checks read the whole store without the model: completeness (every part closed, every row of
the data in the store), commit records against array sizes, sample offsets and lengths, duplicate rows,
token ids against the vocabulary, loss masks, and every slot of every sample finite and neither all zero
nor constant. The data check reads a sample of the rows again from the data the store was made from (the
rows stored as repeats of an earlier row first), through the run's own source and tokenizer, and compares
their token ids and loss masks with the stored ones; it is skipped, with why, where the data or the
tokenizer cannot be read. `--no-model` stops there. The model check
recomputes a few samples (stratified by length, always the longest) one at a time, unbatched and
unpadded, through transformers' `output_hidden_states` (ids < L) and the last layer's output before
the final norm (id L), and compares each slot with what is stored token by token, each token against its
own size. A mismatch is named when it looks like a known fault: a slot holding a neighbouring layer (an
off-by-one hook), a last slot after the final norm, or states that belong to another sample.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from ..base.location import local_path
from ..data.provenance import fingerprint
from ..data.source import Source, open_source
from ..data.tokenize import Reject, Sample, SampleBuilder
from ..model.capture import find_decoder
from ..model.lengths import keep_rope_fresh
from ..model.load import load_model, model_tokenizer, read_text_config
from ..model.quantized import kept
from ..model.residual import residual_of
from ..proof.ids import prove_ids
from ..store import BF16, STORAGES, Store, StoreError, open_store
from .folder import FROM_STORE, HS_DIR, META, STORE_ROWS
from .mask_token import mask_token_id

READ_BYTES = 256 << 20  # float32 states per read in the structural pass (its temporaries take ~3x this)
DATA_ROWS = 256  # rows the data check reads again: a second or two of tokenizing
TOKEN_FLOOR = 1e-3  # of a row's median token norm: the least a reference token's norm counts as


@dataclass
class Check:
    name: str
    passed: bool
    summary: str  # one line with counts
    problems: list[str] = field(default_factory=list)  # the first few, for the user to look at
    skipped: bool = False  # not run (the summary says why): it does not fail the store


@dataclass
class Report:
    path: str
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "passed": self.passed, "checks": [asdict(c) for c in self.checks]}

    def lines(self) -> list[str]:
        out = [f"{'skip' if c.skipped else 'ok  ' if c.passed else 'FAIL'} {c.name:<12} {c.summary}"
               for c in self.checks]
        out += [f"     {c.name:<12} {p}" for c in self.checks if not c.passed for p in c.problems]
        return out


def _check(name: str, problems: list[str], ok: str, total: int, what: str) -> Check:
    if not problems:
        return Check(name, True, ok)
    return Check(name, False, f"{len(problems):,} of {total:,} {what}", problems[:10])


# -- structure, without the model


def check_audit(store: Store) -> Check:
    """What the in-run audit of the runs that wrote the store found, what they computed again, which ways and
    lengths it did not reach, or why there is none. Fails while rows computed a way found wrong wait to be computed
    again (a run stopped before it healed them)."""
    audited = store.audit()
    if audited is None:
        return Check("audit", True, "skipped: the runs that wrote this store did not audit their rows (--audit-every "
                     "0, --tp, or a streamx before 0.8)", skipped=True)
    return Check("audit", not audited.to_heal, f"in the run: {audited.phrase()}")


def check_commits(store: Store) -> Check:
    """Every part's arrays hold at least what its commit record says (exactly, once the part is closed)."""
    problems = []
    for name, part in store.parts.items():
        commit = store.commits[name]
        for array, need in (("hidden_states", commit.tokens), ("input_ids", commit.tokens),
                            ("loss_mask", commit.tokens), ("sample_row_id", commit.samples),
                            ("sample_offset", commit.samples), ("sample_length", commit.samples),
                            ("reject_row_id", commit.rejects)):
            size = part[array].shape[0]
            if size < need or (commit.closed and size != need):
                problems.append(f"{name}/{array}: {size:,} entries, the commit says {need:,}")
    return _check("commits", problems, f"{len(store.parts)} part(s) agree with their commit records",
                  len(store.parts), "parts disagree")


def check_complete(store: Store) -> Check:
    """Every part closed by a run that reached the end of its rows, and every row of the data in some part."""
    state = store.completeness()
    if state.complete:
        return Check("complete", True, f"every part closed; all {state.source_rows:,} rows of the data are samples "
                     "or rejects")
    problems = state.problems()
    return Check("complete", False, "unfinished: " + problems[0] + (f" (+{len(problems) - 1} more)" if len(problems)
                 > 1 else "") + "; re-run the same `streamx run` to finish it", problems)


def check_index(store: Store) -> Check:
    """Each sample's tokens lie inside its part's committed tokens, as many as its length; no two samples share a
    token unless the store shares them (--sharing)."""
    problems = []
    shares = store.metadata.sharing != "off"
    for i, name in enumerate(store.parts):
        tokens = store.commits[name].tokens
        mine = np.flatnonzero(store.index.parts == i)
        owner, firsts, lengths = store.spans(mine)
        outside = (lengths <= 0) | (firsts < 0) | (firsts + lengths > tokens)
        bad = np.bincount(owner, weights=outside, minlength=mine.size) > 0
        bad |= np.bincount(owner, weights=lengths, minlength=mine.size) != store.index.lengths[mine]
        for pos in mine[bad].tolist():
            problems.append(f"{name}: sample {pos} spans tokens {store.ranges(pos)} of {tokens:,}, its length "
                            f"{int(store.index.lengths[pos])}")
        if shares:
            continue
        mine = store.index.parts == i
        offsets, lengths = store.index.offsets[mine], store.index.lengths[mine]
        order = np.argsort(offsets, kind="stable")
        starts, ends = offsets[order], offsets[order] + lengths[order]
        for k in np.flatnonzero(starts[1:] < ends[:-1]):
            problems.append(f"{name}: samples at tokens {starts[k]} and {starts[k + 1]} overlap")
    return _check("index", problems, f"{len(store):,} samples in range" + ("" if shares else " and disjoint"),
                  len(store), "samples out of place")


def check_rows(store: Store) -> Check:
    rows = store.index.rows
    unique, counts = np.unique(rows, return_counts=True)
    rejected = np.array([r for r, _ in store.rejected()], dtype=np.int64)
    twice = counts > 1  # in numpy: a million rows are a million Python objects otherwise
    problems = [f"row {int(r)} stored {int(n)} times" for r, n in zip(unique[twice], counts[twice], strict=True)]
    problems += [f"row {int(r)} is both a sample and a reject" for r in np.intersect1d(unique, rejected)]
    repeated = store.repeated  # rows that read the first row with their content (format /4)
    if store.completeness().complete:
        unread = ~np.isin(repeated.unread, rejected)
        problems += [f"row {int(r)} repeats row {int(t)}, which is neither a sample nor a reject" for r, t in
                     zip(repeated.unread[unread], repeated.unread_same_as[unread], strict=True)]
    pending = ~np.isin(repeated.differing, rows)  # (a later run computes them as rows of their own)
    problems += [f"row {int(r)} was stored as a repeat of row {int(t)}, whose tokens are not its own (their content "
                 "keys collide): nothing reads it; re-run the same `streamx run` to compute it" for r, t in
                 zip(repeated.differing[pending], repeated.differing_same_as[pending], strict=True)]
    return _check("rows", problems, f"{len(store):,} samples, every row once", len(store), "rows duplicated")


def _spans(store: Store, part: int, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(store positions, first token, end token) of the tokens each of a part's samples reads, by first token
    (a sample that shares tokens reads them where they lie, within the tokens its batch stored, or for a
    prefix that an earlier batch of its tree stored, maybe far before: then its last range, the rest read apart
    by check_values)."""
    mine = np.flatnonzero(store.index.parts == part)
    if mine.size == 0:
        return mine, mine, mine
    owner, starts, lengths = store.spans(mine)
    first_range = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])  # every sample has a range
    last_range = np.r_[first_range[1:], owner.size] - 1
    firsts, ends = np.minimum.reduceat(starts, first_range), np.maximum.reduceat(starts + lengths, first_range)
    far = ends - firsts > limit
    firsts[far], ends[far] = starts[last_range[far]], starts[last_range[far]] + lengths[last_range[far]]
    order = np.argsort(firsts, kind="stable")
    return mine[order], firsts[order], ends[order]


def _blocks(store: Store) -> Iterator[tuple[str, np.ndarray, int, int, Any]]:
    """Each part in reads of whole samples: (part name, store positions, first token, end token, the part), at
    most READ_BYTES of float32 states a read unless one sample reads more."""
    limit = max(1, READ_BYTES // (store.metadata.num_slots * store.metadata.hidden_size * 4))
    for i, (name, part) in enumerate(store.parts.items()):
        positions, firsts, ends = _spans(store, i, limit)
        k = 0
        while k < positions.size:
            first, last, j = int(firsts[k]), int(ends[k]), k + 1
            while j < positions.size and max(last, ends[j]) - first <= limit:
                last, j = max(last, int(ends[j])), j + 1
            yield name, positions[k:j], first, last, part
            k = j


def _states(store: Store, part: Any, a: int, b: int) -> torch.Tensor:
    """Hidden states of tokens a..b of a part as float32 [T, K, H]."""
    scales = part["hidden_states_scales"][a:b] if store.storage.scaled else None
    return store.storage.decode_float32(part["hidden_states"][a:b], scales)


@dataclass
class _Values:
    """What check_values asks of each sample of a read, one entry per sample: its ids' least and greatest, whether
    its mask holds values other than 0/1 or a 1 at all, and per slot whether every value is finite, and the
    greatest and least finite value."""

    low_id: np.ndarray
    high_id: np.ndarray
    non_binary: np.ndarray
    trainable: np.ndarray
    finite: np.ndarray  # [S, K]
    high: np.ndarray  # [S, K]
    low: np.ndarray  # [S, K]


def _values(ids: np.ndarray, mask: np.ndarray, finite: np.ndarray, high: np.ndarray, low: np.ndarray,
            starts: np.ndarray) -> _Values:
    """_Values of samples laid end to end in per-token arrays, each starting at `starts` (none empty)."""
    return _Values(np.minimum.reduceat(ids, starts), np.maximum.reduceat(ids, starts),
                   np.logical_or.reduceat((mask != 0) & (mask != 1), starts),
                   np.logical_or.reduceat(mask != 0, starts), np.logical_and.reduceat(finite, starts),
                   np.maximum.reduceat(high, starts), np.minimum.reduceat(low, starts))


def _token_values(states: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token and slot of float32 [T, K, H] states: all finite, greatest and least finite value."""
    finite = torch.isfinite(states).all(dim=2)  # [T, K]
    high = torch.where(finite[..., None], states, -torch.inf).amax(dim=2)
    low = torch.where(finite[..., None], states, torch.inf).amin(dim=2)
    return finite.numpy(), high.numpy(), low.numpy()


def _block_values(store: Store, part: Any, positions: np.ndarray, first: int, last: int, ids: np.ndarray,
                  stored_mask: np.ndarray, states: torch.Tensor) -> _Values:
    """_Values of the samples at `positions` from one read of tokens first..last of their part, gathered for all
    at once; a sample whose prefix an earlier batch of its tree stored far before is read apart."""
    owner, starts, lengths = store.spans(positions)
    apart = np.bincount(owner, weights=(starts < first) | (starts + lengths > last), minlength=positions.size) > 0
    apart |= store.index.lengths[positions] == 0
    together = ~apart[owner]
    owner, starts, lengths = owner[together], starts[together], lengths[together]
    tokens = np.repeat(starts - first - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
    sizes = store.index.lengths[positions]
    bounds = np.cumsum(np.where(apart, 0, sizes)) - np.where(apart, 0, sizes)  # each sample's first gathered token
    mask = stored_mask[tokens]
    for k in np.flatnonzero(~apart & (store.index.mask_offsets[positions] >= 0)).tolist():  # its own mask
        mask[bounds[k] : bounds[k] + sizes[k]] = store.loss_mask_at(int(positions[k]))
    finite, high, low = _token_values(states)
    values = _values(ids[tokens], mask, finite[tokens], high[tokens], low[tokens], bounds[~apart])
    everyone = _Values(*(np.zeros((positions.size, *v.shape[1:]), dtype=v.dtype) for v in vars(values).values()))
    for name, v in vars(values).items():
        getattr(everyone, name)[~apart] = v
    everyone.finite[apart] = True  # (an empty sample: nothing to check but its mask)
    for k in np.flatnonzero(apart & (sizes > 0)).tolist():
        pos = int(positions[k])
        sample_ids, sample_mask = (t.numpy() for t in store.tokens_at(pos))
        sample_states = torch.cat([_states(store, part, a, b) for a, b in store.ranges(pos)])
        one = _values(sample_ids, sample_mask, *_token_values(sample_states), np.zeros(1, dtype=np.int64))
        for name, v in vars(one).items():
            getattr(everyone, name)[k] = v[0]
    return everyone


def check_values(store: Store, vocab_size: int | None) -> list[Check]:
    """Token ids, loss masks and states of every sample, read part by part in large slices."""
    ids_bad, mask_bad, states_bad, unreadable = [], [], [], []
    slots = store.layer_ids
    for name, positions, first, last, part in _blocks(store):
        try:
            ids, stored_mask = part["input_ids"][first:last], part["loss_mask"][first:last]
            states = _states(store, part, first, last)
        except Exception as err:  # noqa: BLE001 - a damaged file: say which part and go on
            unreadable.append(f"{name}: tokens {first:,}..{last:,} cannot be read ({type(err).__name__}: {err})")
            continue
        values = _block_values(store, part, positions, first, last, ids, stored_mask, states)
        constant = values.finite & (values.high == values.low)
        flagged = (values.low_id < 0) | values.non_binary | ~values.trainable | ~values.finite.all(1) \
            | constant.any(1)
        if vocab_size is not None:
            flagged |= values.high_id >= vocab_size
        for k in np.flatnonzero(flagged).tolist():
            row = int(store.index.rows[positions[k]])
            low_id, high_id = int(values.low_id[k]), int(values.high_id[k])
            if low_id < 0 or (vocab_size is not None and high_id >= vocab_size):
                ids_bad.append(f"row {row}: token ids {low_id}..{high_id} outside "
                               f"0..{vocab_size - 1 if vocab_size else '?'}")
            if values.non_binary[k]:
                mask_bad.append(f"row {row}: loss mask values other than 0 and 1")
            elif not values.trainable[k]:
                mask_bad.append(f"row {row}: loss mask has no trainable token")
            for slot, layer_id in enumerate(slots):
                if not values.finite[k, slot]:
                    states_bad.append(f"row {row}: id {layer_id} holds NaN or Inf")
                elif constant[k, slot]:
                    value = float(values.high[k, slot])
                    states_bad.append(f"row {row}: id {layer_id} is " + ("all zero" if value == 0 else
                                                                         f"constant {value:g}"))
    n = len(store)
    checks = [
        _check("read", unreadable, f"{sum(c.tokens for c in store.commits.values()):,} committed tokens read",
               len(store.parts), "reads failed"),
        _check("token_ids", ids_bad, f"{n:,} samples' ids within the vocabulary ({vocab_size or 'size unknown'})",
               n, "samples"),
        _check("loss_mask", mask_bad, f"{n:,} samples' masks are 0/1 with a trainable token", n, "samples"),
        _check("states", states_bad, f"{n:,} samples x {len(slots)} slots finite, not all zero, not constant",
               n * len(slots), "sample slots"),
    ]
    return checks


# -- against the data


def data_rows(store: Store, n: int, seed: int) -> list[int]:
    """Store positions of n samples to read again from the data, ascending: first the rows stored as repeats of an
    earlier row, which read that row's tokens (where a content-key collision would serve another row's), at
    least half of the n and all where they fit; every sample when n is as many."""
    rng = np.random.default_rng(seed)
    repeats, others = np.flatnonzero(store.same_as >= 0), np.flatnonzero(store.same_as < 0)
    take = min(repeats.size, max(n // 2, n - others.size))
    picked = [*rng.choice(repeats, take, replace=False), *rng.choice(others, min(others.size, n - take),
                                                                       replace=False)]
    return sorted(int(p) for p in picked)


def _built(source: Source, builder: SampleBuilder, rows: list[int]) -> dict[int, Sample | Reject]:
    """What the run makes of these rows of the source (ascending ids), reading no further than the last."""
    built: dict[int, Sample | Reject] = {}
    for row in source.rows_at(rows):
        built[row.row_id] = builder(row)
        if len(built) == len(rows):
            break  # a streamed source is not read to its end
    return built


def _data_problem(store: Store, pos: int, made: Sample | Reject | None) -> str | None:
    """What differs between the sample at `pos` and what the run makes of its row of the data, or None."""
    row = int(store.index.rows[pos])
    if made is None:
        return f"row {row}: not in the data"
    if isinstance(made, Reject):
        return f"row {row}: the data's row is rejected now ({made.reason}: {made.detail})"
    try:
        ids, mask = store.tokens_at(pos)
    except Exception as err:  # noqa: BLE001 - a damaged file; the read check names it
        return f"row {row}: cannot be read ({type(err).__name__})"
    for what, stored, data in (("token ids", ids, made.input_ids), ("loss mask", mask, made.loss_mask)):
        n = min(len(stored), len(data))
        differ = torch.nonzero(stored[:n] != data[:n])
        if differ.numel() or len(stored) != len(data):
            sizes = "" if len(stored) == len(data) else f" ({len(stored)} tokens stored, {len(data)} in the data)"
            first = int(store.same_as[pos])
            repeat = f"; it is stored as a repeat of row {first} and reads its tokens" if first >= 0 else ""
            return (f"row {row}: its {what} in the store and in the data differ at token "
                    f"{int(differ[0]) if differ.numel() else n}{sizes}{repeat}")
    return None


def check_data(store: Store, positions: list[int]) -> Check:
    """The samples at `positions` hold the token ids and loss masks that the run's source and tokenizer (as the
    store's metadata records them: streamx.pipeline.plan builds the same) make of their rows of the data;
    skipped, with why, where the tokenizer or the data cannot be read."""
    meta, data = store.metadata, store.metadata.compat.data
    try:
        builder = SampleBuilder(model_tokenizer(meta.model["path"], meta.config.get("tokenizer")), meta.max_length,
                                meta.truncation, meta.config.get("train_turns", "all"))
    except Exception as err:  # noqa: BLE001 - the model's files are not here
        return Check("data", True, f"skipped: the tokenizer cannot be loaded ({type(err).__name__}: {err})",
                     skipped=True)
    if builder.fingerprint != meta.compat.tokenization:
        return Check("data", True, f"skipped: the tokenizer at {builder.tokenizer.name_or_path} is not the one the "
                     "store was made with (another fingerprint)", skipped=True)
    try:
        source = open_source(data, meta.compat.split, meta.config.get("max_samples"))
        built = _built(source, builder, sorted(int(store.index.rows[p]) for p in positions))
    except Exception as err:  # noqa: BLE001 - moved, deleted, or a hub dataset offline: nothing to compare with
        return Check("data", True, f"skipped: {data} cannot be read ({type(err).__name__}: {err})", skipped=True)
    problems = [p for pos in positions if (p := _data_problem(store, pos, built.get(int(store.index.rows[pos]))))]
    now = fingerprint(data)
    changed = "; the data changed since the run" if now and meta.compat.data_fingerprint not in ("", now) else ""
    repeats = int((store.same_as[positions] >= 0).sum())
    return _check("data", problems, f"{len(positions):,} rows read again from {data} ({repeats:,} of them stored "
                  "as repeats of an earlier row) hold their stored token ids and loss masks", len(positions),
                  f"rows differ from the data{changed}")


# -- against the model


def pick_samples(store: Store, n: int, seed: int) -> list[int]:
    """Store positions of n samples spread over the lengths (the longest always among them); in a store that
    shares tokens between rows, half of them rows that continue a shared prefix. Every sample when n is as many."""
    if len(store) == 0 or n <= 0:
        return []
    if n >= len(store):
        return list(range(len(store)))
    by_length = np.argsort(store.index.lengths, kind="stable")
    strata = np.array_split(by_length[:-1], max(1, min(n, len(store)) - 1))
    rng = np.random.default_rng(seed)
    picked = [int(rng.choice(s)) for s in strata if s.size][: n - 1]
    shared = np.flatnonzero(store.index.range_counts)  # rows that continue a shared prefix (--sharing)
    if shared.size:  # half of the picks among them, spread the same way
        picked = picked[: n // 2] + rng.choice(shared, min(shared.size, n - 1 - n // 2), replace=False).tolist()
    return sorted({*picked, int(by_length[-1])})


@torch.inference_mode()
def reference_states(model: nn.Module, input_ids: torch.Tensor, offset: int | None = None
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One sample alone, float32: every id 0..L from transformers' output_hidden_states (id L from the last layer's
    output: transformers' last entry has the final norm, or a multi-stream residual's contraction, applied; id 0
    from the first layer's input where the family's tuple starts after it, `offset` 1: proof.ids, asked when not
    given), each residual whole
    (streamx.model.residual); and transformers' last entry where it has the width of the others (the final norm's
    output: a slot that holds it is named), else None."""
    decoder, residual = find_decoder(model), residual_of(model.config)
    offset = prove_ids(model).offset if offset is None else offset
    seen: list[torch.Tensor] = []
    first: list[torch.Tensor] = []
    handles = [decoder.layers[-1].register_forward_hook(
        lambda mod, args, out: seen.append(out[0] if isinstance(out, (tuple, list)) else out)),
        decoder.layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: first.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)]
    try:
        out = decoder.module(input_ids=input_ids[None].to(next(model.parameters()).device), output_hidden_states=True,
                             use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    recorded = out.hidden_states[:-1] if offset == 0 else (first[0], *out.hidden_states[:-2])
    ids = [residual.flat(h)[0].float().cpu() for h in (*recorded, seen[0])]
    last = out.hidden_states[-1]
    return ids, last[0].float().cpu() if last.shape[-1] == residual.width and last.dim() == 3 else None


def token_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token of [T, H] states, ||got - ref|| / ||ref||: each token against its own size, since one scale for a
    row is set by its massive activations (SmolLM2's first token: ~25,000 against ~150) and hides the other
    tokens; a reference token near zero counts as TOKEN_FLOOR of the row's median token norm."""
    norms = ref.norm(dim=1)
    return (got - ref).norm(dim=1) / norms.clamp(min=max(TOKEN_FLOOR * float(norms.median()), 1e-30))


def _mismatch(store: Store, stored: dict[int, Any], references: dict[int, Any], pos: int, slot: int,
              errors: torch.Tensor, tolerance: float) -> str:
    """A slot that does not match its id at every token: named by the known fault's states it matches at every
    token, else by how many tokens differ and where most."""
    layer_id, L = store.layer_ids[slot], store.metadata.num_layers
    sample, (ref, post_norm) = stored[pos], references[pos]
    got = sample.hidden_states[:, slot].float()
    others = {f"id {j}": ref[j] for j in (layer_id - 1, layer_id + 1) if 0 <= j <= L}
    if layer_id == L and post_norm is not None:
        others["the final norm's output"] = post_norm
    others.update({f"row {stored[p].row_id}'s id {layer_id}": references[p][0][layer_id] for p in stored
                   if p != pos and len(stored[p].input_ids) == len(sample.input_ids)})
    close = {what: float(token_errors(got, state).max()) for what, state in others.items()}
    what, best = min(close.items(), key=lambda kv: kv[1]) if close else (None, np.inf)
    where = f"row {sample.row_id}: slot {slot} (id {layer_id})"
    if what is not None and best <= tolerance:
        fault = ("an off-by-one hook" if what.startswith("id ") else "a post-norm last slot (the final norm "
                 "applied)" if what.startswith("the final") else "states swapped between samples")
        return f"{where} holds {what} (relative difference {best:.2g} or less at every token): {fault}"
    over = int((~(errors <= tolerance)).sum())  # (NaN counts)
    token = int(errors.argmax())
    return (f"{where} differs from the model's states at {over} of {errors.numel()} tokens, most at token {token} "
            f"(relative difference {float(errors[token]):.2g}, tolerance {tolerance:.2g})")


def check_model(store: Store, model: nn.Module, positions: list[int], tolerance: float,
                log: Callable[[str], None]) -> Check:
    """Each picked sample recomputed alone, and each slot compared with it token by token; a slot that does not
    match is named by what it matches instead."""
    ids = store.layer_ids
    problems, references, stored = [], {}, {}
    offset = prove_ids(model).offset  # where the model's own output_hidden_states start
    log(f"verify: recomputing {len(positions)} samples alone with the model")
    for pos in tqdm(positions, desc="verify", unit="sample", disable=not sys.stderr.isatty()):  # a bar, not lines
        try:
            sample = store.at(pos)
        except Exception as err:  # noqa: BLE001 - a damaged file; the read check names it
            problems.append(f"row {int(store.index.rows[pos])}: cannot be read ({type(err).__name__})")
            continue
        references[pos] = reference_states(model, sample.input_ids, offset)
        stored[pos] = sample
    worst = (0.0, "")
    for pos, sample in stored.items():
        got, ref = sample.hidden_states.float(), references[pos][0]
        for slot, layer_id in enumerate(ids):
            errors = token_errors(got[:, slot], ref[layer_id])
            token = int(errors.argmax())
            if float(errors[token]) <= tolerance:
                worst = max(worst, (float(errors[token]), f"row {sample.row_id}, id {layer_id}, token {token}"))
            else:
                problems.append(_mismatch(store, stored, references, pos, slot, errors, tolerance))
    largest = f"{worst[0]:.2g} at {worst[1]}" if worst[1] else "0"
    return _check("model", problems, f"{len(stored)} samples recomputed alone match every slot at every token "
                  f"(largest relative difference {largest}, tolerance {tolerance:.2g})", len(positions) * len(ids),
                  "sample slots differ")


def tolerance_for(store: Store) -> float:
    """What separates rounding from a fault, token by token (docs/verify.md has the measured figures): rounding
    makes at most ~0.003 in bf16 storage of a float32 forward, ~0.05 in fp8 storage (3 mantissa bits), ~0.14 in a
    bf16 or fp16 forward batched against unbatched (SmolLM2-135M's deep layers); a fault moves a token by its own
    size (zeroed: 1, scaled by 1.5: 0.5, a neighbouring layer: 0.4 or more)."""
    if store.metadata.compat.compute_dtype in ("bfloat16", "float16"):
        audited = store.audit()  # a model louder than SmolLM2: what its own noise allows, as the run measured it
        noise = (audited.tolerance or {}).get("token", 0.0) if audited else 0.0
        return max(0.25, noise + (0.0 if store.storage.lossless else 0.05))
    return 0.02 if store.storage.lossless else 0.1


# -- a converted speculators folder, against the store it came from


def check_files(spec: Path, store: Store) -> Check:
    """Every hs file holds what convert writes for its row of the store (found by its token ids), bit for bit,
    and the dataset row of the same index has the same ids."""
    from datasets import load_from_disk

    from .convert import training_sample

    meta = json.loads((spec / META).read_text())
    rows = load_from_disk(str(spec))
    if meta["identity"]["hidden_states"] == FROM_STORE:
        return check_store_rows(spec, store, rows)
    files = STORAGES[meta.get("hidden_states_dtype", BF16.name)]
    # which store sample each file is: store_rows.npy (one read a file), or, in folders from before it, every
    # sample with the file's token ids
    named = np.load(spec / STORE_ROWS) if (spec / STORE_ROWS).exists() else None
    by_ids: dict[bytes, list[int]] = {}  # token ids -> store positions: ids only
    for i in range(len(store) if named is None else 0):
        by_ids.setdefault(hashlib.sha1(store.read_tokens(i, "input_ids").tobytes()).digest(), []).append(i)
    K, H = store.metadata.num_slots, store.metadata.hidden_size
    store_rows = set(store.index.rows.tolist())
    problems = []
    for i in range(len(rows)):
        name = f"{HS_DIR}/hs_{i}.safetensors"
        f = _tensors(spec, name, problems)
        if f is None:
            continue
        ids = f["token_ids"]
        if not torch.equal(ids, rows[i]["input_ids"]):
            problems.append(f"{name}: token ids differ from dataset row {i}'s input_ids")
            continue  # one problem a file
        if named is not None:
            candidates = [int(named[i])] if i < named.size and int(named[i]) in store_rows else []
        else:
            candidates = [int(store.index.rows[p])
                          for p in by_ids.get(hashlib.sha1(ids.numpy().tobytes()).digest(), [])]
        expected = [training_sample(store, K, H, files, row)[1] for row in candidates]
        if not any(_same_states(f, e) for e in expected):
            problems.append(f"{name}: " + ("its token ids match no sample of the store" if not candidates else
                                           f"its states are not row {candidates[0]}'s as the store holds them"))
    return _check("files", problems, f"{len(rows):,} hs files hold their rows' {files.name} states as the store "
                  f"{meta['source']['store']} does, bit for bit", len(rows), "files differ")


def check_store_rows(spec: Path, store: Store, rows: Any) -> Check:
    """A --hidden-states store folder: each dataset row names a store sample (store_rows.npy) with its token ids."""
    store_rows = np.load(spec / STORE_ROWS)
    problems = [] if store_rows.size == len(rows) else [f"{STORE_ROWS} has {store_rows.size:,} rows, the dataset "
                                                         f"{len(rows):,}"]
    for i, row in enumerate(store_rows.tolist()[: len(rows)]):
        try:
            ids, _ = store.tokens_at(store.position(row))
        except KeyError:
            problems.append(f"dataset row {i}: source row {row} is not in the store")
            continue
        if not torch.equal(ids, rows[i]["input_ids"]):
            problems.append(f"dataset row {i}: its input_ids are not source row {row}'s")
    return _check("rows", problems, f"{len(rows):,} dataset rows name store samples with their token ids (no hs "
                  "files: the streamx backend reads the store)", len(rows), "rows differ")


def _same_states(f: dict[str, torch.Tensor], s: Any) -> bool:
    same = f["hidden_states"].shape == s.hidden_states.shape and torch.equal(
        f["hidden_states"].view(torch.uint8), s.hidden_states.contiguous().view(torch.uint8))
    if s.hidden_states_scales is not None:
        same = same and torch.equal(f.get("hidden_states_scales", torch.empty(0)).flatten(), s.hidden_states_scales)
    return same


def check_export(folder: Path, store: Store, record: dict[str, Any], checkpoint: str | None = None) -> Check:
    """A finished trainer's folder (`streamx convert --format`; `record`: its EXPORT): every row's file holds what
    convert writes for that row of the store, ids, masks and names exactly, states within one bf16 step (the last
    state is normed again here, in float32, from the checkpoint the convert read, where the trainer takes it so: another
    CPU may round it differently); a row convert leaves out has no file."""
    from .convert import ConvertError, prefetch
    from .export import layers, row_content, row_file
    from .final_norm import FinalNorm, FinalNormError
    from .trainers import TRAINERS

    t = TRAINERS[record["identity"]["trainer"]]
    try:
        _, slots = layers(store, t, record["identity"]["layer_ids"])
        norm = FinalNorm.from_checkpoint(checkpoint or record.get("final_norm_from") or store.metadata.model["path"],
                                         store.metadata.model.get("weights_fingerprint")) \
            if t.last == "post_norm" else None
    except (FinalNormError, ConvertError) as err:  # the checkpoint is not here, the store lost the layers
        return Check("files", False, f"{t.title}: cannot rebuild what convert wrote", [str(err)])

    def problem(row: int) -> str | None:
        want, path = row_content(store, row, t, slots, norm), row_file(folder, t, row)
        name = path.relative_to(folder).as_posix()
        if isinstance(want, str):
            return f"{name}: convert leaves this row out ({want}), yet the file is there" if path.exists() else None
        if not path.exists():
            return f"{name}: missing"
        try:
            got = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - damaged: say which and go on
            return f"{name}: cannot be read ({type(err).__name__})"
        return None if _same_row(got, want) else f"{name}: differs from what convert writes for row {row} of the store"

    rows = np.unique(store.row_ids()).tolist()
    with ThreadPoolExecutor(4, thread_name_prefix="verify") as pool:
        found = tqdm(prefetch(pool, problem, rows, 8), total=len(rows), unit="row", desc="verify files",
                     disable=not sys.stderr.isatty())
        problems = [p for p in found if p]
    return _check("files", problems, f"{len(rows):,} rows as convert writes them for {t.title}, from the store",
                  len(rows), "rows")


def check_nemo(folder: Path, store: Store, record: dict[str, Any], checkpoint: str | None = None) -> Check:
    """A NeMo AutoModel cache (`streamx convert --format nemo-*`; `record`: its EXPORT): every shard holds what
    convert writes for its rows of the store, ids and masks exactly, states and probabilities within one bf16 step
    (the norm and head read again from the checkpoint), and the manifest counts them."""
    from .convert import ConvertError
    from .final_norm import FinalNormError
    from .nemo import Cache

    identity = record["identity"]
    try:
        cache = Cache.of(store, identity["trainer"], identity["layer_ids"], checkpoint or record["final_norm_from"],
                         identity["draft_vocab_size"], identity["topk"])
    except (FinalNormError, ConvertError) as err:  # the checkpoint is not here, the store lost the layers
        return Check("files", False, "NeMo cache: cannot rebuild what convert wrote", [str(err)])
    problems = []
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest["num_samples"] != len(cache.rows) or manifest.get("complete", True) is not True:
        problems.append(f"manifest.json: {manifest['num_samples']} samples, complete {manifest.get('complete')}; the "
                        f"store gives {len(cache.rows)}")
    for shard in tqdm(cache.shards(), unit="shard", desc="verify shards", disable=not sys.stderr.isatty()):
        name = f"shard-{shard:06d}.safetensors"
        got = _tensors(folder, name, problems)
        if got is not None and not _same_row(got, cache.shard(shard)):
            problems.append(f"{name}: differs from what convert writes for its rows of the store")
    return _check("files", problems, f"{len(cache.shards())} shards as convert writes them for NeMo's "
                  f"{identity['trainer'].removeprefix('nemo-')} cache, from the store", len(cache.shards()), "shards")


def _tensors(folder: Path, name: str, problems: list[str]) -> dict[str, torch.Tensor] | None:
    """The safetensors file `name` in `folder`, or None where it is missing or damaged (said in `problems`)."""
    try:
        return load_file(folder / name)
    except Exception as err:  # noqa: BLE001 - missing or damaged: say which and go on
        problems.append(f"{name}: cannot be read ({type(err).__name__})")
        return None


def _same_row(got: Any, want: Any) -> bool:
    """The same keys; integer tensors and other values equal, float tensors (the states) within one bf16 step."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same_row(got[k], want[k]) for k in want)
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return False
        if not want.is_floating_point():
            return torch.equal(got, want)
        return torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0)
    return got == want


def check_speculators(folder: Path) -> Check:
    """speculators' own start of training, in this environment, on the CPU: for each draft the folder's commands
    name, with that command's arguments, the draft built and its train and val loaders made as `speculators train`
    does (config resolution, the mask token, the verifier's embeddings and head, hidden-states backend, EAGLE-3's
    shift) and one batch read: a command that fails at start fails here; no missing row, the draft's states finite
    and of its width."""
    try:
        from hs_connectors import HiddenStatesBackend
        from speculators.model import SpeculatorModel
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.cli import build_draft_model, parse_vocab_mappings
        from speculators.train.config import TrainConfig
        from speculators.train.dataloader import create_train_val_loaders
    except ImportError as err:
        return Check("speculators", False, f"speculators is not importable here ({err}): run verify --speculators in "
                     "the environment that trains (docs/speculators.md)")
    meta = json.loads((folder / META).read_text())
    problems, read = [], []
    for algo, argv in meta["speculators_train_argv"].items():
        if "streamx.speculators_backend" in argv:
            from . import backend  # noqa: F401 - registers the streamx backend, as that launcher does
        args = argparse.Namespace(**TrainConfig.resolve([*argv[argv.index("--data-path"):], "--num-workers", "0"])
                                  .flatten())
        try:
            d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
            draft = build_draft_model(args, SpeculatorModel.registry[args.speculator_type], t2d, d2t, draft_vocab_size)
            transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
            train, _ = create_train_val_loaders(
                data_path=args.data_path, total_seq_len=args.total_seq_len,
                hidden_states_dtype=getattr(torch, args.hidden_states_dtype), transfer=transfer,
                vllm_endpoint=args.vllm_endpoint, on_missing="raise", verifier_name_or_path=args.verifier_name_or_path,
                request_timeout=args.request_timeout, max_retries=args.max_retries,
                generation_validation_retries=args.generation_validation_retries,
                max_consecutive_generation_failures=args.max_consecutive_generation_failures,
                hidden_size=draft.config.transformer_layer_config.hidden_size,
                num_target_layers=len(draft.target_layer_ids), num_workers=0, prefetch_factor=args.prefetch_factor,
                preprocess=shift_batch if algo == "eagle3" else None, train_data_ratio=args.train_data_ratio,
                seed=args.seed)
            with warnings.catch_warnings():  # speculators asks for pinned memory, which a CPU cannot give
                warnings.filterwarnings("ignore", message=".*pin_memory.*")
                batch = next(iter(train))
        except Exception as err:  # noqa: BLE001 - whatever speculators raises is the finding
            problems.append(f"{algo}: {_speculators_failure(err, args.verifier_name_or_path)}")
            continue
        ids = draft.target_layer_ids
        states, width = batch["hidden_states"], len(ids) * meta["hidden_size"]
        if batch["error_records"]:
            problems.append(f"{algo}: {int(batch['error_records'])} rows of the first batch dropped by the loader")
        elif states.shape[-1] != width or not bool(torch.isfinite(states.float()).all()):
            problems.append(f"{algo}: states of width {states.shape[-1]} (want {width}: {len(ids)} ids x "
                            f"{meta['hidden_size']}), finite: {bool(torch.isfinite(states.float()).all())}")
        else:
            read.append(f"{algo} {int((batch['document_ids'] != -1).sum())} tokens")
    return Check("speculators", not problems, "speculators built each draft and read a batch: " + ", ".join(read) if
                 not problems else f"{len(problems)} of {len(meta['speculators_train_argv'])} drafts fail", problems)


def _speculators_failure(err: Exception, verifier: str) -> str:
    """What speculators raised, in one line; where it could not resolve the draft's mask token itself (a multimodal
    verifier without its processor files: streamx.train.mask_token), with the --mask-token-id to add."""
    said = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
    if "resolve_mask_token_id" not in (frame.name for frame in traceback.extract_tb(err.__traceback__)):
        return said
    try:
        token = mask_token_id(verifier)
    except Exception:  # noqa: BLE001 - the tokenizer cannot be read here either: speculators' own error says why
        return said
    return (f"speculators cannot resolve the draft's mask token ({said.split('. ')[0]}): add --mask-token-id {token} "
            "to the train command (streamx convert adds it now)")


def verify(path: str, samples: int = 32, seed: int = 0, device: str = "auto", use_model: bool = True,
           log: Callable[[str], None] = print, speculators: bool = False, checkpoint: str | None = None) -> Report:
    """Check the store at `path`, or a folder `streamx convert` wrote: its files against the store it came
    from (`speculators`: and speculators' own loaders reading it, where speculators is installed), then that
    store (docs/verify.md says what each failure means). `checkpoint`: the target's folder, where the one the store
    (or the convert) records is not on this machine."""
    from .export import EXPORT
    from .folder import staging
    from .trainers import TRAINERS

    record = next((p for p in (Path(path) / EXPORT, staging(Path(path)) / EXPORT) if p.exists()), None)
    exported = json.loads(record.read_text()) if record is not None else None
    if exported is not None and not exported.get("complete"):  # a convert under way, or killed
        name = exported["identity"]["trainer"]
        title = TRAINERS[name].title if name in TRAINERS else f"NeMo AutoModel's {name.removeprefix('nemo-')} cache"
        return Report(path, [Check("files", False, f"{title}: the convert did not finish (its rows so far are in "
                                                    f"{record.parent})", [
            f"run the same `streamx convert --format {name}` again: it resumes"])])
    if exported is not None and speculators:
        raise StoreError(f"{path} is a folder for another trainer: --speculators checks a speculators folder")
    if exported is not None or (Path(path) / META).exists():
        source = exported["store"] if exported else json.loads((Path(path) / META).read_text())["source"]["store"]
        local = local_path(source)
        if local is not None and not local.exists():
            raise StoreError(f"{path} was converted from {source}, which is not there: verify needs that store")
        # first: a folder's own problem is said before the store's
        if exported is None:
            files = check_files(Path(path), open_store(source))
        else:
            check = check_export if exported["identity"]["trainer"] in TRAINERS else check_nemo
            files = check(Path(path), open_store(source), exported, checkpoint)
        loaders = [check_speculators(Path(path))] if speculators else []
        store_checks = verify(source, samples, seed, device, use_model, log, checkpoint=checkpoint).checks
        return Report(path, [files, *loaders, *store_checks])
    if speculators:
        raise StoreError(f"{path} is a store: --speculators checks a folder `streamx convert` wrote")
    store = open_store(path)
    meta = store.metadata
    try:
        vocab_size = read_text_config(meta.model["path"]).vocab_size
    except Exception:  # noqa: BLE001 - the model's config is not here: the ids are checked for sign only
        vocab_size = None
    checks = [check_complete(store), check_commits(store), check_audit(store), check_index(store), check_rows(store),
              *check_values(store, vocab_size), check_data(store, data_rows(store, DATA_ROWS, seed))]
    if use_model:
        if meta.random_weights:
            raise StoreError(f"{path} was made with --random-weights: there are no weights to check it against; "
                             "use --no-model")
        ran = kept(meta.model.get("weights"))  # a quantized checkpoint: loaded as the run loaded it where it can be
        model, _, info = load_model(checkpoint or meta.model["path"], meta.compat.compute_dtype, device,
                                    dequantize=bool(meta.config.get("dequantize")) or ran is False)
        keep_rope_fresh(model)  # each sample's forward as the run's was (dynamic NTK rope: from its original scale)
        same = info.weights_fingerprint == meta.compat.model
        loaded = "" if ran is None or ran == kept(info.weights) else \
            ("; the run kept them quantized (transformers' kernels), this check dequantized them: the kernels' own "
             "arithmetic (FP8's quantizes activations too) can move states past bf16's rounding")
        said = "the weights the store was made with" if same else "NOT the weights the store was made with"
        checks.append(Check("weights", same, f"{checkpoint or meta.model['path']}: {said}{loaded}",
                            [] if same else [f"fingerprint {info.weights_fingerprint[:12]}, the store's "
                                             f"{meta.compat.model[:12]}"]))
        checks.append(check_model(store, model, pick_samples(store, samples, seed), tolerance_for(store), log))
    return Report(path, checks)

