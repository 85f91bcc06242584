"""The files `streamx regenerate` writes: the output .jsonl (whole rows, each appended once, resumed by row id),
the side file of the rows not written with their reasons, and the settings a resume must match."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..base import durable
from .engines import RowError

# what a resume must find unchanged: the settings that decide what is generated
COMPAT_SETTINGS = ("data", "split", "model", "max_tokens", "temperature", "top_p", "seed", "thinking", "reasoning",
                   "truncated", "return_token_ids")
SYNC_SECONDS = 1.0  # the output is fsynced this often: a power loss costs at most this much work, never a row twice


def side_files(out: Path) -> tuple[Path, Path]:
    """(errors, settings) beside the output: the rows not written with their reasons, and the run's settings."""
    return out.with_name(out.name + ".errors.jsonl"), out.with_name(out.name + ".settings.json")


class RowFile:
    """The output .jsonl: one whole row per line, appended with one write and fsynced every SYNC_SECONDS. A kill
    leaves whole lines and at most one partial last line, which the next open cuts off (its row is generated
    again)."""

    def __init__(self, path: Path):
        self.path = path
        self.done = self._recover() if path.exists() else set()
        durable.make_dirs(path.parent)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        durable.fsync_dir(path.parent)
        self._synced = time.monotonic()

    def _recover(self) -> set[int]:
        done, good = set(), 0
        with open(self.path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):
                    break  # a write cut short by a kill: generated again
                try:
                    done.add(int(json.loads(line)["source_row"]))
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{self.path} line {lineno} is not a regenerated row; it is not a file "
                                     "streamx regenerate wrote: choose another --out") from None
                good += len(line)
        if good < self.path.stat().st_size:
            os.truncate(self.path, good)
        return done

    def append(self, row: dict) -> None:
        # default=str: a source's other fields may hold what JSON has no type for (Arrow timestamps)
        data = memoryview((json.dumps(row, ensure_ascii=False, default=str) + "\n").encode())
        while data:  # a regular file takes the whole line in one write, save on a full disk
            data = data[os.write(self._fd, data):]
        if time.monotonic() - self._synced >= SYNC_SECONDS:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fd)
        self._synced = time.monotonic()

    def close(self) -> None:
        self.sync()
        os.close(self._fd)


class ErrorFile:
    """The side file: one line per row not written, with its reason. Started afresh by each run, whose work
    includes the rows it held."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0
        self._fh = open(path, "w", encoding="utf-8")

    def append(self, row_id: int, err: RowError) -> None:
        self._fh.write(json.dumps({"source_row": row_id, "reason": err.reason, "detail": err.detail},
                                  ensure_ascii=False) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if not self.count:  # no errors: no side file
            self.path.unlink()


def check_settings(path: Path, settings: dict, out: Path) -> None:
    """The first run records its settings beside the output; a resume with settings that change what is
    generated is refused, naming them (the rows would mix two regenerations)."""
    wanted = {k: settings[k] for k in COMPAT_SETTINGS}
    has_rows = out.exists() and out.stat().st_size > 0
    if not path.exists() and has_rows:
        raise ValueError(f"{out} exists but has no {path.name}: it was not written by streamx regenerate; choose "
                         "another --out (--overwrite replaces only an output of streamx regenerate)")
    if not has_rows:  # nothing generated yet: these settings are the run's
        durable.write_file(path, lambda tmp: tmp.write_text(json.dumps(settings, indent=2)))
        return
    saved = json.loads(path.read_text())
    changed = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in wanted.items() if saved.get(k) != v]
    if changed:
        raise ValueError(f"{out} was generated with other settings ({'; '.join(changed)}): use the same ones to "
                         "resume it, or --overwrite to start over")


def replace_output(out: Path) -> None:
    """--overwrite: remove an output of streamx regenerate (its settings file beside it says so) and its side
    files; a file that holds anything else is refused, never removed."""
    errors, settings = side_files(out)
    if out.exists() and out.stat().st_size and not settings.exists():
        raise ValueError(f"{out} exists but has no {settings.name}: it was not written by streamx regenerate, and "
                         "--overwrite replaces only an output of streamx regenerate; choose another --out")
    for path in (out, errors, settings):
        path.unlink(missing_ok=True)
