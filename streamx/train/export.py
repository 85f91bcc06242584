"""`streamx convert --format specforge-eagle3|specforge-dflash|modelopt|torchspec`: a store as the folder another
drafter trainer reads, one file per row (streamx.train.trainers says what each holds).

Layer ids are given as the trainer counts them (the output of block k) and mapped to the store's (k + 1); an id
the store does not hold is refused in one line naming the --layers that would. Where the trainer takes the last
state after the final norm, the target's own norm (streamx.train.final_norm, read from its checkpoint) is applied
to the stored id L in float32, then cast to the stored dtype. Rows are written by several threads, each file
under a temporary name and renamed into place, so that a file that is present is whole. They are written into a
folder beside the one asked for (folder.staging), the trainer's index files (where it has them) once every row is,
the record (EXPORT) last, and the folder is then renamed to the one asked for: a trainer pointed at it finds a
whole conversion or nothing. A killed convert is resumed by the same command (each row once).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ..base import durable
from ..base.locks import Lock, lock_file
from ..base.units import gb
from ..store import Store, open_store
from .convert import ConvertError, check_location, check_usable, prefetch, token_problem
from .final_norm import FinalNorm
from .folder import EXPORT, claim, staging  # (EXPORT: the record; `complete` once every row is written)
from .trainers import TRAINERS, Row, Trainer, Written

ROWS_PER_FOLDER = 2000  # row files per subfolder (a flat folder of a million files is slow on most filesystems)


@dataclass
class ExportSummary:
    out: str
    trainer: str
    rows: int
    tokens: int
    skipped: dict[str, int]
    kept_files: int  # written by an earlier, interrupted convert
    seconds: float
    layer_ids: list[int]  # as the trainer counts them
    record: dict[str, Any]

    def lines(self, store: str) -> list[str]:
        t = TRAINERS[self.trainer]
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        kept = f"; {self.kept_files:,} files were already written" if self.kept_files else ""
        return [f"{self.rows:,} rows ({self.tokens:,} tokens) for {t.title} in {self.out} ({self.seconds:.0f} s); "
                f"skipped {skipped}{kept}",
                f"states: {self.record['states']}",
                f"train: {t.command.replace('DIR', str(Path(self.out).resolve()))}",
                f"with {t.describe_ids(self.layer_ids)}, and the target {self.record['model']['path']}",
                f"before a long training run, check these files and the store against the model: streamx verify "
                f"{self.out}"]


def export(store_path: str, out: str, trainer: str, layer_ids: list[int] | None = None, model: str | None = None,
           overwrite: bool = False, workers: int = 4, progress: bool = True, log: Callable[[str], None] = print,
           allow_partial: bool = False, allow_random_weights: bool = False) -> ExportSummary:
    """Write the store at `store_path` into `out` as `trainer` reads it (TRAINERS), with `layer_ids` as it counts
    them (default: its own default for the model); `model`: the target's checkpoint folder, where the one the
    store records is not on this machine (its final norm is read from it). Re-running resumes."""
    if trainer not in TRAINERS:
        raise ConvertError(f"--format must be speculators or one of {', '.join(TRAINERS)}; got {trainer!r}")
    with Lock(lock_file(out), f"the convert folder {out}"):
        return _export(store_path, Path(out), TRAINERS[trainer], layer_ids, model, overwrite, workers, progress, log,
                       allow_partial, allow_random_weights)


def _export(store_path: str, out: Path, t: Trainer, layer_ids: list[int] | None, model: str | None, overwrite: bool,
            workers: int, progress: bool, log: Callable[[str], None], allow_partial: bool,
            allow_random_weights: bool) -> ExportSummary:
    started = time.perf_counter()
    store = open_for_export(store_path, out, allow_partial, allow_random_weights, log)
    ids, slots = layers(store, t, layer_ids)
    meta = store.metadata
    norm_from = model or meta.model["path"]
    norm = FinalNorm.from_checkpoint(norm_from, meta.model.get("weights_fingerprint")) \
        if t.last == "post_norm" else None
    rows = np.unique(store.row_ids())
    states = _states_text(t, ids, store.metadata.num_layers, meta.storage)
    identity = {"trainer": t.name, "follows": t.version, "store_created": meta.created,
                "store_compat": asdict(meta.compat), "layer_ids": ids, "rows": int(rows.size)}
    done = prepare_folder(out, identity, overwrite)
    if done is not None:
        log(f"{out} already holds this conversion; nothing to do")
        return _summary(done, out, 0, time.perf_counter() - started)
    stage = staging(out)
    width = (len(ids) + (t.last is not None)) * meta.hidden_size * 2
    log(f"writing {rows.size:,} rows for {t.title} into {stage}, renamed to {out} once every row is: about "
        f"{gb(store.row_tokens * width)} ({len(ids)} layers{' and the last state' if t.last else ''} at "
        f"{meta.hidden_size:,} wide, bf16)")
    written, kept, skipped = _write_rows(store, rows, stage, t, slots, norm, workers, progress)
    if t.index is not None:
        t.index(stage, written)
    record = {"identity": identity, "complete": True, "states": states, "model": meta.model, "store": store.path,
              "final_norm_from": norm_from if norm is not None else None,
              "rows": len(written), "tokens": sum(n for _, _, n in written),
              "skipped": dict(Counter(why for _, why in skipped)), "skipped_rows": skipped[:1000],
              "command": t.command, "layer_ids_setting": t.describe_ids(ids)}
    durable.write_file(stage / EXPORT, lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))
    publish(stage, out)
    if skipped:
        log(f"skipped {len(skipped):,} rows: {', '.join(f'{k}: {v}' for k, v in record['skipped'].items())}")
    return _summary(record, out, kept, time.perf_counter() - started)


def open_for_export(store_path: str, out: Path, allow_partial: bool, allow_random_weights: bool,
          log: Callable[[str], None]) -> Store:
    store = open_store(check_location(store_path, str(out)))
    meta = store.metadata
    if meta.layer_convention != "speculators" or not meta.last_id_is_pre_norm:
        raise ConvertError(f"{store_path} does not record streamx's layer convention; re-run `streamx run` with this "
                           "streamx into a new --out")
    if meta.model.get("residual"):
        raise ConvertError(f"{store_path} holds a multi-stream residual ({meta.model['residual']}) at every id; no "
                           "trainer other than speculators' reads such states")
    check_usable(store, allow_random_weights, allow_partial, log)
    return store


def layers(store: Store, t: Trainer, layer_ids: list[int] | None) -> tuple[list[int], list[int]]:
    """The trainer's ids (its counting) and the store slots that hold them, the last one (id L) appended where the
    trainer reads the last state."""
    L, held = store.metadata.num_layers, store.layer_ids
    ids = list(layer_ids) if layer_ids is not None else t.default_ids(L, [k - 1 for k in held])
    ids = sorted(ids) if t.ascending else ids
    bad = [k for k in ids if not 0 <= k < L - 1]
    if bad or not ids or len(set(ids)) != len(ids):  # (the last block's output is the last state, norm or not)
        raise ConvertError(f"{t.title} layer ids must be distinct blocks 0..{L - 2} (the output of block k; the last "
                           f"block's is the last state); got {ids}")
    needed = [k + 1 for k in ids] + ([L] if t.last else [])
    missing = [k for k in needed if k not in held]
    if missing:
        want = ",".join(map(str, sorted(set(held) | set(needed))))
        raise ConvertError(f"{store.path} holds streamx ids {held}; {t.title}'s layers {ids} are streamx ids "
                           f"{[k + 1 for k in ids]}{' and ' + str(L) if t.last else ''}, of which it lacks "
                           f"{missing}: extract them with `streamx run --layers {want}` (a new --out), or pass "
                           f"--trainer-layers with ids it holds ({[k - 1 for k in held if 0 < k < L]})")
    return ids, [held.index(k) for k in needed]


def _states_text(t: Trainer, ids: list[int], L: int, storage: str) -> str:
    last = {"post_norm": f"the last state after the target's final norm (streamx id {L} through the model's own "
                         "norm, in float32)",
            "pre_norm": f"the last state before the final norm (streamx id {L})", None: "no last state"}[t.last]
    return (f"the outputs of blocks {ids} (streamx ids {[k + 1 for k in ids]}), concatenated in that order, and "
            f"{last}; bf16{' (the fp8 store dequantized)' if storage == 'fp8' else ''}")


def prepare_folder(out: Path, identity: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """The record of `out` where it holds this conversion, complete; else its staging folder made ready (this
    conversion begun there, or a fresh one). Refused where either holds another conversion (unless `overwrite`,
    which empties it) or files that are not a conversion (folder.claim)."""
    other = "another conversion (another store, trainer, layers or row set)"
    stage = staging(out)
    if stage.parent.exists() and not os.access(stage.parent, os.W_OK):
        raise ConvertError(f"a conversion is written beside {out} and renamed into place once whole, and "
                           f"{stage.parent} is not writable: choose an --out inside a folder you can write")
    try:
        found = claim(out, out / EXPORT, identity, overwrite, other)
        if found is not None and found.get("complete"):
            return found
        if found is not None and not stage.exists():  # rows an earlier streamx wrote in place: resumed beside it
            durable.replace(out, stage)
        begun = claim(stage, stage / EXPORT, identity, overwrite, f"a killed convert of {other}")
    except FileExistsError as err:
        raise ConvertError(str(err)) from None
    if begun is None:
        durable.write_file(stage / EXPORT, lambda tmp: tmp.write_text(json.dumps({"identity": identity}) + "\n"))
    durable.remove_temporaries(stage)  # left by a killed convert (we hold the folder's lock)
    return None


def publish(stage: Path, out: Path) -> None:
    """Rename the whole conversion to `out` (absent, or an empty folder: the lock kept anyone else out)."""
    try:
        durable.replace(stage, out)
    except OSError as err:
        raise ConvertError(f"cannot rename the finished conversion {stage} to {out} ({err.strerror}): {out} was "
                           "written to meanwhile; move those files away and run the same command again") from None


def row_file(out: Path, t: Trainer, row: int) -> Path:
    first = row - row % ROWS_PER_FOLDER
    return out / f"rows_{first:09d}-{first + ROWS_PER_FOLDER - 1:09d}" / f"row_{row:09d}{t.suffix}"


def row_content(store: Store, row: int, t: Trainer, slots: list[int], norm: FinalNorm | None) -> Row | str:
    """What the row's file holds for `t` (`slots`: the store's, as `layers` found them), or why the row is left
    out."""
    s = store.sample(row)
    problem = token_problem(s.input_ids, s.loss_mask)
    if problem is None and not bool(torch.isfinite(s.hidden_states.float()).all()):
        problem = "non_finite"
    if problem:
        return problem
    aux, last = (slots[:-1], slots[-1]) if t.last else (slots, None)
    hs = s.hidden_states  # [T, K, H] in the stored dtype (an fp8 store's dequantized)
    parts = {"row": torch.tensor(row), "input_ids": s.input_ids.to(torch.int64),
             "loss_mask": s.loss_mask.to(torch.int64), "aux": hs[:, aux].reshape(hs.shape[0], -1).contiguous()}
    if last is not None:
        state = hs[:, last]
        parts["last"] = (norm(state) if norm is not None else state.float()).to(hs.dtype).contiguous()
    content = t.row(parts)
    return "untrainable" if content is None else content


def _write_rows(store: Store, rows: np.ndarray, out: Path, t: Trainer, slots: list[int], norm: FinalNorm | None,
                workers: int, progress: bool) -> tuple[Written, int, list[tuple[int, str]]]:
    """Every row's file, read and written on `workers` threads with a bounded number in flight. Returns the rows
    written (by row), how many were there already, and the rows left out with why."""
    def one(row: int) -> tuple[int, int, str | None, bool]:
        path = row_file(out, t, row)
        if path.exists():  # written whole by an interrupted convert (renamed into place)
            return row, len(store.tokens_at(store.position(row))[0]), None, True
        content = row_content(store, row, t, slots, norm)
        if isinstance(content, str):
            return row, 0, content, False
        durable.write_file(path, lambda tmp: torch.save(content, tmp))
        return row, len(content["input_ids"]), None, False

    written, kept, skipped = [], 0, []
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="export") as pool, \
            tqdm(total=rows.size, unit="row", desc=f"convert {t.name}", disable=not progress) as bar:
        for row, n, problem, was_there in prefetch(pool, one, rows.tolist(), 2 * max(1, workers)):
            bar.update(1)
            if problem:
                skipped.append((row, problem))
                continue
            written.append((row, row_file(out, t, row).relative_to(out), n))
            kept += was_there
    return written, kept, skipped


def _summary(record: dict[str, Any], out: Path, kept: int, seconds: float) -> ExportSummary:
    return ExportSummary(out=str(out), trainer=record["identity"]["trainer"], rows=record["rows"],
                         tokens=record["tokens"], skipped=record["skipped"], kept_files=kept, seconds=seconds,
                         layer_ids=record["identity"]["layer_ids"], record=record)
