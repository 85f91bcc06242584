"""The folder `speculators train --data-path DIR` reads (docs/speculators.md), and its lifecycle.

    DIR/data-*.arrow, dataset_info.json, state.json   input_ids, loss_mask (int64), seq_len; torch format; shuffled
    DIR/hidden_states/hs_{i}.safetensors            hidden_states bf16 [T, K, H] (ascending ids, last = id L
                                                    pre-norm) and token_ids int64 [T] == input_ids of row i;
                                                    fp8: float8_e4m3fn states + hidden_states_scales f32 [T, 1, 1]
    DIR/store_rows.npy                               the store sample (source row id) of each training row; with
                                                    --hidden-states store there are no hs files and row i's states
                                                    are read from that sample (streamx.speculators_backend)
    DIR/token_freq.pt                                {token id: count} over loss-mask-1 tokens (--draft-vocab-size)
    DIR/streamx_meta.json                            source store, layer ids, counts, the `speculators train` flags
    DIR/.streamx-convert/                            a convert's partial state (removed when complete)

Every file is written under a temporary name in its folder, fsynced and renamed into place
(streamx.durable; speculators' own resume trusts file names), so a file that is present is complete,
after a power loss too. One convert at a time writes a folder (streamx.locks).
"""

from __future__ import annotations

import io
import json
import shlex
import shutil
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import save

from .. import __version__
from ..base import durable
from ..base.location import local_path
from ..store import BF16, Storage, Store, StoredSample

META = "streamx_meta.json"
WORK = ".streamx-convert"  # a convert's block files and plan; removed when the conversion completes
HS_DIR = "hidden_states"
STORE_ROWS = "store_rows.npy"  # the store sample (source row id) of each training row
FROM_STORE = "store"  # convert's --hidden-states value for "no hs files, read the store"
BACKEND = "streamx"  # the hidden-states backend streamx.speculators_backend registers
FP8_SCALES = "hidden_states_scales"  # the key speculators' fp8 backend dequantises hidden_states with
HS_FILES = {  # what the meta says an hs file holds
    "bf16": "hs_{i}.safetensors: hidden_states bfloat16 [T, K, H], slot j = layer_ids[j], the last slot is id L "
            "before the final norm; token_ids int64 [T] == input_ids of dataset row i",
    "fp8": "hs_{i}.safetensors: hidden_states float8_e4m3fn [T, K, H] and hidden_states_scales float32 [T, 1, 1] "
           "(value = bf16(fp8) * bf16(scale), speculators' fp8 backend), slot j = layer_ids[j], the last slot is id L "
           "before the final norm; token_ids int64 [T] == input_ids of dataset row i",
    FROM_STORE: "no hs files: speculators' `streamx` backend (python -m streamx.speculators_backend) reads dataset "
                "row i's states from the store sample of source row store_rows.npy[i]: hidden_states bf16 [T, K'+1, "
                "H], the slots of --target-layer-ids then id L before the final norm; token_ids int64 [T]",
}
ALGORITHMS = ("eagle3", "dflash")  # both read this data as is (EAGLE-3 shifts at load time, DFlash does not)
SKIP_EXAMPLES = 20  # skipped rows listed by id in the meta (all are counted)


class TokenColumns(Protocol):
    """Training rows' token columns, in training order (a convert block)."""

    input_ids: np.ndarray  # int64, the rows concatenated
    loss_mask: np.ndarray  # uint8
    seq_len: np.ndarray  # int64 per row


# -- the folder: fresh, resumed, complete, or someone else's


