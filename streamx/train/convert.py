"""`streamx convert`: a store -> the folder `speculators train --data-path DIR` reads (docs/speculators.md).

The store's committed samples are read in training order (a seeded shuffle), validated, and written as
one hs file each (streamx.train.folder lays out the folder, streamx.train.files writes its files,
streamx.train.meta its meta). With `--hidden-states store` no hs file is written: the folder holds the
token columns and which store sample each training row is (store_rows.npy), and speculators reads the
states from the store through streamx.speculators_backend. Rows go in blocks; a finished block leaves its
token columns in a work file (DIR/.streamx-convert/), so an interrupted convert re-reads at most one
block and keeps the hs files already there (atomic, so present means complete). The dataset,
token_freq.pt and the meta are written last, from the block files, and the work folder is then removed.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from tqdm import tqdm

from ..base.durable import write_file
from ..base.location import local_path
from ..base.locks import Lock, lock_file
from ..config import check_layer_ids, resolve_layer_ids, untrainable_layers
from ..model.load import ModelNotFoundError
from ..store import STORAGES, Storage, Store, StoredSample, open_store
from . import files, folder
from .folder import FROM_STORE, HS_DIR, META, STORE_ROWS, WORK
from .mask_token import lacks_processor, mask_token_id
from .merge import PrefixFolds, prefix_folds
from .meta import NAMES, draft_layer_ids, folder_meta, train_commands

FORMATS = ("speculators",)
BLOCK_ROWS = 1024  # resume granularity: an interrupted convert re-reads at most this many rows


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
    commands: dict[str, list[str]]  # algorithm -> `speculators train` argv, for the drafts the store's ids suit
    verifier: dict[str, Any]  # the store's model record: what --verifier-name-or-path must load
    already_complete: bool = False
    unsuited: dict[str, str] = field(default_factory=dict)  # algorithm -> why not, and what to extract for it

    def lines(self, store: str) -> list[str]:
        """What `streamx convert` prints: the rows written, and the `speculators train` commands to run."""
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        commands = {algo: shlex.join(argv) for algo, argv in self.commands.items()}
        kept = f"; {self.kept_files:,} hs files were already written" if self.kept_files else ""
        v = self.verifier
        return [
            f"{self.rows:,} rows ({self.tokens:,} tokens, {self.trainable_tokens:,} trainable) in {self.out} "
            f"({self.seconds:.0f} s); skipped {skipped}{kept}",
            *(line for i, (algo, command) in enumerate(commands.items())
              for line in (f"{'train' if i == 0 else 'or'} {'an' if algo == 'eagle3' else 'a'} {NAMES[algo]} draft:",
                           f"  {command}")),
            *(f"no {NAMES[algo]} command: {why}" for algo, why in self.unsuited.items()),
            "(add --draft-vocab-size N for a reduced draft vocabulary counted in token_freq.pt; these commands are "
            f"saved in {self.out}/{META})",
            f"speculators loads the verifier {v['path']} (the model the store was made with, {v['model']}): it must "
            f"be those very weights (fingerprint {v['weights_fingerprint'][:12]}); point --verifier-name-or-path at "
            "another copy of them if that path is not there when you train",
            *([f"note: every slot holds the verifier's whole multi-stream residual ({v['residual']}); speculators "
               "builds its drafter at the verifier's hidden_size and reads states of that width, so it does not train "
               "on these as they are"] if v.get("residual") else []),
            f"before a long training run, check these files and the store against the model: streamx verify "
            f"{self.out}",
        ]


@dataclass
class _Block:
    start: int  # training index of the block's first written row
    input_ids: np.ndarray  # int64, the block's rows concatenated
    loss_mask: np.ndarray  # uint8
    seq_len: np.ndarray  # int64 per written row
    rows: np.ndarray  # int64: the source row of each written row (its store sample)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (row id, reason)


def check_store(store: Store) -> list[int]:
    """The ids speculators gets as --target-layer-ids (all but L); raises ConvertError for a store it cannot use."""
    meta, ids = store.metadata, store.layer_ids
    L = meta.num_layers
    aux = [i for i in ids if i != L]
    eagle3 = ",".join(map(str, resolve_layer_ids("eagle3", L)))
    if meta.layer_convention != "speculators" or not meta.last_id_is_pre_norm:
        raise ConvertError(f"{store.path} does not use the speculators layer convention with id {L} before the "
                           f"final norm; re-run `streamx run` with this streamx into a new --out")
    problem = untrainable_layers(ids, L)
    if problem:
        raise ConvertError(f"{store.path}: {problem}, in a new `streamx run --out`")
    try:
        check_layer_ids(ids, L)
    except ValueError as err:
        raise ConvertError(f"{store.path}: {err}; re-run `streamx run --layers {eagle3}` into a new --out") from None
    return aux


def training_order(row_ids: np.ndarray, seed: int) -> np.ndarray:
    """Source rows in training order: a permutation drawn from `seed` over the sorted unique row ids, so it
    depends on neither how many processes wrote the store nor in which order (speculators validates on the
    tail rows, so they must be shuffled)."""
    rows = np.unique(row_ids)
    return rows[np.random.default_rng(seed).permutation(rows.size)]


def convert(store_path: str, out: str, seed: int = 0, overwrite: bool = False, workers: int = 4,
            block_rows: int = BLOCK_ROWS, progress: bool = True, log: Callable[[str], None] = print,
            allow_random_weights: bool = False, hidden_states: str | None = None,
            allow_partial: bool = False, merge_prefix_rows: bool = False) -> ConvertSummary:
    """Write the speculators training data for `store_path` into `out`; re-running resumes an interrupted convert.
    An unfinished store (a part still open, rows of its data missing: `Store.completeness`) is refused unless
    `allow_partial`. `merge_prefix_rows`: each row that is a prefix of another row (a duplicate too) is folded into
    it, with the union of their loss masks (streamx.train.merge); by default every row stays a row.
    `hidden_states` is the files' dtype, bf16 or fp8 (speculators' fp8 backend), by default the store's storage;
    or `store`: no hs files, speculators reads the store itself (streamx.speculators_backend). One convert at a
    time writes `out`: a second one is refused at once (streamx.base.locks)."""
    _check_location(Path(out))
    with Lock(lock_file(out), f"the convert folder {out}"):
        return _convert(store_path, out, seed, overwrite, workers, block_rows, progress, log, allow_random_weights,
                        hidden_states, allow_partial, merge_prefix_rows)


def _check_location(out: Path) -> None:
    """`out` is, or can become, a folder: refused in one line as `run` refuses its store's path, before the lock
    beside it is taken."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConvertError(f"cannot write the convert folder at {out}: {existing} is not a folder")


