"""What a convert for each trainer costs: one store of the embedded SmolLM2 on real chats (the eagle3 preset's
layers and the last one), converted to speculators' files and to each other trainer's format, rounds interleaved;
prints rows/s, the MB written per second and each format's time against speculators'.

    python bench/trainer_formats.py [ROWS] [ROUNDS] [FOLDER]
"""

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from streamx.config import load_config
from streamx.model.load import EMBEDDED_MODEL, resolve_model_path
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.train.convert import convert
from streamx.train.export import export
from streamx.train.trainers import TRAINERS


def size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def main(rows: int = 2000, rounds: int = 3, folder: str | None = None) -> None:
    work = Path(folder or tempfile.mkdtemp())
    store = str(work / "s.zarr")
    model = resolve_model_path(EMBEDDED_MODEL)
    run(load_config(None, model=model, data="chatterbot:english", out=store, layers="eagle3", max_samples=rows),
        progress=False, log=lambda m: None)
    rows = len(np.unique(open_store(store).row_ids()))
    writers = {"speculators": lambda out: convert(store, out, progress=False, log=lambda m: None)}
    writers.update({name: (lambda out, name=name: export(store, out, name, progress=False, log=lambda m: None))
                    for name in TRAINERS})
    times, sizes = {name: [] for name in writers}, {}
    for _ in range(rounds):
        for name, write in writers.items():
            out = work / name
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            write(str(out))
            times[name].append(time.perf_counter() - started)
            sizes[name] = size_mb(out)
    base = statistics.median(times["speculators"])
    print(f"{rows} rows, median of {rounds} interleaved rounds")
    print("| format | seconds | rows/s | MB written | MB/s | time vs speculators |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, t in times.items():
        s = statistics.median(t)
        print(f"| {name} | {s:.2f} | {rows / s:,.0f} | {sizes[name]:.0f} | {sizes[name] / s:,.0f} | {s / base:.2f}x |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:4])
