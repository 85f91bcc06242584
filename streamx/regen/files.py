"""The files `streamx regenerate` writes: the output .jsonl (whole rows, each appended once, resumed by row id),
the side file of the rows not written with their reasons, and the settings a resume must match."""

from __future__ import annotations

import json
import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..base import durable
from ..data.provenance import settings_file
from ..store import RowSet
from .engines import RowError

# what a resume must find unchanged: the settings that decide what is generated
COMPAT_SETTINGS = ("data", "split", "model", "max_tokens", "temperature", "top_p", "seed", "thinking", "reasoning",
                   "truncated", "return_token_ids")
SYNC_SECONDS = 1.0  # a row is fsynced within this of its append: a power loss costs at most this much work, never
# a row twice


def side_files(out: Path) -> tuple[Path, Path]:
    """(errors, settings) beside the output: the rows not written with their reasons, and the run's settings
    (data.provenance reads them: whether the output is complete, whose tokens it holds)."""
    return out.with_name(out.name + ".errors.jsonl"), settings_file(out)


class RowFile:
    """The output .jsonl: one whole row per line, each appended with one write, and fsynced within SYNC_SECONDS
    of its append by a thread of its own (the append never waits for the disk). A failed append (a full disk)
    is cut back off at once, so the file holds whole rows only. A kill leaves whole lines and at most one
    partial last line; a power loss may leave a zero-filled tail where writes had not reached the disk. The
    next open cuts either off (those rows are generated again) and says so."""

    def __init__(self, path: Path, log: Callable[[str], None] = print):
        self.path = path
        self.done = RowSet(self._recover(log) if path.exists() else np.zeros(0, dtype=np.int64))
        durable.make_dirs(path.parent)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        durable.fsync_dir(path.parent)
        self._size = os.fstat(self._fd).st_size
        self._dirty, self._error = False, None
        self._closing = threading.Event()
        self._syncer = threading.Thread(target=self._sync_every, name="streamx-regenerate-sync", daemon=True)
        self._syncer.start()

    def _recover(self, log: Callable[[str], None]) -> np.ndarray:
        """The source rows of the file's whole lines; a partial last line, or a tail from the first line with
        zero bytes in it (a power loss), is cut off."""
        rows, good = [], 0
        with open(self.path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):
                    break  # a write cut short by a kill: generated again
                row = _source_row(line)
                if row is None:
                    if b"\0" in line:
                        break  # written but never fsynced before a power loss: generated again
                    raise ValueError(f"{self.path} line {lineno} (byte {good:,}) is not a regenerated row: if streamx "
                                     f"regenerate wrote this file, cut it there to resume (truncate -s {good} "
                                     f"{self.path}); otherwise choose another --out")
                rows.append(row)
                good += len(line)
        size = self.path.stat().st_size
        if good < size:
            os.truncate(self.path, good)
            log(f"{self.path}: cut off {size - good:,} bytes after the last whole row (a write cut short by a kill "
                "or a power loss); those rows are generated again")
        return np.array(rows, dtype=np.int64)

    def append(self, row: dict) -> None:
        self._raise_sync_error()
        # default=str: a source's other fields may hold what JSON has no type for (Arrow timestamps)
        data = memoryview((json.dumps(row, ensure_ascii=False, default=str) + "\n").encode())
        try:
            while data:  # a regular file takes the whole line in one write, save on a full disk
                data = data[os.write(self._fd, data):]
        except OSError:
            os.ftruncate(self._fd, self._size)  # no part of the row stays: the file holds whole rows only
            raise
        self._size = os.fstat(self._fd).st_size
        self._dirty = True

    def _sync_every(self) -> None:
        while not self._closing.wait(SYNC_SECONDS):
            self._sync()

    def _sync(self) -> None:
        if self._dirty and self._error is None:
            self._dirty = False
            try:
                os.fsync(self._fd)
            except OSError as err:  # raised by the next append or the close, in the main thread
                self._error = err

    def _raise_sync_error(self) -> None:
        if self._error is not None:
            raise OSError(f"{self.path}: the rows written could not be made durable: {self._error}")

    def close(self) -> None:
        self._closing.set()
        self._syncer.join()
        self._dirty = True
        self._sync()
        os.close(self._fd)
        self._raise_sync_error()


_ROW_START = re.compile(rb'\{"source_row": (\d+)[,}]')  # how streamx regenerate begins every row it writes