def _convert(store_path: str, out: str, seed: int, overwrite: bool, workers: int, block_rows: int, progress: bool,
             log: Callable[[str], None], allow_random_weights: bool, hidden_states: str | None,
             allow_partial: bool, merge_prefix_rows: bool) -> ConvertSummary:
    started = time.perf_counter()
    store, aux, files_as = _open_source(store_path, out, hidden_states, allow_random_weights, allow_partial, log)
    all_rows = store.row_ids()
    order = training_order(all_rows, seed)
    identity = _identity(store, order, seed, block_rows, files_as)  # the store's rows (the backend checks them)
    folds = prefix_folds(store) if merge_prefix_rows else PrefixFolds({})
    folded = folds.folded
    if merge_prefix_rows:  # the same order, less the rows folded into others
        order = order[~np.isin(order, np.array(sorted(folded), dtype=order.dtype))]
        identity["merged_prefix_rows"] = len(folded)
        log(f"--merge-prefix-rows: {len(folded):,} rows are prefixes of (or repeat) another row and fold into "
            f"{len(folds.into):,} rows, their loss masks joined")
    out_dir = Path(out)
    try:
        complete = folder.prepare(out_dir, identity, order.size, overwrite, hs_files=files_as is not None)
    except FileExistsError as err:
        raise ConvertError(str(err)) from None
    if complete is not None:
        log(f"{out} already holds this conversion; nothing to do")
        return _summary(complete, out, 0, time.perf_counter() - started, already_complete=True)
    blocks, kept = _write_blocks(store, order, out_dir, files_as, workers, block_rows, progress, folds)
    meta, skipped = _finish(store, out_dir, blocks, all_rows, identity, aux, files_as, progress)
    if skipped:
        log(f"skipped {len(skipped)} rows: {_reasons(skipped)} (listed in {META})")
    return _summary(meta, out, kept, time.perf_counter() - started)


