"""Training reads: speculators' `get_cached` from the store (the `streamx` backend) against its file backend
over the copied hs files of the same store, in one process, same rows, same order.

    # in speculators' environment with streamx installed (docs/speculators.md)
    python bench/reader_bench.py --scratch /ext4/folder --workers 1,4 --rounds 3 --json bench/results/reader.json
    python bench/reader_bench.py --store STORE --scratch /ext4/folder       # an existing store instead

Each row's tensors go from the worker to the main process, as in speculators' loaders (the file
backend's safetensors tensors are memory-mapped: that hand-over is where their bytes are read).
Without --store, a synthetic store is written first through the real writer (non-zero bf16 states, K=6,
H=4096 as Qwen3-8B with DFlash ids, ~`--sample-tokens` tokens a sample), then converted twice with one
seed: with hs files, and with `--hidden-states store`. Each pass reads every training row once, in a
shuffled order, through a torch DataLoader with N spawned workers (the transfer pickled into them, as
speculators' loaders do), and reports samples/s and GB/s of hidden states returned, the median over the
rounds. Passes alternate between the two backends; `cold` passes first drop the page cache of every file
either backend reads (posix_fadvise DONTNEED, after a sync); `warm` passes come after one untimed pass
of each backend.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hs_connectors import HiddenStatesBackend

import streamx.speculators_backend  # noqa: F401 - registers the streamx backend
from streamx.data.tokenize import REJECT_REASONS
from streamx.pipeline.writer import PartWriter
from streamx.store import Compat, OwnedPart, StoreMetadata, make_layout, open_for_run, prepare
from streamx.train.convert import convert


def synthetic_store(path: Path, samples: int, sample_tokens: int, K: int = 6, H: int = 4096, L: int = 36) -> str:
    """`samples` samples of 1/2..3/2 x `sample_tokens` tokens, ids 2..L-2 spread and L (as --layers dflash)."""
    ids = [round(1 + (L - 4) * j / (K - 2)) + 1 for j in range(K - 1)] + [L]
    layout = make_layout(K, H)
    meta = StoreMetadata(layer_ids=ids, num_layers=L, hidden_size=H, chunk_tokens=layout.chunk_tokens,
                         shard_tokens=layout.shard_tokens, compressor="none",
                         model={"model": "synthetic (bench/reader_bench.py)", "path": "synthetic",
                                "weights_fingerprint": "synthetic", "architecture": "none", "dtype": "bfloat16"},
                         tokenizer={}, max_length=0, truncation="", config={"data": "synthetic", "split": ""},
                         versions={}, reject_reasons=list(REJECT_REASONS),
                         compat=Compat(model="synthetic", compute_dtype="bfloat16", layer_ids=ids, tokenization="",
                                       data="synthetic", split=""))
    root = prepare(str(path), meta, overwrite=True)
    writer = PartWriter(OwnedPart(str(path), "part-00000").open(open_for_run(str(path), meta, root), layout))
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(3 * sample_tokens // 2, K, H, generator=g).to(torch.bfloat16)
    rng = np.random.default_rng(0)
    for row in range(samples):
        n = int(rng.integers(sample_tokens // 2, 3 * sample_tokens // 2))
        input_ids = rng.integers(0, 150_000, n)
        writer.append(row, input_ids, (input_ids % 2).astype(np.uint8), pool[:n].view(torch.int16).numpy())
    writer.close()
    return str(path)


class Rows(torch.utils.data.Dataset):
    def __init__(self, transfer, order: np.ndarray):
        self.transfer, self.order = transfer, order

    def __len__(self) -> int:
        return int(self.order.size)

    def __getitem__(self, i: int) -> dict:
        return self.transfer.get_cached(int(self.order[i]))  # to the main process, as speculators' workers hand it


def drop_cache(folders: list[Path]) -> None:
    os.sync()
    for folder in folders:
        for f in folder.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def one_pass(transfer, order: np.ndarray, workers: int) -> tuple[float, int]:
    """Seconds for the rows after each worker's first, and their state bytes."""
    loader = torch.utils.data.DataLoader(Rows(transfer, order), batch_size=None, num_workers=workers,
                                         multiprocessing_context="spawn" if workers else None,
                                         persistent_workers=False)
    iterator = iter(loader)
    # untimed: each worker's first row (rows go round the workers), so that starting a worker (a fresh
    # interpreter importing its backend and opening the data) is not counted; an epoch keeps its workers
    for _ in range(max(1, workers)):
        next(iterator)
    nbytes, started = 0, time.perf_counter()
    for item in iterator:
        nbytes += state_bytes(item)
    return time.perf_counter() - started, nbytes


