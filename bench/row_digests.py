"""What the resume's data check (data.provenance.RowDigests) costs where it is paid: reading and parsing the data.
A jsonl of real chats (the chatterbot corpus, repeated with an id per row) read through the run's source with and
without digests, rounds interleaved; prints the median times and their ratio.

    python bench/row_digests.py [ROWS] [FOLDER]
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from streamx.data.provenance import RowDigests
from streamx.data.source import open_source


def main(rows: int = 200_000, folder: str | None = None, rounds: int = 5) -> None:
    chats = [r.record for r in open_source("chatterbot:english") if r.record is not None]
    path = Path(folder or tempfile.mkdtemp()) / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": i, **chats[i % len(chats)]}) + "\n")

    def read(digests: RowDigests | None) -> float:
        started = time.perf_counter()
        assert sum(1 for _ in open_source(str(path)).rows(None, digests)) == rows
        return time.perf_counter() - started

    plain, digested = [], []
    for _ in range(rounds):
        plain.append(read(None))
        digested.append(read(RowDigests()))
    a, b = statistics.median(plain), statistics.median(digested)
    print(f"{path.stat().st_size / 1e6:.1f} MB, {rows:,} rows read and parsed: {a:.2f} s plain, {b:.2f} s with row "
          f"digests: {b / a:.3f}x (median of {rounds} interleaved rounds)")


if __name__ == "__main__":
    main(*(int(sys.argv[1]),) if len(sys.argv) > 1 else (), *sys.argv[2:3])
