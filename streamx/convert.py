"""`streamx convert`: a store -> the directory `speculators train --data-path DIR` reads (docs/speculators.md).

    DIR/data-*.arrow, dataset_info.json, state.json   input_ids, loss_mask (int64), seq_len; torch format; shuffled
    DIR/hidden_states/hs_{i}.safetensors            hidden_states bf16 [T, K, H] (ascending ids, last = id L
                                                    pre-norm) and token_ids int64 [T] == input_ids of row i
    DIR/token_freq.pt                                {token id: count} over loss-mask-1 tokens (--draft-vocab-size)
    DIR/streamx_meta.json                            source store, layer ids, counts, the `speculators train` flags

Every file is written under a temporary name in its directory and renamed into place. Rows are
processed in blocks of training order; a finished block leaves its token columns in a work file
(DIR/.streamx-convert/), so an interrupted convert re-reads at most one block and keeps the hs
files already there (atomic, so present means complete). The dataset, token_freq.pt and the
meta are written last, from the block files, and the work directory is then removed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm import tqdm

from . import __version__
from .config import resolve_layer_ids
from .store import Store, StoredSample, open_store

FORMATS = ("speculators",)
META = "streamx_meta.json"
WORK = ".streamx-convert"  # block files and the plan; removed when the conversion completes
HS_DIR = "hidden_states"
BLOCK_ROWS = 1024  # resume granularity: an interrupted convert re-reads at most this many rows
ALGORITHMS = ("eagle3", "dflash")  # both read this data as is (EAGLE-3 shifts at load time, DFlash does not)
SKIP_EXAMPLES = 20  # skipped rows listed by id in the meta (all are counted)


class ConvertError(RuntimeError):
    """A store or output directory convert refuses; the message is one line saying what to do."""


@dataclass
class ConvertSummary:
    out: str
    rows: int  # training rows written (hs files + dataset rows)
    tokens: int
    trainable_tokens: int
    skipped: dict[str, int]  # reason -> rows left out
    kept_files: int  # hs files an earlier, interrupted convert had already written
    seconds: float
    commands: dict[str, list[str]]  # algorithm -> `speculators train` argv
    already_complete: bool = False


@dataclass
class _Block:
    start: int  # training index of the block's first written row
    input_ids: np.ndarray  # int64, the block's rows concatenated
    loss_mask: np.ndarray  # uint8
    seq_len: np.ndarray  # int64 per written row
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (row id, reason)


def check_store(store: Store) -> list[int]:
    """The ids speculators gets as --target-layer-ids (all but L); raises ConvertError for a store it cannot use."""
    meta, ids = store.metadata, store.layer_ids
    L = int(meta["num_layers"])
    aux = [i for i in ids if i != L]
    eagle3 = ",".join(map(str, resolve_layer_ids("eagle3", L)))
    if meta.get("layer_convention") != "speculators" or not meta.get("last_id_is_pre_norm"):
        raise ConvertError(f"{store.path} does not use the speculators layer convention with id {L} before the "
                           f"final norm; re-run `streamx run` with this streamx into a new --out")
    if L not in ids:
        raise ConvertError(f"{store.path} has layer ids {ids} without {L} (the last layer's output before the final "
                           f"norm), which speculators needs as the last slot to recompute the verifier's logits; "
                           f"re-run `streamx run --layers {','.join(map(str, aux + [L]))}` (or --layers eagle3 = "
                           f"{eagle3}) into a new --out")
    if not aux:
        raise ConvertError(f"{store.path} has only layer id {L}; EAGLE-3 and DFlash drafts need auxiliary layers "
                           f"below it: re-run `streamx run --layers eagle3` (= {eagle3}) or --layers dflash")
    if ids != sorted(set(ids)) or min(ids) < 0:
        raise ConvertError(f"{store.path} has invalid layer ids {ids} (speculators needs distinct ids in 0..{L}); "
                           f"re-run `streamx run --layers {eagle3}` into a new --out")
    return aux


def training_order(row_ids: np.ndarray, seed: int) -> np.ndarray:
    """Source rows in training order: a permutation drawn from `seed` over the sorted unique row ids, so it
    depends on neither how many processes wrote the store nor in which order (speculators validates on the
    tail rows, so they must be shuffled)."""
    rows = np.unique(row_ids)
    return rows[np.random.default_rng(seed).permutation(rows.size)]


def train_commands(out: str, verifier: str, target_layer_ids: list[int]) -> dict[str, list[str]]:
    """`speculators train` argv per algorithm: --on-missing raise (the default, generate, calls a vLLM server)."""
    base = ["speculators", "train", "--data-path", out, "--verifier-name-or-path", verifier, "--on-missing", "raise",
            "--target-layer-ids", *map(str, target_layer_ids)]
    return {algo: [*base, "--speculator-type", algo] for algo in ALGORITHMS}


def convert(store_path: str, out: str, seed: int = 0, overwrite: bool = False, workers: int = 4,
            block_rows: int = BLOCK_ROWS, progress: bool = True, log: Callable[[str], None] = print,
            allow_random_weights: bool = False) -> ConvertSummary:
    """Write the speculators training data for `store_path` into `out`; re-running resumes an interrupted convert."""
    started = time.perf_counter()
    store = open_store(store_path)
    aux = check_store(store)
    if store.metadata["model"].get("random_weights") and not allow_random_weights:
        raise ConvertError(f"{store_path} was made with --random-weights: its states train nothing; "
                           "pass --allow-random-weights to convert it anyway")
    all_rows = store.row_ids()
    order = training_order(all_rows, seed)
    if not order.size:
        raise ConvertError(f"{store_path} has no committed samples")
    identity = _identity(store, order, seed, block_rows)
    out_dir = Path(out)
    complete = _prepare(out_dir, identity, order.size, overwrite)
    if complete is not None:
        log(f"{out} already holds this conversion; nothing to do")
        return _summary(complete, out, 0, time.perf_counter() - started, already_complete=True)

    work, hs_dir = out_dir / WORK, out_dir / HS_DIR
    K, H = int(store.metadata["num_slots"]), int(store.metadata["hidden_size"])
    depth = 2 * max(1, workers)  # samples in flight per stage: bounds memory whatever the store's size
    kept, start, blocks = 0, 0, []
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="convert") as pool, \
            tqdm(total=order.size, unit="row", desc="convert", disable=not progress) as bar:
        for b, first in enumerate(range(0, order.size, block_rows)):
            rows = order[first : first + block_rows]
            path = work / f"block-{b:06d}.safetensors"
            block = _read_block(path) if path.exists() else None
            if block is not None and _all_written(hs_dir, block):
                bar.update(rows.size)
            else:  # not done, or hs files were deleted since
                block, n_kept = _convert_block(store, rows, start, K, H, hs_dir, pool, depth, bar.update)
                _atomic(path, lambda tmp, blk=block: _write_block(tmp, blk))
                kept += n_kept
            blocks.append(path)
            start += block.seq_len.size

    skipped = [s for path in blocks for s in _read_block(path).skipped]
    rows_sorted = np.sort(all_rows)
    skipped += [(int(r), "duplicate_row") for r in rows_sorted[1:][rows_sorted[1:] == rows_sorted[:-1]]]
    if not start:
        raise ConvertError(f"every sample of {store_path} failed validation ({_reasons(skipped)}); nothing to train on")
    totals = _write_dataset(out_dir, blocks, identity["order_sha256"], progress)
    _atomic(out_dir / "token_freq.pt", lambda tmp: tmp.write_bytes(_token_freq(blocks)))
    commands = train_commands(str(out_dir.resolve()), store.metadata["model"]["path"], aux)
    meta = _meta(store, identity, aux, totals, skipped, commands)
    _atomic(out_dir / META, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
    shutil.rmtree(work)
    if skipped:
        log(f"skipped {len(skipped)} rows: {_reasons(skipped)} (listed in {META})")
    return _summary(meta, out, kept, time.perf_counter() - started)


# -- the output directory: fresh, resumed, complete, or someone else's


def _identity(store: Store, order: np.ndarray, seed: int, block_rows: int) -> dict[str, Any]:
    """What a resumed convert must match: the store (its creation and compat record), the training order
    and the block size (block files cover fixed ranges of it)."""
    return {"store_created": store.metadata.get("created"), "store_compat": store.metadata.get("compat"),
            "layer_ids": store.layer_ids, "seed": seed, "rows": int(order.size), "block_rows": block_rows,
            "order_sha256": hashlib.sha256(order.astype("<i8").tobytes()).hexdigest()}


def _prepare(out: Path, identity: dict[str, Any], rows: int, overwrite: bool) -> dict[str, Any] | None:
    """Make `out` ready; returns the meta when it already holds this exact, complete conversion."""
    meta_path, plan = out / META, out / WORK / "plan.json"
    found = None
    if out.exists() and any(out.iterdir()):
        record = meta_path if meta_path.exists() else plan
        found = json.loads(record.read_text()) if record.exists() else None
        if overwrite:
            _clear(out)
            found = None
        elif found is None or found["identity"] != identity:
            what = "files that are not a streamx conversion" if found is None else \
                "a conversion of another store, seed or row set"
            raise ConvertError(f"{out} holds {what}; pass --overwrite to replace it or choose another --out")
    (out / HS_DIR).mkdir(parents=True, exist_ok=True)
    for stale in [*(out / HS_DIR).glob(".*.tmp-*"), *out.glob(".*.tmp-*")]:
        stale.unlink()  # left by a killed convert
    if found is not None and meta_path.exists():
        if _complete(out, rows):
            shutil.rmtree(out / WORK, ignore_errors=True)  # a run killed just before its last step
            return found
        meta_path.unlink()  # files were deleted since: convert again (re-reading the store), keeping what is there
    (out / WORK).mkdir(exist_ok=True)
    for stale in (out / WORK).glob(".*.tmp-*"):
        stale.unlink()
    if not plan.exists():
        _atomic(plan, lambda tmp: tmp.write_text(json.dumps({"identity": identity}, indent=2) + "\n"))
    return None


def _complete(out: Path, rows: int) -> bool:
    state = out / "state.json"
    data = [out / f["filename"] for f in json.loads(state.read_text())["_data_files"]] if state.exists() else []
    return bool(data) and all(p.exists() for p in [*data, out / "dataset_info.json", out / "token_freq.pt"]) \
        and all((out / HS_DIR / f"hs_{i}.safetensors").exists() for i in range(rows))


def _clear(out: Path) -> None:
    """--overwrite: remove what a conversion writes (and nothing else)."""
    for path in [out / HS_DIR, out / WORK, out / META, out / "token_freq.pt", out / "dataset_info.json",
                 out / "state.json", *out.glob("data-*.arrow")]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write through a temporary name in the same directory, then rename: `path` is absent or complete."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# -- one block: read and validate in order, write hs files in parallel


def _prefetch(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any], depth: int) -> Iterator[Any]:
    """fn over items on the pool, results in order, at most `depth` in flight (bounded memory)."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _load(store: Store, K: int, H: int, row: int) -> tuple[int, StoredSample, str | None]:
    """Read one sample and say what, if anything, makes it unusable for training."""
    s = store.sample(row)
    T = s.input_ids.numel()
    if T == 0:
        problem = "empty"
    elif s.loss_mask.shape != (T,) or s.hidden_states.shape[0] != T:
        problem = "length_mismatch"
    elif s.hidden_states.shape[1:] != (K, H):
        problem = "slot_mismatch"
    elif int(s.input_ids.min()) < 0:
        problem = "bad_token_id"
    elif not bool(((s.loss_mask == 0) | (s.loss_mask == 1)).all()):
        problem = "bad_loss_mask"
    elif not bool(torch.isfinite(s.hidden_states).all()):
        problem = "non_finite"
    else:
        problem = None
    return row, s, problem