def _open_source(store_path: str, out: str, hidden_states: str | None, allow_random_weights: bool,
                 allow_partial: bool, log: Callable[[str], None]) -> tuple[Store, list[int], Storage | None]:
    """The store, the --target-layer-ids it serves (all but L), and the hs files' storage (None: no files, the
    store is read in training); raises ConvertError for what convert refuses."""
    store = open_store(check_location(store_path, out))
    aux = check_store(store)
    name = hidden_states or store.metadata.storage
    if name not in (*STORAGES, FROM_STORE):
        raise ConvertError(f"--hidden-states must be one of {', '.join((*STORAGES, FROM_STORE))}; got {name!r}")
    check_usable(store, allow_random_weights, allow_partial, log)
    return store, aux, None if name == FROM_STORE else STORAGES[name]


def check_location(store_path: str, out: str) -> str:
    """`store_path`, unless it is inside `out` or is itself a folder convert wrote (ConvertError)."""
    local = local_path(store_path)
    if local is not None and local.resolve().is_relative_to(Path(out).resolve()):
        raise ConvertError(f"--out {out} holds the store {store_path} itself; choose another folder")
    if local is not None and (local / META).is_file():
        source = json.loads((local / META).read_text()).get("source", {}).get("store", "?")
        raise ConvertError(f"{store_path} is a folder `streamx convert` wrote (speculators training data), not a "
                           f"store; it was converted from {source}")
    return store_path


def check_usable(store: Store, allow_random_weights: bool, allow_partial: bool, log: Callable[[str], None]) -> None:
    """Refuse (ConvertError) a store of random weights, an unfinished one (unless `allow_partial`: then said) and
    an empty one."""
    if store.metadata.random_weights and not allow_random_weights:
        raise ConvertError(f"{store.path} was made with --random-weights: its states train nothing; "
                           "pass --allow-random-weights to convert it anyway")
    state = store.completeness()
    if not state.complete:
        problem = state.problems()[0]
        if not allow_partial:
            raise ConvertError(f"{store.path} is unfinished: {problem}; re-run the same `streamx run` to finish it, "
                               f"or pass --allow-partial to convert the {len(store):,} samples it holds")
        log(f"converting an unfinished store (--allow-partial): {problem}")
    if not len(store):
        raise ConvertError(f"{store.path} has no committed samples")


def _write_blocks(store: Store, order: np.ndarray, out_dir: Path, files_as: Storage | None, workers: int,
                  block_rows: int, progress: bool, folds: PrefixFolds) -> tuple[list[Path], int]:
    """Every block of the training order: its hs files (unless `files_as` is None) and its block file, which
    a resumed convert reads instead of the store. Returns the block files and the hs files found written."""
    work, hs_dir = out_dir / WORK, out_dir / HS_DIR
    K, H = store.metadata.num_slots, store.metadata.hidden_size
    depth = 2 * max(1, workers)  # samples in flight per stage: bounds memory whatever the store's size
    kept, start, blocks = 0, 0, []
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="convert") as pool, \
            tqdm(total=order.size, unit="row", desc="convert", disable=not progress) as bar:
        for b, first in enumerate(range(0, order.size, block_rows)):
            rows = order[first : first + block_rows]
            path = work / f"block-{b:06d}.safetensors"
            block = _read_block(path) if path.exists() else None  # (None too when damaged: done again)
            if block is not None and (files_as is None or _all_written(hs_dir, block)):
                bar.update(rows.size)
            else:  # not done, or hs files were deleted since
                if files_as is None:
                    block, n_kept = _token_block(store, rows, start, bar.update, folds), 0
                else:
                    block, n_kept = _convert_block(store, rows, start, K, H, files_as, hs_dir, pool, depth,
                                                   bar.update, folds)
                write_file(path, lambda tmp, blk=block: _write_block(tmp, blk))
                kept += n_kept
            blocks.append(path)
            start += block.seq_len.size
    return blocks, kept


def _skipped(blocks: list[Path], all_rows: np.ndarray) -> list[tuple[int, str]]:
    """The rows left out, with their reasons: those that failed validation, and repeats of a committed row."""
    skipped = [s for path in blocks for s in _read_block(path).skipped]
    rows_sorted = np.sort(all_rows)
    return skipped + [(int(r), "duplicate_row") for r in rows_sorted[1:][rows_sorted[1:] == rows_sorted[:-1]]]


