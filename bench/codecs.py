"""Lossless codecs on real activations: the size and the writer's cost of each --compressor choice.

    python bench/codecs.py STORE [--storage bf16|fp8] [--rounds 3] [--json OUT]

Reads every sample of STORE (e.g. the embedded default's, made by `streamx run`) and writes the
samples again through the real writer (streamx.pipeline.writer.PartWriter), once per compressor, into a
temporary store in STORE's folder; rounds are interleaved so that machine drift hits every codec.
Each copy is read back and compared bit for bit. Reports the hidden states' bytes on disk, the ratio
to uncompressed, and the writer's rate in GB/s of uncompressed state bytes (best round; the page
cache absorbs the writes, so this is the writer's CPU cost, the quantity a codec changes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import time
from pathlib import Path
from typing import get_args

import torch

from streamx.config import Compressor
from streamx.pipeline.writer import PartWriter
from streamx.store import STORAGES, OwnedPart, make_layout, open_for_run, open_store, prepare

COMPRESSORS = get_args(Compressor)


def state_bytes(path: Path) -> int:
    part = path / "parts" / "part-00000"
    return sum(f.stat().st_size for name in ("hidden_states", "hidden_states_scales") if (part / name).exists()
               for f in (part / name).rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("--storage", choices=tuple(STORAGES), default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()

    source = open_store(opts.store)
    meta = source.metadata
    samples = []
    for s in source.samples():
        values, scales = STORAGES[opts.storage].encode(s.hidden_states)
        samples.append((s.row_id, s.input_ids.numpy(), s.loss_mask.numpy().astype("uint8"),
                        STORAGES[opts.storage].to_bits(values),
                        None if scales is None else scales.numpy()))
    raw = sum(s[3].nbytes + (0 if s[4] is None else s[4].nbytes) for s in samples)
    print(f"{len(samples):,} samples, {sum(len(s[1]) for s in samples):,} tokens, {raw / 1e9:.3f} GB of "
          f"{opts.storage} states from {opts.store}", flush=True)

    seconds = {c: [] for c in COMPRESSORS}
    sizes = {}
    scratch = Path(opts.store).resolve().parent
    for r in range(opts.rounds):
        order = COMPRESSORS[r % len(COMPRESSORS):] + COMPRESSORS[: r % len(COMPRESSORS)]
        for codec in order:
            out = scratch / f"codec-bench-{codec}.zarr"
            m = dataclasses.replace(meta, compressor=codec, storage=opts.storage,
                                    compat=dataclasses.replace(meta.compat, storage=opts.storage))
            prepare(str(out), m, overwrite=True)
            layout = make_layout(meta.num_slots, meta.hidden_size, meta.chunk_tokens, meta.shard_tokens, codec,
                                 opts.storage)
            writer = PartWriter(OwnedPart(str(out), "part-00000").open(open_for_run(str(out), m), layout))
            started = time.perf_counter()
            for row, ids, mask, bits, scales in samples:
                writer.append(row, ids, mask, bits, scales)
            writer.close()
            seconds[codec].append(time.perf_counter() - started)
            if r == 0:
                copy = open_store(str(out))
                for row, _, _, bits, scales in samples:
                    got = copy.sample(row, raw=True)
                    assert torch.equal(got.hidden_states.contiguous().view(torch.uint8).flatten(),
                                       torch.from_numpy(bits).view(torch.uint8).flatten()), f"{codec}: row {row}"
                    assert scales is None or torch.equal(got.hidden_states_scales, torch.from_numpy(scales))
                sizes[codec] = state_bytes(out)
            shutil.rmtree(out)
            print(f"round {r + 1}/{opts.rounds} {codec:<16} {raw / seconds[codec][-1] / 1e9:6.2f} GB/s", flush=True)

    base = min(seconds["none"])
    report = {"store": opts.store, "storage": opts.storage, "state_bytes": raw, "machine": platform.processor()
              or platform.machine(), "codecs": {}}
    print(f"\n| --compressor | states on disk | ratio | writer GB/s (best of {opts.rounds}) | writer time vs none |")
    print("| --- | --- | --- | --- | --- |")
    for codec in COMPRESSORS:
        best = min(seconds[codec])
        report["codecs"][codec] = {"bytes": sizes[codec], "ratio": sizes["none"] / sizes[codec],
                                   "writer_gb_per_s": raw / best / 1e9, "seconds": seconds[codec]}
        print(f"| {codec} | {sizes[codec] / 1e6:,.1f} MB | {sizes['none'] / sizes[codec]:.3f}x | "
              f"{raw / best / 1e9:.2f} | {best / base:.1f}x |")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