def _write_hs(path: Path, s: StoredSample) -> None:
    # serialized in memory and written by Python, so the file gets the usual umask permissions
    data = save({"hidden_states": s.hidden_states.contiguous(), "token_ids": s.input_ids.to(torch.int64).contiguous()})
    _atomic(path, lambda tmp: tmp.write_bytes(data))


def _convert_block(store: Store, rows: np.ndarray, start: int, K: int, H: int, hs_dir: Path,
                   pool: ThreadPoolExecutor, depth: int, tick: Callable[[int], Any]) -> tuple[_Block, int]:
    """Training indices are given in order to the rows that pass validation, so they are the same on every run."""
    ids, masks, lengths, skipped = [], [], [], []
    writes: deque[Future] = deque()
    index, kept = start, 0
    for row, s, problem in _prefetch(pool, lambda r: _load(store, K, H, int(r)), rows, depth):
        tick(1)
        if problem:
            skipped.append((row, problem))
            continue
        path = hs_dir / f"hs_{index}.safetensors"
        if path.exists():
            kept += 1  # written by an interrupted run (atomic: present means complete)
        else:
            writes.append(pool.submit(_write_hs, path, s))
        ids.append(s.input_ids.numpy())
        masks.append(s.loss_mask.numpy().astype(np.uint8))
        lengths.append(len(s.input_ids))
        index += 1
        while len(writes) > depth or (writes and writes[0].done()):
            writes.popleft().result()
    for w in writes:
        w.result()
    cat = lambda xs, dtype: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)  # noqa: E731
    return _Block(start, cat(ids, np.int64), cat(masks, np.uint8), np.array(lengths, dtype=np.int64), skipped), kept