def _finish(store: Store, out_dir: Path, blocks: list[Path], all_rows: np.ndarray, identity: dict[str, Any],
            aux: list[int], files_as: Storage | None, progress: bool) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """The files written from the block files once every block is: the dataset, token_freq.pt, store_rows.npy
    and, last, the meta that says the folder is complete; then the work folder goes. Returns the meta and the
    rows left out."""
    skipped = _skipped(blocks, all_rows)
    read_blocks = lambda: (_read_block(path) for path in blocks)  # noqa: E731 - read twice, one block at a time
    if not sum(b.seq_len.size for b in read_blocks()):
        raise ConvertError(f"every sample of {store.path} failed validation ({_reasons(skipped)}); nothing to train "
                           "on")
    totals = files.write_dataset(out_dir, read_blocks(), identity["order_sha256"], progress)
    write_file(out_dir / "token_freq.pt", lambda tmp: tmp.write_bytes(files.token_freq(read_blocks())))
    rows = np.concatenate([b.rows for b in read_blocks()])  # which store sample each training row is
    write_file(out_dir / STORE_ROWS, lambda tmp: _save_npy(tmp, rows.astype("<i8")))
    suited, unsuited = draft_layer_ids(aux, store.metadata.num_layers, files=files_as is not None)
    verifier = store.metadata.model["path"]
    commands = train_commands(str(out_dir.resolve()), verifier, suited, files_as, _mask_token_id(verifier))
    meta = folder_meta(store, identity, aux, totals, skipped, commands, unsuited)
    write_file(out_dir / META, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
    shutil.rmtree(out_dir / WORK)
    return meta, skipped


def _mask_token_id(verifier: str) -> int | None:
    """The --mask-token-id the train commands need: where speculators cannot load the verifier's processor to
    resolve it (a multimodal checkpoint without its processor files, streamx.train.mask_token), else None."""
    if not lacks_processor(verifier):
        return None
    try:
        return mask_token_id(verifier)
    except (ModelNotFoundError, ValueError) as err:
        raise ConvertError(f"{err}; speculators needs that tokenizer to pick the drafts' --mask-token-id, as "
                           f"{verifier} has no processor files") from None


def _identity(store: Store, order: np.ndarray, seed: int, block_rows: int, files_as: Storage | None
              ) -> dict[str, Any]:
    """What a resumed convert must match (and the streamx backend checks the store against): the store (its
    creation and compat record), the training order, the block size (block files cover fixed ranges of it)
    and the files' dtype (or `store`: no files)."""
    return {"store_created": store.metadata.created, "store_compat": asdict(store.metadata.compat),
            "layer_ids": store.layer_ids, "seed": seed, "rows": int(order.size), "block_rows": block_rows,
            "order_sha256": order_sha256(order), "hidden_states": FROM_STORE if files_as is None else files_as.name}


def order_sha256(order: np.ndarray) -> str:
    return hashlib.sha256(order.astype("<i8").tobytes()).hexdigest()


# -- one block: read and validate in order, write hs files in parallel


def prefetch(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any], depth: int) -> Iterator[Any]:
    """fn over items on the pool, results in order, at most `depth` in flight (bounded memory)."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def token_problem(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str | None:
    """What, if anything, makes a sample's tokens unusable for training."""
    T = input_ids.numel()
    if T == 0:
        return "empty"
    if loss_mask.shape != (T,):
        return "length_mismatch"
    if int(input_ids.min()) < 0:
        return "bad_token_id"
    if not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
        return "bad_loss_mask"
    return None


def training_sample(store: Store, K: int, H: int, files_as: Storage, row: int,
                    folds: PrefixFolds = PrefixFolds({})) -> tuple[int, StoredSample, str | None]:
    """Read one sample with its states as the files hold them (bf16, or fp8 values and scales), and say what,
    if anything, makes it unusable for training; its loss mask joins those of the rows folded into it."""
    s = store.sample(row, raw=files_as.scaled)  # an fp8 store's own bytes, never quantised twice
    s.loss_mask = folds.loss_mask(store, row, s.loss_mask)
    if files_as.scaled and s.hidden_states_scales is None:  # from a bf16 store
        s.hidden_states, s.hidden_states_scales = files_as.encode(s.hidden_states)
    problem = token_problem(s.input_ids, s.loss_mask)
    if problem is None and s.hidden_states.shape[0] != s.input_ids.numel():
        problem = "length_mismatch"
    elif problem is None and s.hidden_states.shape[1:] != (K, H):
        problem = "slot_mismatch"
    elif problem is None and not bool(torch.isfinite(s.hidden_states.float()).all()):  # fp8 has NaN, no Inf
        problem = "non_finite"
    return row, s, problem


