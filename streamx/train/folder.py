"""The folder `speculators train --data-path DIR` reads (docs/speculators.md): its names, and its lifecycle
(fresh, resumed, complete, or someone else's).

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
(streamx.base.durable; speculators' own resume trusts file names), so a file that is present is complete,
after a power loss too. One convert at a time writes a folder (streamx.base.locks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..base import durable
from ..base.locks import is_lock

META = "streamx_meta.json"
WORK = ".streamx-convert"  # a convert's block files and plan; removed when the conversion completes
HS_DIR = "hidden_states"
STORE_ROWS = "store_rows.npy"  # the store sample (source row id) of each training row
FROM_STORE = "store"  # convert's --hidden-states value for "no hs files, read the store"
EXPORT = "streamx_export.json"  # the other trainers' formats' record (streamx.train.export)
RECORDS = (META, f"{WORK}/plan.json", EXPORT)  # what any streamx convert leaves in a folder it wrote, whatever format
PARTIAL = ".streamx-partial"  # the end of the name of the folder another trainer's convert writes until it is done


def staging(out: Path) -> Path:
    """Where a convert for another trainer writes until every row is, renamed to `out` then: beside `out`, never
    inside it, as SpecForge lists every file under its folder and ModelOpt's examples glob it, hidden folders too
    (a killed convert's rows in `out` would be trained on as a smaller dataset, without a word)."""
    out = out.resolve()
    return out.parent / f".{out.name}{PARTIAL}"


def prepare(out: Path, identity: dict[str, Any], rows: int, overwrite: bool, hs_files: bool = True
            ) -> dict[str, Any] | None:
    """Make `out` ready for the conversion `identity` names: returns its meta when `out` already holds
    it complete; raises FileExistsError when `out` holds another conversion (unless `overwrite`, which
    empties it) or files that are not a conversion (always: --overwrite never empties a folder streamx did
    not make, such as a home folder). `hs_files`: the conversion writes one per row (else store_rows.npy)."""
    meta_path, plan = out / META, out / WORK / "plan.json"
    found = claim(out, meta_path if meta_path.exists() else plan, identity, overwrite,
                  "a conversion of another store, seed, row set or hidden-state dtype")
    durable.make_dirs(out / HS_DIR if hs_files else out)
    durable.remove_temporaries(out)  # left by a killed convert (we hold the folder's lock)
    if found is not None and meta_path.exists():
        if _complete(out, rows, hs_files):
            shutil.rmtree(out / WORK, ignore_errors=True)  # a run killed just before its last step
            return found
        meta_path.unlink()  # files were deleted since: convert again (re-reading the store), keeping what is there
    durable.make_dirs(out / WORK)
    if not plan.exists():
        durable.write_file(plan, lambda tmp: tmp.write_text(json.dumps({"identity": identity}, indent=2) + "\n"))
    return None


def claim(out: Path, record: Path, identity: dict[str, Any], overwrite: bool, other: str) -> dict[str, Any] | None:
    """The record (at `record`) of the conversion `out` holds, where it is this one (`identity`); None where `out` is
    empty, or emptied by `overwrite`. Raises FileExistsError where `out` holds files that are not a conversion
    (always: --overwrite never empties a folder streamx did not make), a damaged record, or `other` (another
    conversion), unless `overwrite`."""
    if not out.exists() or all(is_lock(p.name) for p in out.iterdir()):
        return None
    if not any((out / name).exists() for name in RECORDS):
        raise FileExistsError(f"{out} holds files that are not a streamx conversion; choose an empty or new --out")
    if overwrite:
        clear(out)
        return None
    if not record.exists():  # another format's conversion
        raise FileExistsError(f"{out} holds {other}; pass --overwrite to replace it or choose another --out")
    found = _read_record(record)
    if found is None:
        raise FileExistsError(f"{out} holds a damaged conversion ({record.relative_to(out)} cannot be read); pass "
                              "--overwrite to convert it again, or choose another --out")
    if found["identity"] != identity:
        raise FileExistsError(f"{out} holds {other}; pass --overwrite to replace it or choose another --out")
    return found


def _read_record(path: Path) -> dict[str, Any] | None:
    """A convert's meta or plan, or None when it is damaged (not JSON, or without its identity)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("identity"), dict) else None


def _complete(out: Path, rows: int, hs_files: bool) -> bool:
    state = out / "state.json"
    try:
        data = [out / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):  # not there, or damaged: convert again
        data = []
    states = (out / HS_DIR / f"hs_{i}.safetensors" for i in range(rows)) if hs_files else [out / STORE_ROWS]
    return bool(data) and all(p.exists() for p in [*data, out / "dataset_info.json", out / "token_freq.pt"]) \
        and all(p.exists() for p in states)


def clear(out: Path) -> None:
    """--overwrite of a conversion: empty the folder, files put there since included (its lock lies beside it)."""
    for path in out.iterdir():
        if is_lock(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