def _all_written(hs_dir: Path, block: _Block) -> bool:
    return all((hs_dir / f"hs_{i}.safetensors").exists() for i in range(block.start, block.start + block.seq_len.size))


def _write_block(path: Path, block: _Block) -> None:
    tensors = {"input_ids": torch.from_numpy(block.input_ids), "loss_mask": torch.from_numpy(block.loss_mask),
               "seq_len": torch.from_numpy(block.seq_len)}
    path.write_bytes(save(tensors, metadata={"start": str(block.start), "skipped": json.dumps(block.skipped)}))


def _read_block(path: Path) -> _Block:
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    skipped = [(int(r), str(why)) for r, why in json.loads(meta["skipped"])]
    return _Block(int(meta["start"]), t["input_ids"], t["loss_mask"], t["seq_len"], skipped)


# -- the final files, from the block files


def _write_dataset(out: Path, blocks: list[Path], fingerprint: str, progress: bool) -> dict[str, int]:
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
        for path in blocks:
            b = _read_block(path)
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
        os.replace(saved / name, out / name)
    return totals


def _token_freq(blocks: list[Path]) -> bytes:
    """torch.save of {token id: count} over loss-mask-1 tokens, the dict speculators' vocab mapping reads."""
    counts = np.zeros(0, dtype=np.int64)
    for path in blocks:
        b = _read_block(path)
        c = np.bincount(b.input_ids[b.loss_mask == 1])
        if c.size > counts.size:
            counts = np.pad(counts, (0, c.size - counts.size))
        counts[: c.size] += c
    buf = io.BytesIO()  # saved from memory: torch.save names its archive after a file path, not after a buffer
    torch.save({int(t): int(counts[t]) for t in np.flatnonzero(counts)}, buf)
    return buf.getvalue()


