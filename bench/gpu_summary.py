"""The rows bench/RESULTS.md records, from the JSON files bench/gpu_check.sh wrote.

    python bench/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def model_rows(out: Path) -> list[str]:
    rows = ["| model (bytes/token stored) | forward_only tok/s | streamx tok/s | streamx / forward_only | "
            "per round streamx / forward_only | forward_only TFLOP/s (of peak) | busy s: write / forward | "
            "ceilings: write GB/s, D2H GB/s | bottleneck | naive tok/s | packing; forward packed / padded (pad eff "
            "padded) |",
            "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: | --- |"]
    for f in sorted(out.glob("qwen*.json")):
        r = json.loads(f.read_text())
        s, fo, m = r["streamx"], r["forward_only"], r["model"]
        per_round = " ".join(f"{a / b:.2f}" for a, b in zip(s["rounds_tokens_per_s"], fo["rounds_tokens_per_s"],
                                                                     strict=True))
        busy = s["stage_seconds"]
        naive = f"{r['naive']['tokens_per_s']:,.0f}" if "naive" in r else "-"
        packing = r["workload"].get("packing", "off")
        if "packed_vs_padded_forward" in r["ratios"]:
            packing += (f"; {r['ratios']['packed_vs_padded_forward']:.3f}x "
                        f"({r['forward_padded']['padding_efficiency']:.1%})")
        storage = r["config"].get("storage", "bf16")
        bytes_per_token = len(r["workload"]["layer_ids"]) * m["hidden_size"] * (1 if storage == "fp8" else 2)
        c = r["ceilings"]
        share = f" ({fo['fraction_of_matmul_peak']:.0%} of {c['bf16_matmul_peak_tflops']:.0f})" \
            if fo["fraction_of_matmul_peak"] else ""
        d2h = f"{c['host_copy_gb_per_s']:.1f}" if c["host_copy_gb_per_s"] else "-"
        rows.append(f"| {f.stem}: {m['architecture']}, {m['num_layers']} layers, H {m['hidden_size']} "
                    f"({bytes_per_token / 1e3:.0f} KB {storage}), {r['workload']['samples']} rows, "
                    f"pad eff {s['padding_efficiency']:.1%} | {fo['tokens_per_s']:,.0f} | {s['tokens_per_s']:,.0f} | "
                    f"{r['ratios']['streamx_vs_forward_only']:.3f}x | {per_round} | "
                    f"{fo['model_tflops_per_s']:.0f}{share} | "
                    f"{busy.get('write', 0):.1f} / {busy.get('forward', 0):.1f} | "
                    f"{c['write_gb_per_s']:.2f}, {d2h} | {s['bottleneck']} | {naive} | {packing} |")
    return rows


def sharing_rows(out: Path) -> list[str]:
    """Sharing on (streamx) against off (streamx_unshared) in one process, where a bench ran both."""
    rows = ["| run | rows | row tokens | computed tokens (share) | streamx tok/s | unshared tok/s | on / off | "
            "bytes stored on / off | forward_only tok/s (its batches: the computed tokens) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for f in sorted(out.glob("qwen*.json")):
        r = json.loads(f.read_text())
        if "streamx_unshared" not in r:
            continue
        w, ratios = r["workload"], r["ratios"]
        forward = f"{r['forward_only']['tokens_per_s']:,.0f}" if "forward_only" in r else "-"
        rows.append(f"| {f.stem} | {w['samples']:,} | {w['tokens']:,} | {w['computed_tokens']:,} "
                    f"({w['computed_tokens'] / w['tokens']:.1%}) | {r['streamx']['tokens_per_s']:,.0f} | "
                    f"{r['streamx_unshared']['tokens_per_s']:,.0f} | {ratios['streamx_vs_streamx_unshared']:.2f}x | "
                    f"{ratios['bytes_shared_vs_unshared']:.3f} | {forward} |")
    return rows if len(rows) > 2 else []


def writer_rows(out: Path) -> list[str]:
    rows = ["| filesystem | processes | plain GB/s | writer GB/s | writer / plain | best passes |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for f in sorted(out.glob("writer_*.json")):
        r = json.loads(f.read_text())
        for p, m in r["processes"].items():
            rows.append(f"| {f.stem.removeprefix('writer_')} ({r['directory']}) | {p} | "
                        f"{m['plain']['bytes_per_s'] / 1e9:.2f} | {m['writer']['bytes_per_s'] / 1e9:.2f} | "
                        f"{m['ratio']:.3f} | {m['best_ratio']:.3f} |")
    return rows if len(rows) > 2 else []


def kernel_rows(out: Path) -> list[str]:
    f = out / "kernel.json"
    if not f.exists():
        return []
    rows = ["| dtype | tokens | method | GB/s | % of copy |", "| --- | ---: | --- | ---: | ---: |"]
    for r in json.loads(f.read_text())["rows"]:
        if r["table"] == "gather":
            rows.append(f"| {r['dtype']} | {r['tokens']} | {r['method']} | {r['gb_per_s']:.0f} | "
                        f"{r['pct_of_copy']:.0f}% |")
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    for section in (model_rows(out), sharing_rows(out), writer_rows(out), kernel_rows(out)):
        if section:
            print("\n".join(section) + "\n")


if __name__ == "__main__":
    main()
