"""The files speculators reads from a convert folder (streamx.train.folder names them): one hs file per row,
the Arrow dataset of token columns, and token_freq.pt. Each is written durably (streamx.base.durable)."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors.torch import save

from ..base import durable
from ..store import StoredSample
from .folder import WORK

FP8_SCALES = "hidden_states_scales"  # the key speculators' fp8 backend dequantises hidden_states with


class TokenColumns(Protocol):
    """Training rows' token columns, in training order (a convert block)."""

    input_ids: np.ndarray  # int64, the rows concatenated
    loss_mask: np.ndarray  # uint8
    seq_len: np.ndarray  # int64 per row


def write_hs(path: Path, s: StoredSample) -> None:
    """One row's file; fp8 states (hidden_states_scales set) as speculators' fp8 backend reads them."""
    tensors = {"hidden_states": s.hidden_states.contiguous(), "token_ids": s.input_ids.to(torch.int64).contiguous()}
    if s.hidden_states_scales is not None:
        tensors[FP8_SCALES] = s.hidden_states_scales.reshape(-1, 1, 1).contiguous()
    data = save(tensors)  # serialized in memory and written by Python: the file gets the usual umask permissions
    durable.write_file(path, lambda tmp: tmp.write_bytes(data))


def write_dataset(out: Path, blocks: Iterable[TokenColumns], fingerprint: str, progress: bool) -> dict[str, int]:
    """save_to_disk of the token columns in training order, streamed block by block through an Arrow file."""
    import datasets
    import pyarrow as pa
    from datasets.arrow_writer import ArrowWriter

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                  "loss_mask": datasets.List(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    work = out / WORK
    arrow, saved = work / "tokens.arrow", work / "dataset"
    totals = {"rows": 0, "tokens": 0, "trainable_tokens": 0}
    # a fixed fingerprint (the training order's hash) keeps state.json identical on every run
    with ArrowWriter(features=features, path=str(arrow), fingerprint=fingerprint) as writer:
        for b in blocks:
            offsets = pa.array(np.concatenate([[0], np.cumsum(b.seq_len)]), pa.int32())
            writer.write_table(pa.table({
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(b.input_ids)),
                "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(b.loss_mask.astype(np.int64))),
                "seq_len": pa.array(b.seq_len),
            }))
            totals["rows"] += b.seq_len.size
            totals["tokens"] += b.input_ids.size
            totals["trainable_tokens"] += int(b.loss_mask.sum())
        writer.finalize()
    if saved.exists():
        shutil.rmtree(saved)  # from a killed run
    bars = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds = datasets.Dataset.from_file(str(arrow))
        ds.set_format("torch")
        ds.save_to_disk(str(saved))
        del ds
    finally:
        if bars:
            datasets.enable_progress_bars()
    # each file renamed into place (same filesystem); the dataset's json files last
    files = sorted(p.name for p in saved.iterdir())
    for name in [*(f for f in files if f.endswith(".arrow")), *(f for f in files if not f.endswith(".arrow"))]:
        durable.fsync_file(saved / name)
        durable.replace(saved / name, out / name)
    return totals


def token_freq(blocks: Iterable[TokenColumns]) -> bytes:
    """torch.save of {token id: count} over loss-mask-1 tokens, the dict speculators' vocab mapping reads."""
    counts = np.zeros(0, dtype=np.int64)
    for b in blocks:
        c = np.bincount(b.input_ids[b.loss_mask == 1])
        if c.size > counts.size:
            counts = np.pad(counts, (0, c.size - counts.size))
        counts[: c.size] += c
    buf = io.BytesIO()  # saved from memory: torch.save names its archive after a file path, not after a buffer
    torch.save({int(t): int(counts[t]) for t in np.flatnonzero(counts)}, buf)
    return buf.getvalue()
