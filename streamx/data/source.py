"""Rows from files, datasets and the chatterbot corpus, each with a stable row id.

A row id is the row's 0-based position in the source, so the same data always gives the
same ids (resume and shuffling depend on it). Unreadable rows still consume their id and
come out as a Row with `error` set, for the tokenizer to reject with a reason.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import yaml

from .provenance import RowDigests

_CHATTERBOT_ROLES = ("user", "assistant")  # turns alternate, user first
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
_BATCH = 1024  # rows per Arrow record batch when streaming parquet


@dataclass(frozen=True)
class Row:
    row_id: int  # 0-based position in the source, stable across runs
    record: dict | None  # the parsed record; None when the row could not be read
    error: tuple[str, str] | None = None  # (reason, detail) when unreadable


class Source:
    """A re-iterable stream of Rows. `num_rows` is None when not cheaply known (hub streams)."""

    def __init__(self, name: str, rows: Callable[[], Iterator[Row]], count: Callable[[], int | None],
                 max_samples: int | None = None, pick: Callable[[Sequence[int]], Iterator[Row]] | None = None,
                 skipping: Callable[[Callable[[int], bool], RowDigests | None], Iterator[Row]] | None = None):
        self.name = name
        self._rows, self._count, self.max_samples, self._pick = rows, count, max_samples, pick
        self._skipping = skipping

    def __iter__(self) -> Iterator[Row]:
        return itertools.islice(self._rows(), self.max_samples)

    def rows(self, skip: Callable[[int], bool] | None = None, digests: RowDigests | None = None) -> Iterator[Row]:
        """Every row but those `skip` is true of, which are neither parsed nor yielded where the format allows
        (jsonl: a resume's done windows); other formats yield every row. With `digests`, every row read, skipped
        or not, is digested as it is read (a jsonl line's bytes, else the record's canonical JSON)."""
        if self._skipping is None:
            return iter(self) if digests is None else _digested(iter(self), digests)
        rows = self._skipping(skip or (lambda row_id: False), digests)
        return rows if self.max_samples is None else itertools.takewhile(lambda r: r.row_id < self.max_samples, rows)

    def rows_at(self, row_ids: Sequence[int]) -> Iterator[Row]:
        """The rows with these ids (ascending), without parsing the others where the format allows
        (a sample of a large jsonl for `streamx plan` and the free-space check)."""
        wanted = [i for i in row_ids if self.max_samples is None or i < self.max_samples]
        if self._pick is not None:
            return self._pick(wanted)
        chosen = set(wanted)
        return (row for row in self if row.row_id in chosen)

    @cached_property
    def num_rows(self) -> int | None:
        n = self._count()  # lazy: counting a large jsonl reads the whole file once
        return n if n is None or self.max_samples is None else min(n, self.max_samples)

    def __repr__(self) -> str:
        return f"Source({self.name!r}, max_samples={self.max_samples})"


def open_source(data: str, split: str = "train", max_samples: int | None = None) -> Source:
    """Open `chatterbot:<language>`, a local .jsonl/.json/.parquet/.arrow file, a
    `datasets.save_to_disk` directory, or else a `datasets` hub name (streamed)."""
    if max_samples is not None and max_samples < 0:
        raise ValueError(f"max_samples must be >= 0, got {max_samples}")
    if data.startswith("chatterbot:"):
        name, rows, count, pick = _chatterbot(data.removeprefix("chatterbot:"))
        return Source(name, rows, count, max_samples, pick)
    path = Path(data).expanduser()
    if path.is_dir():
        ds = _load_from_disk(path, split)
        return Source(str(path), lambda: _dataset_rows(ds), lambda: ds.num_rows, max_samples,
                      lambda row_ids: _dataset_rows_at(ds, row_ids))
    if path.is_file():
        return _file_source(path, max_samples)
    if _looks_like_path(data):
        raise FileNotFoundError(f"no such file or directory: {data}")
    return _hub_source(data, split, max_samples)


def _looks_like_path(data: str) -> bool:
    # hub names are `name` or `org/name`; anything else path-shaped is a missing local path
    return (data.startswith((".", "/", "~")) or data.lower().endswith(_FILE_SUFFIXES)
            or data.count("/") > 1 or ("/" in data and Path(data.split("/")[0]).is_dir()))


# ---- chatterbot-corpus: small YAML files shipped in a package, parsed eagerly ----

def _chatterbot(language: str) -> tuple[str, Callable[[], Iterator[Row]], Callable[[], int],
                                       Callable[[Sequence[int]], Iterator[Row]]]:
    spec = importlib.util.find_spec("chatterbot_corpus")  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("chatterbot-corpus is not installed: pip install --no-deps chatterbot-corpus")
    root = Path(next(iter(spec.submodule_search_locations))) / "data"
    files = sorted((root / language).glob("*.yml"))  # sorted: row ids must not depend on the OS
    if not files:
        known = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise ValueError(f"chatterbot corpus has no language {language!r}; known: {', '.join(known)}")
    rows: list[Row] = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            doc = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        for i, conv in enumerate(doc.get("conversations") or []):
            if not isinstance(conv, list):  # e.g. a YAML slip that folds a conversation into one string
                rows.append(Row(len(rows), None, ("unrecognised_row",
                            f"{f.name} conversation {i}: expected a list of utterances, got {type(conv).__name__}")))
            elif len(conv) >= 2:  # a lone utterance has nothing to answer
                msgs = [{"role": _CHATTERBOT_ROLES[t % 2], "content": u} for t, u in enumerate(conv)]
                rows.append(Row(len(rows), {"messages": msgs}))
    return f"chatterbot:{language}", lambda: iter(rows), lambda: len(rows), lambda row_ids: (rows[i] for i in row_ids)


# ---- local files ----

def _file_source(path: Path, max_samples: int | None) -> Source:
    suffix = path.suffix.lower()
    if suffix == ".jsonl" or (suffix == ".json" and _first_byte(path) != b"["):
        return Source(str(path), lambda: _jsonl_rows(path), lambda: _count_lines(path, max_samples), max_samples,
                      lambda row_ids: _jsonl_rows(path, set(row_ids)),
                      lambda skip, digests: _jsonl_rows(path, skip=skip, digests=digests))
    if suffix == ".json":  # a JSON array has to be parsed whole: use jsonl for large data
        with open(path, "rb") as fh:
            records = json.load(fh)
        return Source(str(path), lambda: _record_rows(records), lambda: len(records), max_samples,
                      lambda row_ids: (_row(i, records[i]) for i in row_ids))
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        return Source(str(path), lambda: _parquet_rows(path),
                      lambda: pq.ParquetFile(path).metadata.num_rows, max_samples)
    if suffix == ".arrow":
        import datasets
        ds = datasets.Dataset.from_file(str(path))  # memory-mapped, not read into RAM
        return Source(str(path), lambda: _dataset_rows(ds), lambda: ds.num_rows, max_samples,
                      lambda row_ids: _dataset_rows_at(ds, row_ids))
    raise ValueError(f"unsupported data file {path}: expected .jsonl, .json, .parquet or .arrow")


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                return line.lstrip()[:1]
    return b""


def _jsonl_rows(path: Path, only: set[int] | None = None, skip: Callable[[int], bool] | None = None,
                digests: RowDigests | None = None) -> Iterator[Row]:
    """Every row, only the rows whose ids are in `only`, or all but those `skip` is true of (the others are
    counted, not parsed; `digests` takes every row's bytes)."""
    row_id, last = 0, None if only is None else max(only, default=-1)
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():  # blank lines are not rows
                continue
            if digests is not None:
                digests.add(row_id, line)
            if (only is not None and row_id not in only) or (skip is not None and skip(row_id)):
                if only is not None and row_id >= last:
                    return
                row_id += 1
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                yield Row(row_id, None, ("malformed_json", f"line {lineno}: {e}"))
            else:
                yield _row(row_id, record)
            row_id += 1


def _count_lines(path: Path, limit: int | None = None) -> int:
    """Rows of a jsonl file (blank lines are not rows), reading no further than the `limit`-th."""
    with open(path, "rb") as fh:
        return sum(1 for _ in itertools.islice((line for line in fh if line.strip()), limit))


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq
    batches = pq.ParquetFile(path).iter_batches(batch_size=_BATCH)
    return _record_rows(r for b in batches for r in b.to_pylist())


# ---- datasets: save_to_disk directories, .arrow files, the hub ----

def _load_from_disk(path: Path, split: str):
    import datasets
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ValueError(f"{path} is a directory but not one written by datasets.save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path} has no split {split!r}; splits: {', '.join(ds)}")
        ds = ds[split]
    return ds


def _dataset_rows(ds) -> Iterator[Row]:
    return _record_rows(ds.with_format(None))  # plain Python objects, whatever format was saved


def _dataset_rows_at(ds, row_ids: Sequence[int]) -> Iterator[Row]:
    return (_row(i, r) for i, r in zip(row_ids, ds.select(row_ids).with_format(None), strict=True))


def _hub_source(name: str, split: str, max_samples: int | None) -> Source:
    import datasets
    ds = datasets.load_dataset(name, split=split, streaming=True)

    def count() -> int | None:
        splits = getattr(getattr(ds, "info", None), "splits", None) or {}
        return splits[split].num_examples if split in splits else None

    return Source(f"{name}[{split}]", lambda: _record_rows(ds), count, max_samples)


def _digested(rows: Iterator[Row], digests: RowDigests) -> Iterator[Row]:
    """The rows, each digested as its record's canonical JSON (or its error) as it is read."""
    for row in rows:
        data = row.record if row.error is None else row.error
        digests.add(row.row_id, json.dumps(data, sort_keys=True, ensure_ascii=False, default=str).encode())
        yield row


def _record_rows(records: Iterable[Any]) -> Iterator[Row]:
    return (_row(i, r) for i, r in enumerate(records))


def _row(row_id: int, record: Any) -> Row:
    if isinstance(record, dict):
        return Row(row_id, record)
    return Row(row_id, None, ("unrecognised_row", f"expected a JSON object, got {type(record).__name__}"))