def _token_block(store: Store, rows: np.ndarray, start: int, tick: Callable[[int], Any], folds: PrefixFolds) -> _Block:
    """A block's token columns alone (--hidden-states store): the ids and masks are read, the states are not
    (streamx verify checks those)."""
    ids, masks, kept, skipped = [], [], [], []
    for row in rows.tolist():
        tick(1)
        input_ids, loss_mask = store.tokens_at(store.position(row))
        loss_mask = folds.loss_mask(store, row, loss_mask)
        problem = token_problem(input_ids, loss_mask)
        if problem:
            skipped.append((row, problem))
            continue
        ids.append(input_ids.numpy())
        masks.append(loss_mask.numpy().astype(np.uint8))
        kept.append(row)
    return _block(start, ids, masks, kept, skipped)


def _block(start: int, ids: list[np.ndarray], masks: list[np.ndarray], rows: list[int],
           skipped: list[tuple[int, str]]) -> _Block:
    cat = lambda xs, dtype: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)  # noqa: E731
    return _Block(start, cat(ids, np.int64), cat(masks, np.uint8), np.array([len(x) for x in ids], dtype=np.int64),
                  np.array(rows, dtype=np.int64), skipped)


def _convert_block(store: Store, rows: np.ndarray, start: int, K: int, H: int, files_as: Storage, hs_dir: Path,
                   pool: ThreadPoolExecutor, depth: int, tick: Callable[[int], Any],
                   folds: PrefixFolds) -> tuple[_Block, int]:
    """Training indices are given in order to the rows that pass validation, so they are the same on every run."""
    ids, masks, kept_rows, skipped = [], [], [], []
    writes: deque[Future] = deque()
    index, kept = start, 0
    read = lambda r: training_sample(store, K, H, files_as, int(r), folds)  # noqa: E731 - one line, used once
    for row, s, problem in prefetch(pool, read, rows, depth):
        tick(1)
        if problem:
            skipped.append((row, problem))
            continue
        path = hs_dir / f"hs_{index}.safetensors"
        if path.exists():
            kept += 1  # written by an interrupted run (atomic: present means complete)
        else:
            writes.append(pool.submit(files.write_hs, path, s))
        ids.append(s.input_ids.numpy())
        masks.append(s.loss_mask.numpy().astype(np.uint8))
        kept_rows.append(row)
        index += 1
        while len(writes) > depth or (writes and writes[0].done()):
            writes.popleft().result()
    for w in writes:
        w.result()
    return _block(start, ids, masks, kept_rows, skipped), kept


def _all_written(hs_dir: Path, block: _Block) -> bool:
    return all((hs_dir / f"hs_{i}.safetensors").exists() for i in range(block.start, block.start + block.seq_len.size))


def _write_block(path: Path, block: _Block) -> None:
    tensors = {"input_ids": torch.from_numpy(block.input_ids), "loss_mask": torch.from_numpy(block.loss_mask),
               "seq_len": torch.from_numpy(block.seq_len), "rows": torch.from_numpy(block.rows)}
    path.write_bytes(save(tensors, metadata={"start": str(block.start), "skipped": json.dumps(block.skipped)}))


def _save_npy(path: Path, values: np.ndarray) -> None:
    with path.open("wb") as f:  # np.save(path) would add .npy to a temporary name
        np.save(f, values)


def _read_block(path: Path) -> _Block | None:
    """A block file, or None when it is damaged (it is then converted again)."""
    try:
        with safe_open(str(path), framework="np") as f:
            meta = f.metadata()
            t = {k: f.get_tensor(k) for k in f.keys()}
        skipped = [(int(r), str(why)) for r, why in json.loads(meta["skipped"])]
        return _Block(int(meta["start"]), t["input_ids"], t["loss_mask"], t["seq_len"], t["rows"], skipped)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None


def _reasons(skipped: list[tuple[int, str]]) -> str:
    return ", ".join(f"{why}: {n}" for why, n in sorted(Counter(why for _, why in skipped).items()))


def _summary(meta: dict[str, Any], out: str, kept: int, seconds: float,
             already_complete: bool = False) -> ConvertSummary:
    c = meta["counts"]
    return ConvertSummary(out=out, rows=c["rows"], tokens=c["tokens"], trainable_tokens=c["trainable_tokens"],
                          skipped=dict(meta["skipped"]), kept_files=kept, seconds=seconds,
                          commands=meta["speculators_train_argv"], unsuited=meta.get("drafts_not_served", {}),
                          verifier=meta["model"],
                          already_complete=already_complete)
