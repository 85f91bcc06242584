"""Training reads: speculators' own data loader over the `streamx` backend (states read from the store)
against the same loader over its file backend (the copied hs files of the same store), in one process.

    # in speculators' environment with streamx installed (docs/speculators.md)
    python bench/reader_bench.py --scratch /ext4/folder --workers 0,1,4 --rounds 3 --json bench/results/reader.json
    python bench/reader_bench.py --store STORE --scratch /ext4/folder       # an existing store instead

A pass reads what speculators' training reads, built as `speculators.train` builds it
(`speculators.train.dataloader._setup_dataloader`): its `ArrowDataset` (a row's Arrow record and its
`get_cached`), its multipack batch sampler (`--total-seq-len` tokens a batch), its collate function and its
DataLoader settings (spawned, persistent workers, prefetch 4). So a worker reads the rows of a batch, packs
them and hands the packed batch to the main process, once a batch; `--workers 0` reads in the main
process. An untimed epoch starts the workers, then `--epochs` epochs are timed, each from its first
request. Rates are rows/s and tokens/s of hidden states delivered, the median over the rounds.

Without --store, a synthetic store is written first through the real writer (non-zero bf16 states, K=6,
H=4096 as Qwen3-8B with DFlash ids, ~`--sample-tokens` tokens a sample), then converted twice with one
seed: with hs files, and with `--hidden-states store`. Passes alternate between the two backends; in
`cold` passes each timed epoch first drops the page cache of every file either backend reads
(posix_fadvise DONTNEED, after a sync); in `warm` passes it reads what the untimed epoch cached.
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
from speculators.train.data import ArrowDataset
from speculators.train.dataloader import _setup_dataloader

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


def one_pass(transfer, data_path: Path, workers: int, epochs: int, total_seq_len: int, hidden_size: int,
             num_target_layers: int, before_epoch) -> tuple[float, int, int]:
    """Seconds for `epochs` epochs after an untimed one, and the rows and tokens they delivered."""
    dataset = ArrowDataset(max_len=total_seq_len, datapath=str(data_path), transfer=transfer, on_missing="raise")
    loader = _setup_dataloader(dataset, total_seq_len, hidden_size, num_workers=workers,
                               num_target_layers=num_target_layers)
    for _ in loader:  # untimed: starts the (persistent) workers, each a fresh interpreter opening its backend
        pass
    seconds, rows, tokens = 0.0, 0, 0
    for _ in range(epochs):
        before_epoch()
        started = time.perf_counter()
        for batch in loader:  # each epoch starts from the request: the workers prefetch nothing before it
            document = batch["document_ids"][batch["document_ids"] >= 0]
            rows += int(document.unique().numel())
            tokens += int(document.numel())
        seconds += time.perf_counter() - started
    del loader  # stops its workers before the next pass
    return seconds, rows, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="an existing store (default: a synthetic one in --scratch)")
    parser.add_argument("--scratch", required=True, help="folder for the synthetic store and the two converts")
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--sample-tokens", type=int, default=500)
    parser.add_argument("--workers", default="0,1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs a pass, after an untimed one")
    parser.add_argument("--total-seq-len", type=int, default=8192, help="tokens a packed batch (speculators' default)")
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
    report = {"store": store, "rows": meta["counts"]["rows"], "tokens": meta["counts"]["tokens"],
              "total_seq_len": opts.total_seq_len, "machine": {"cpu": platform.processor() or platform.machine(),
                                                               "cpu_count": os.cpu_count(), "python": sys.version},
              "passes": []}
    folders = {"file": files, "streamx": nocopy}

    def timed(name: str, workers: int, cache: str) -> tuple[float, int, int]:
        # cold: each timed epoch reads what the page cache dropped; warm: what the untimed epoch read is cached
        drop = (lambda: drop_cache([Path(store), files])) if cache == "cold" else (lambda: None)
        return one_pass(transfers[name], folders[name], workers, opts.epochs, opts.total_seq_len,
                        meta["hidden_size"], len(meta["target_layer_ids"]), drop)

    for workers in (int(w) for w in opts.workers.split(",")):
        for cache in ("cold", "warm"):
            for r in range(opts.rounds):
                for name in (("file", "streamx") if r % 2 == 0 else ("streamx", "file")):
                    seconds, rows, tokens = timed(name, workers, cache)
                    report["passes"].append({"backend": name, "workers": workers, "cache": cache, "round": r,
                                             "seconds": seconds, "rows": rows, "tokens": tokens})
                    print(f"{workers} workers {cache} round {r + 1}/{opts.rounds} {name:<8} {rows / seconds:8.1f} "
                          f"rows/s {tokens / seconds:10,.0f} tokens/s", flush=True)
    summary = {}  # medians over the rounds (noise only slows a pass), and their ratio
    for workers in sorted({p["workers"] for p in report["passes"]}):
        for cache in ("cold", "warm"):
            rates = {}
            for name in ("file", "streamx"):
                ps = [p for p in report["passes"] if (p["backend"], p["workers"], p["cache"]) == (name, workers, cache)]
                rates[name] = {"rows_per_s": statistics.median(p["rows"] / p["seconds"] for p in ps),
                               "tokens_per_s": statistics.median(p["tokens"] / p["seconds"] for p in ps)}
            rates["streamx_vs_file"] = rates["streamx"]["tokens_per_s"] / rates["file"]["tokens_per_s"]
            summary[f"{workers} workers, {cache}"] = rates
    report["summary"] = summary
    print("\n| workers, page cache | file rows/s | file tokens/s | streamx rows/s | streamx tokens/s "
          "| streamx / file |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for key, r in summary.items():
        print(f"| {key} | {r['file']['rows_per_s']:,.1f} | {r['file']['tokens_per_s']:,.0f} | "
              f"{r['streamx']['rows_per_s']:,.1f} | {r['streamx']['tokens_per_s']:,.0f} | "
              f"{r['streamx_vs_file']:.3f}x |")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