def state_bytes(item: dict) -> int:
    return item["hidden_states"].numel() * item["hidden_states"].element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="an existing store (default: a synthetic one in --scratch)")
    parser.add_argument("--scratch", required=True, help="folder for the synthetic store and the two converts")
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--sample-tokens", type=int, default=500)
    parser.add_argument("--workers", default="1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    scratch = Path(opts.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    store = opts.store or synthetic_store(scratch / "synthetic.zarr", opts.samples, opts.sample_tokens)
    files, nocopy = scratch / "files", scratch / "nocopy"
    for out, hidden_states in ((files, None), (nocopy, "store")):
        shutil.rmtree(out, ignore_errors=True)
        convert(store, str(out), seed=0, progress=False, log=lambda m: None, hidden_states=hidden_states,
                allow_random_weights=True)
    meta = json.loads((files / "streamx_meta.json").read_text())
    args = argparse.Namespace(hidden_states_path=None, streamx_store=None, target_layer_ids=meta["target_layer_ids"])
    transfers = {"file": HiddenStatesBackend.registry["file"].from_train_args(args, str(files)),
                 "streamx": HiddenStatesBackend.registry["streamx"].from_train_args(args, str(nocopy))}
    rows = meta["counts"]["rows"]
    order = np.random.default_rng(1).permutation(rows)  # a shuffled epoch, as a sampler draws it
    report = {"store": store, "rows": rows, "tokens": meta["counts"]["tokens"], "machine": {
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "python": sys.version},
        "passes": []}
    for workers in (int(w) for w in opts.workers.split(",")):
        for cache in ("cold", "warm"):
            if cache == "warm":  # one untimed pass of each first: what a cold pass dropped is cached again
                for transfer in transfers.values():
                    one_pass(transfer, order, workers)
            for r in range(opts.rounds):
                for name in (("file", "streamx") if r % 2 == 0 else ("streamx", "file")):
                    if cache == "cold":
                        drop_cache([Path(store), files])
                    seconds, nbytes = one_pass(transfers[name], order, workers)
                    timed = rows - max(1, workers)
                    report["passes"].append({"backend": name, "workers": workers, "cache": cache, "round": r,
                                             "seconds": seconds, "bytes": nbytes})
                    print(f"{workers} workers {cache} round {r + 1}/{opts.rounds} {name:<8} {timed / seconds:8.1f} "
                          f"samples/s {nbytes / seconds / 1e9:6.2f} GB/s", flush=True)
    summary = {}  # medians over the rounds (noise only slows a pass), and their ratio
    for workers in sorted({p["workers"] for p in report["passes"]}):
        for cache in ("cold", "warm"):
            rates = {}
            for name in ("file", "streamx"):
                ps = [p for p in report["passes"] if (p["backend"], p["workers"], p["cache"]) == (name, workers, cache)]
                timed = rows - max(1, workers)
                rates[name] = {"samples_per_s": statistics.median(timed / p["seconds"] for p in ps),
                               "gb_per_s": statistics.median(p["bytes"] / p["seconds"] / 1e9 for p in ps)}
            rates["streamx_vs_file"] = rates["streamx"]["samples_per_s"] / rates["file"]["samples_per_s"]
            summary[f"{workers} workers, {cache}"] = rates
    report["summary"] = summary
    print("\n| workers, page cache | file samples/s | file GB/s | streamx samples/s | streamx GB/s | streamx / file |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for key, r in summary.items():
        print(f"| {key} | {r['file']['samples_per_s']:,.1f} | {r['file']['gb_per_s']:.2f} | "
              f"{r['streamx']['samples_per_s']:,.1f} | {r['streamx']['gb_per_s']:.2f} | {r['streamx_vs_file']:.3f}x |")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