def _source_row(line: bytes) -> int | None:
    """The source row of an output line, or None when the line is not a regenerated row. Rows begin with their
    source row (read without parsing the row); rows from before that are parsed."""
    if (match := _ROW_START.match(line)) is not None and line.rstrip().endswith(b"}"):
        return int(match.group(1))
    try:
        row = json.loads(line)["source_row"]
    except (ValueError, KeyError, TypeError):
        return None
    return row if isinstance(row, int) else None


# reasons that may pass on another try; every other reason is the row's own data (or the settings) and fails again
TRANSIENT_REASONS = ("server_error", "bad_response", "timeout")
DUPLICATE = "duplicate_prompt"  # left out by --skip-duplicates: done, as a reason of the row's own


class ErrorFile:
    """The side file: one line per row not written, with its reason. A row that failed for a reason of its own
    (its data, or the settings: a prompt too long, a turn truncated under --truncated drop-row) stays recorded
    and counts as done, so a finished output reruns as finished; `retry_errors` tries those again. A row that
    failed for a transient reason (a server error, a timeout) is dropped from the file when the next run
    starts, and tried again."""

    def __init__(self, path: Path, retry_errors: bool = False):
        self.path, self.count = path, 0  # count: this run's
        kept = [r for r in _read_errors(path) if r["reason"] not in TRANSIENT_REASONS and not retry_errors]
        self.done = RowSet(np.array([r["source_row"] for r in kept], dtype=np.int64))
        self.reasons = Counter(r["reason"] for r in kept)  # of the rows recorded before this run
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
        durable.write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        self._fh = open(path, "a", encoding="utf-8")

    def append(self, row_id: int, err: RowError) -> None:
        self._fh.write(json.dumps({"source_row": row_id, "reason": err.reason, "detail": err.detail},
                                  ensure_ascii=False) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if not self.count and not len(self.done):  # no errors: no side file
            self.path.unlink()


def _read_errors(path: Path) -> list[dict]:
    """The side file's records (a line cut short by a kill left out)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("source_row"), int) and "reason" in record:
            records.append(record)
    return records


def check_settings(path: Path, settings: dict, out: Path) -> None:
    """The first run records its settings beside the output; a resume with settings that change what is
    generated is refused, naming them (the rows would mix two regenerations). The data is compared by its
    fingerprint where both runs have one (a moved input is the same input), else by its path. The record
    says the output is not complete until `finish_settings` says otherwise: a reader (streamx run) then knows
    the file may still grow."""
    has_rows = out.exists() and out.stat().st_size > 0
    if not path.exists() and has_rows:
        raise ValueError(f"{out} exists but has no {path.name}: it was not written by streamx regenerate; choose "
                         "another --out (--overwrite replaces only an output of streamx regenerate)")
    if has_rows:
        saved = json.loads(path.read_text())
        compared = [k for k in COMPAT_SETTINGS if not (k == "data" and saved.get("data_fingerprint")
                                                       and settings.get("data_fingerprint"))]
        if saved.get("data_fingerprint") and settings.get("data_fingerprint"):
            compared.append("data_fingerprint")
        changed = [f"{k} {saved.get(k)!r} there, {settings[k]!r} here" for k in compared if saved.get(k) != settings[k]]
        if changed:
            raise ValueError(f"{out} was generated with other settings ({'; '.join(changed)}): use the same ones to "
                             "resume it, or --overwrite to start over")
        settings = {**saved, **{k: v for k, v in settings.items() if k not in COMPAT_SETTINGS}}
    _write_settings(path, {**settings, "complete": False})


def finish_settings(path: Path, complete: bool) -> None:
    """Record whether the output now holds every row it will hold (none left for a resume to write)."""
    _write_settings(path, {**json.loads(path.read_text()), "complete": complete})


def _write_settings(path: Path, settings: dict) -> None:
    durable.write_file(path, lambda tmp: tmp.write_text(json.dumps(settings, indent=2)))


def replace_output(out: Path) -> None:
    """--overwrite: remove an output of streamx regenerate (its settings file beside it says so) and its side
    files; a file that holds anything else is refused, never removed."""
    errors, settings = side_files(out)
    if out.exists() and out.stat().st_size and not settings.exists():
        raise ValueError(f"{out} exists but has no {settings.name}: it was not written by streamx regenerate, and "
                         "--overwrite replaces only an output of streamx regenerate; choose another --out")
    for path in (out, errors, settings):
        path.unlink(missing_ok=True)
