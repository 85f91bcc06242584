"""Sweep token budget, number of captured layers and sequence lengths; write JSON and PNG plots.

Plots need matplotlib (`pip install -e '.[bench]'`). Each point is one `streamx.measure.bench.bench` call (streamx and
forward_only interleaved in one
process), so every figure is a ratio measured under the same machine conditions.

    python bench/sweep.py --data chatterbot:english --max-samples 200 --out bench/results/sweep
"""

import argparse
import json
from pathlib import Path

from streamx.config import load_config
from streamx.measure.bench import bench

BUDGETS = (512, 1024, 2048, 4096, 8192)
LAYER_SETS = ("30", "2,15,27,30", "2,6,10,14,18,22,26,30", ",".join(str(i) for i in range(0, 31, 2)))


def point(args, **overrides) -> dict:
    cfg = load_config(args.config, model=args.model, data=args.data, max_samples=args.max_samples, **overrides)
    report = bench(cfg, rounds=args.rounds, progress=False, modes=("forward_only", "streamx"))
    s, f = report["streamx"], report["forward_only"]
    row = {**overrides, "streamx_tokens_per_s": s["tokens_per_s"], "forward_only_tokens_per_s": f["tokens_per_s"],
           "ratio": report["ratios"]["streamx_vs_forward_only"], "padding_efficiency": s["padding_efficiency"],
           "stage_seconds": s["stage_seconds"], "bottleneck": s["bottleneck"]}
    print(json.dumps(row))
    return row


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    budgets = results["token_budget"]
    x = [r["token_budget"] for r in budgets]
    a.plot(x, [r["streamx_tokens_per_s"] for r in budgets], "o-", label="streamx")
    a.plot(x, [r["forward_only_tokens_per_s"] for r in budgets], "s--", label="forward_only")
    a.set(xscale="log", xlabel="token budget", ylabel="real tokens/s", title="throughput vs token budget")
    a.legend()
    b.plot(x, [r["padding_efficiency"] for r in budgets], "o-")
    b.set(xscale="log", xlabel="token budget", ylabel="real / computed tokens", title="padding efficiency")
    stages = ["source_tokenize", "batching", "forward", "gather", "d2h", "write"]
    labels = [f"{len(r['layers'].split(','))} ids" for r in results["layers"]]
    bottom = [0.0] * len(labels)
    for stage in stages:
        values = [r["stage_seconds"].get(stage, 0.0) for r in results["layers"]]
        c.bar(labels, values, bottom=bottom, label=stage)
        bottom = [p + v for p, v in zip(bottom, values, strict=True)]
    c.set(ylabel="busy seconds per round", title="streamx stage time vs captured layers")
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--long-data", default=None, help="a second, long-chat dataset (bench/long_chats.py)")
    parser.add_argument("--max-samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="bench/results/sweep")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNG from an existing --out JSON")
    args = parser.parse_args()
    out = Path(args.out)
    if args.replot:
        plot(json.loads(out.with_suffix(".json").read_text()), out)
        return
    results = {"token_budget": [point(args, token_budget=b, max_length=min(b, 2048)) for b in BUDGETS],
               "layers": [point(args, layers=ids, any_layers=True) for ids in LAYER_SETS]}  # "30": no aux ids
    if args.long_data:
        results["long"] = [point(argparse.Namespace(**{**vars(args), "data": args.long_data}), token_budget=4096)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
