"""Tensor parallel: `streamx run --tp N` under torchrun against one process, on the same model, rows and cores, in
turn (one, TP N, one, TP N, ...), so that a drift of the machine's speed falls on both; with `--moe`, a third arm
`--tp N --ep` (experts spread whole over the group) against TP alone (transformers 5.25 leaves a MoE's experts
whole on every process under TP alone: each computes them all).

The model is a random-weight Qwen3 of `--hidden` (8 heads, 4 key-value heads, 8 layers; saved once, so that every
arm loads the same weights from a folder), or with `--moe` a Qwen3-MoE of the same attention and 8 experts of
intermediate size hidden/2, 2 per token; the rows the embedded default's chats. One process runs on every core
(torch's threads); TP 2 runs two processes of one thread each (torchrun's OMP_NUM_THREADS=1), the same cores.
Each arm reports the forward stage's busy seconds and the tokens it computed (the run's summary, as JSON): the
ratio of forward tokens/s is what tensor parallel costs or gains per token on these cores, collectives included
(gloo all-reduces after each row-parallel layer); whole-run seconds include loading and torchrun's start.

    python bench/tp.py                       # 300 rows, hidden 1024, 3 rounds, TP 2, float32
    python bench/tp.py --rows 200 --hidden 1024 --rounds 3 --json bench/results/tp.json
    python bench/tp.py --moe --rows 200 --hidden 1024 --rounds 3 --json bench/results/tp-moe.json
    python bench/tp.py --tp 8 --hidden 8192 --dtype bfloat16   # on 8 GPUs (bench/gpu_check.sh PART=tp)

Run alone on the machine. On CUDA the one-process arm takes one GPU and TP N takes N (NCCL); the ratio is then
what N GPUs give over one.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = "--worker"


def worker(settings: dict) -> None:
    """One arm, in this process (under torchrun with --tp): run, then print the first process's figures."""
    from streamx.config import load_config
    from streamx.pipeline.runner import run

    summary = run(load_config(None, **settings), progress=False, log=lambda message: None)
    if summary.rank == 0 and summary.tp_rank == 0:
        print(json.dumps({"seconds": summary.seconds, "forward_seconds": summary.stage_seconds.get("forward", 0.0)
                          + summary.stage_seconds.get("gather", 0.0), "tokens": summary.real_tokens}))


def make_model(folder: Path, hidden: int, dtype: str, moe: bool) -> str:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from streamx.model.load import resolve_model_path

    torch.manual_seed(0)
    shape = dict(vocab_size=49152, hidden_size=hidden, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=hidden // 8, max_position_embeddings=4096, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, moe_intermediate_size=hidden // 2, num_experts=8,
                                               num_experts_per_tok=2, intermediate_size=3 * hidden)) if moe else \
        Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=3 * hidden))
    model.to(getattr(torch, dtype)).save_pretrained(folder)  # (saved as it will be computed)
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(folder)
    return str(folder)


def arm(settings: dict, tp: int, ep: bool) -> dict:
    """One run of an arm, in processes of its own."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)] \
        if tp > 1 else [sys.executable]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None) if tp == 1 else env.update(OMP_NUM_THREADS="1")
    done = subprocess.run([*launcher, __file__, WORKER, json.dumps({**settings, "tp": tp, "ep": ep})], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE, and a third arm: --tp N --ep")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.hidden, args.dtype, args.moe)
        arms = {"one": (1, False), "tp": (args.tp, False), **({"ep": (args.tp, True)} if args.moe else {})}
        figures: dict[str, list[dict]] = {name: [] for name in arms}
        for k in range(args.rounds + 1):  # round 0 warms the page cache and torch's first imports: not counted
            for name, (tp, ep) in arms.items():
                settings = dict(model=model, data="chatterbot:english", max_samples=args.rows, layers="eagle3",
                                dtype=args.dtype, out=str(Path(tmp) / f"{name}-{k}.zarr"), space_check=False)
                result = arm(settings, tp, ep)
                if k:
                    figures[name].append(result)
    rate = {name: [r["tokens"] / r["forward_seconds"] for r in runs] for name, runs in figures.items()}
    print(f"rows {args.rows}, hidden {args.hidden}, {'MoE, ' if args.moe else ''}{args.dtype}, {args.rounds} rounds; "
          f"{os.cpu_count()} cores")
    for name in figures:
        print(f"  {name:<4} forward {statistics.median(rate[name]):,.0f} tokens/s (median), whole run "
              f"{statistics.median(r['seconds'] for r in figures[name]):.1f} s")
    ratios = {}
    for a, b, what in (("one", "tp", f"TP {args.tp} / one process"), ("one", "ep", f"TP {args.tp} --ep / one process"),
                       ("tp", "ep", f"TP {args.tp} --ep / TP {args.tp} alone")):
        if b in figures:
            pairs = [y / x for x, y in zip(rate[a], rate[b], strict=True)]
            wall = [y["seconds"] / x["seconds"] for x, y in zip(figures[a], figures[b], strict=True)]
            ratios[f"{b}/{a}"] = {"forward": pairs, "wall": wall}
            print(f"  {what}: forward tokens/s {statistics.median(pairs):.3f}x (pairs "
                  f"{', '.join(f'{r:.3f}' for r in pairs)}); whole-run seconds {statistics.median(wall):.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": figures, "ratios": ratios}, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == WORKER:
        worker(json.loads(sys.argv[2]))
    else:
        main()