def _reasons(skipped: list[tuple[int, str]]) -> str:
    return ", ".join(f"{why}: {n}" for why, n in sorted(Counter(why for _, why in skipped).items()))


def _meta(store: Store, identity: dict[str, Any], aux: list[int], totals: dict[str, int],
          skipped: list[tuple[int, str]], commands: dict[str, list[str]]) -> dict[str, Any]:
    m, summary = store.metadata, store.summary()
    return {
        "format": "speculators",
        "streamx_version": __version__,
        "model": m["model"],
        "tokenizer": m["tokenizer"],
        "layer_ids": store.layer_ids,
        "target_layer_ids": aux,
        "num_layers": m["num_layers"],
        "hidden_size": m["hidden_size"],
        "layer_convention": m["layer_convention"],
        "layer_convention_text": m.get("layer_convention_text"),
        "last_id_is_pre_norm": m["last_id_is_pre_norm"],
        "hidden_states": "hs_{i}.safetensors: hidden_states bfloat16 [T, K, H], slot j = layer_ids[j], the last "
                         "slot is id L before the final norm; token_ids int64 [T] == input_ids of dataset row i",
        "source": {"store": str(Path(store.path).resolve()), "created": m.get("created"), "samples": summary["samples"],
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


def _summary(meta: dict[str, Any], out: str, kept: int, seconds: float,
             already_complete: bool = False) -> ConvertSummary:
    c = meta["counts"]
    return ConvertSummary(out=out, rows=c["rows"], tokens=c["tokens"], trainable_tokens=c["trainable_tokens"],
                          skipped=dict(meta["skipped"]), kept_files=kept, seconds=seconds,
                          commands=meta["speculators_train_argv"], already_complete=already_complete)