def prepare(out: Path, identity: dict[str, Any], rows: int, overwrite: bool, hs_files: bool = True
            ) -> dict[str, Any] | None:
    """Make `out` ready for the conversion `identity` names: returns its meta when `out` already holds
    it complete; raises FileExistsError when `out` holds another conversion (unless `overwrite`, which
    empties it) or files that are not a conversion (always: --overwrite never empties a folder streamx did
    not make, such as a home folder). `hs_files`: the conversion writes one per row (else store_rows.npy)."""
    meta_path, plan = out / META, out / WORK / "plan.json"
    found = None
    if out.exists() and any(out.iterdir()):
        record = meta_path if meta_path.exists() else plan
        found = json.loads(record.read_text()) if record.exists() else None
        if found is None:
            raise FileExistsError(f"{out} holds files that are not a streamx conversion; choose an empty or new --out")
        if overwrite:
            _clear(out)
            found = None
        elif found["identity"] != identity:
            raise FileExistsError(f"{out} holds a conversion of another store, seed, row set or hidden-state dtype; "
                                  "pass --overwrite to replace it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    if hs_files:
        (out / HS_DIR).mkdir(exist_ok=True)
    for stale in [*(out / HS_DIR).glob(".*.tmp-*"), *out.glob(".*.tmp-*")]:
        stale.unlink()  # left by a killed convert
    if found is not None and meta_path.exists():
        if _complete(out, rows, hs_files):
            shutil.rmtree(out / WORK, ignore_errors=True)  # a run killed just before its last step
            return found
        meta_path.unlink()  # files were deleted since: convert again (re-reading the store), keeping what is there
    (out / WORK).mkdir(exist_ok=True)
    for stale in (out / WORK).glob(".*.tmp-*"):
        stale.unlink()
    if not plan.exists():
        durable.write_file(plan, lambda tmp: tmp.write_text(json.dumps({"identity": identity}, indent=2) + "\n"))
    return None


def _complete(out: Path, rows: int, hs_files: bool) -> bool:
    state = out / "state.json"
    data = [out / f["filename"] for f in json.loads(state.read_text())["_data_files"]] if state.exists() else []
    states = (out / HS_DIR / f"hs_{i}.safetensors" for i in range(rows)) if hs_files else [out / STORE_ROWS]
    return bool(data) and all(p.exists() for p in [*data, out / "dataset_info.json", out / "token_freq.pt"]) \
        and all(p.exists() for p in states)


def _clear(out: Path) -> None:
    """--overwrite of a conversion: empty the folder, files put there since included (its lock lies beside it)."""
    for path in out.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


# -- the files


def write_hs(path: Path, s: StoredSample) -> None:
    """One row's file; fp8 states (hidden_states_scales set) as speculators' fp8 backend reads them."""
    tensors = {"hidden_states": s.hidden_states.contiguous(), "token_ids": s.input_ids.to(torch.int64).contiguous()}
    if s.hidden_states_scales is not None:
        tensors[FP8_SCALES] = s.hidden_states_scales.reshape(-1, 1, 1).contiguous()
    data = save(tensors)  # serialized in memory and written by Python: the file gets the usual umask permissions
    durable.write_file(path, lambda tmp: tmp.write_bytes(data))


def train_commands(out: str, verifier: str, target_layer_ids: list[int], files: Storage | None = BF16
                   ) -> dict[str, list[str]]:
    """`speculators train` argv per algorithm: --on-missing raise (the default, generate, calls a vLLM server);
    fp8 files need the fp8 hidden-states backend, which dequantises them to bf16 as it loads; with no files
    (`files` None), speculators' own train CLI with the streamx backend registered reads the store."""
    launcher = ["speculators", "train"] if files is not None else ["python", "-m", "streamx.speculators_backend"]
    base = [*launcher, "--data-path", out, "--verifier-name-or-path", verifier, "--on-missing", "raise",
            "--target-layer-ids", *map(str, target_layer_ids)]
    if files is None:
        base += ["--hidden-states-backend", BACKEND]
    elif files.scaled:
        base += ["--hidden-states-backend", files.name]  # speculators' backend is named after the storage: fp8
    return {algo: [*base, "--speculator-type", algo] for algo in ALGORITHMS}


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


def meta(store: Store, identity: dict[str, Any], aux: list[int], totals: dict[str, int],
          skipped: list[tuple[int, str]], commands: dict[str, list[str]]) -> dict[str, Any]:
    m, summary = store.metadata, store.summary()
    return {
        "format": "speculators",
        "streamx_version": __version__,
        "model": m.model,
        "tokenizer": m.tokenizer,
        "layer_ids": store.layer_ids,
        "target_layer_ids": aux,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "layer_convention": m.layer_convention,
        "layer_convention_text": m.layer_convention_text,
        "last_id_is_pre_norm": m.last_id_is_pre_norm,
        "hidden_states": HS_FILES[identity["hidden_states"]],
        "hidden_states_dtype": identity["hidden_states"],
        "source": {"store": store_location(store.path), "created": m.created, "samples": summary["samples"],
                   "tokens": summary["tokens"], "rejected_by_run": summary["rejected"], "parts": summary["parts"]},
        "shuffle": {"seed": identity["seed"], "method": "numpy.random.default_rng(seed).permutation of the sorted "
                    "unique row ids", "order_sha256": identity["order_sha256"]},
        "counts": {**totals, "skipped": len(skipped)},
        "skipped": dict(sorted(Counter(why for _, why in skipped).items())),
        "skipped_examples": [{"row_id": r, "reason": why} for r, why in skipped[:SKIP_EXAMPLES]],
        "speculators_train": {algo: shlex.join(argv) for algo, argv in commands.items()},
        "speculators_train_argv": commands,
        "identity": identity,
    }


def store_location(path: str) -> str:
    """Where a converted folder's store is: an absolute local path, or the object store URL as given."""
    local = local_path(path)
    return path if local is None else str(local.resolve())
