"""How per-sample costs scale with the number of committed samples (10k, 100k, 1M by default).

For each size N: N pre-tokenized rows (8-24 tokens, input_ids + loss_mask, no chat template) through a tiny
random-weight Llama (4 layers, hidden 32, the embedded SmolLM2 tokenizer; saved with save_pretrained, so the
store is a real-weights store as far as streamx knows), layers 2,4: 128 B/token, ~2 GB at 1M samples. Each
command runs as its own process (`python -m streamx ...`), timed by GNU time (peak RSS, CPU):

    run                       a fresh store (s/sample)
    resume                    the same command again on the complete store (nothing left to do)
    inspect, verify --no-model, plan (the run's settings), convert --hidden-states store (no copy), and
    convert with hs files (one file per sample) up to --hs-files-max samples

    python bench/scale.py --scratch /tmp/streamx-scale            # all sizes; deletes the scratch dir at the end
    python bench/scale.py --scratch /tmp/s --sizes 10000 --keep   # one size, keep the stores

    python bench/scale.py --scratch /tmp/s --rows fanned  # fanned-out chats: every kind of sharing, at scale

--rows fanned writes chats as speculators' regenerate fans them out (one row per assistant turn, each row the
whole history before it, loss on its last reply) behind one of 8 system prompts, a tenth of the chats repeated:
prefix rows, duplicates and shared leading runs at a million rows; it also times `convert --merge-prefix-rows`.

Results: --json (rewritten after every command) and a markdown table at the end. The tokenizer comes from
--tokenizer, else the embedded model's converted folder (streamx.model.load.resolve_model_path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--scratch", type=Path, required=True, help="scratch folder (data, model, stores)")
parser.add_argument("--sizes", default="10000,100000,1000000")
parser.add_argument("--json", type=Path, default=None, help="default: bench/results/scale-cpu[-fanned].json")
parser.add_argument("--hs-files-max", type=int, default=1_000_000, help="largest N converted with hs files")
parser.add_argument("--chunk-tokens", type=int, default=2048)
parser.add_argument("--shard-tokens", type=int, default=8192, help="small shards: many commits, as long rows give")
parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)")
parser.add_argument("--src", type=Path, default=REPO, help="folder holding the streamx package to measure, e.g. "
                    "`git archive HEAD | tar -x -C DIR` while the checkout is being edited (default: this checkout)")
parser.add_argument("--rows", choices=["random", "fanned"], default="random",
                    help="random: 8-24 random tokens a row (nothing shared); fanned: fanned-out chats (see above)")
parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
args = parser.parse_args()
sizes = [int(s) for s in args.sizes.split(",")]
args.json = args.json or REPO / f"bench/results/scale-cpu{'-fanned' if args.rows == 'fanned' else ''}.json"
max_length = 64 if args.rows == "random" else 256
sys.path.insert(0, str(args.src.resolve()))  # the measured streamx, here and (PYTHONPATH below) in the commands
args.scratch.mkdir(parents=True, exist_ok=True)
# OMP_NUM_THREADS=1: this tiny model's ops are too small for OpenMP; with 2 threads on 2 cores its forward runs
# 4-7x slower inside the pipeline (measured: 1.8 s against 7.6-12.6 s of forward for 10k rows), which would hide
# the per-sample costs this script is after
env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(args.src.resolve()), os.environ.get("PYTHONPATH", "")])}

# -- a tiny random-weight model with a real tokenizer
model_dir = args.scratch / "tiny-llama"
if not (model_dir / "config.json").exists():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from streamx.model.load import EMBEDDED_MODEL, resolve_model_path

    tok = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model_path(EMBEDDED_MODEL))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]


def write_rows(path: Path, n: int) -> None:
    """n pre-tokenized rows of 8-24 tokens, the first third of each masked out."""
    rng = np.random.default_rng(n)
    lengths = rng.integers(8, 25, n)
    ids = rng.integers(3, vocab, int(lengths.sum())).tolist()
    with open(path, "w") as f:
        start = 0
        for T in lengths.tolist():
            mask = [0] * (T // 3) + [1] * (T - T // 3)
            f.write(json.dumps({"input_ids": ids[start:start + T], "loss_mask": mask}, separators=(",", ":")) + "\n")
            start += T


def write_fanned_rows(path: Path, n: int) -> None:
    """n rows of fanned-out chats: each chat of 1-8 turns (a user message and a reply of 3-8 tokens each) behind
    one of 8 system prompts of 24 tokens gives one row per reply, the whole history before it included, the loss
    on that reply alone; a tenth of the chats repeat an earlier chat whole (exact duplicates)."""
    rng = np.random.default_rng(n)
    prompts = rng.integers(3, vocab, (8, 24)).tolist()
    chats: list[list[list[int]]] = []  # a chat: its turns, each a user message then a reply, as [user, reply]
    written = 0
    with open(path, "w") as f:
        while written < n:
            if chats and rng.random() < 0.1:
                prompt, turns = chats[int(rng.integers(len(chats)))]
            else:
                prompt = prompts[int(rng.integers(8))]
                turns = [[rng.integers(3, vocab, int(rng.integers(3, 9))).tolist() for _ in range(2)]
                         for _ in range(int(rng.integers(1, 9)))]
                chats.append((prompt, turns))
            ids = list(prompt)
            for user, reply in turns[:n - written]:
                ids += user
                mask = [0] * len(ids) + [1] * len(reply)
                ids += reply
                f.write(json.dumps({"input_ids": ids, "loss_mask": mask}, separators=(",", ":")) + "\n")
                written += 1


MARKS = {"planned": "  packing ", "resuming": "resuming "}  # run's log lines: plan made, committed rows read


TIME = shutil.which("time")  # GNU time: wait4 on our own child would report this (large) process's RSS at fork


def measure(argv: list[str]) -> dict:
    """Run `python -m streamx ARGV`: wall seconds, peak RSS (MB) and CPU seconds (GNU time's, of the command
    alone), and the seconds until each of the MARKS lines first appeared on stderr (where start-up steps end)."""
    if TIME is None:
        sys.exit("needs GNU time (apt-get install time): a child's ru_maxrss from wait4 starts at the parent's RSS")
    usage = args.scratch / "time.txt"
    started = time.perf_counter()
    proc = subprocess.Popen([TIME, "-f", "%M %U %S", "-o", str(usage), sys.executable, "-m", "streamx", *argv],
                            env=env, cwd=args.scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    out: list[str] = []
    readers = [threading.Thread(target=lambda: out.extend(proc.stdout)),
               threading.Thread(target=lambda: lines.extend((time.perf_counter() - started, s) for s in proc.stderr))]
    for t in readers:
        t.start()
    proc.wait()
    seconds = time.perf_counter() - started
    for t in readers:
        t.join()
    if proc.returncode:
        sys.exit(f"streamx {' '.join(argv)} failed ({proc.returncode}):\n{''.join(s for _, s in lines)[-3000:]}")
    rss_kb, user, system = usage.read_text().split()[-3:]
    command = "streamx " + " ".join(argv).replace(str(args.scratch), "$SCRATCH")
    result = {"seconds": round(seconds, 3), "peak_rss_mb": round(int(rss_kb) / 1024, 1),
              "cpu_s": round(float(user) + float(system), 2), "command": command}
    for key, text in MARKS.items():
        if any(text in s for _, s in lines):
            result[f"seconds_to_{key}"] = next(round(t, 3) for t, s in lines if text in s)
    return result


# the settings without this machine's paths (scratch, json, src)
settings = {k: v for k, v in vars(args).items() if k not in ("scratch", "json", "src")}
results: dict = {"machine": {"cpus": os.cpu_count(), "gpu": None}, "settings": settings, "sizes": {}}
if args.json.exists():
    results["sizes"] = json.loads(args.json.read_text()).get("sizes", {})
results["settings"] = {k: str(v) for k, v in results["settings"].items()}

for n in sizes:
    data, out = args.scratch / f"rows-{n}.jsonl", args.scratch / f"s{n}.zarr"
    if not data.exists():
        (write_rows if args.rows == "random" else write_fanned_rows)(data, n)
    converted = [args.scratch / f"conv-{kind}-{n}" for kind in ("store", "files", "merged")]
    for old in (out, *converted):
        shutil.rmtree(old, ignore_errors=True)
    run_flags = ["--model", str(model_dir), "--data", str(data), "--out", str(out), "--layers", "2,4",
                 "--max-length", str(max_length), "--token-budget", "4096", "--chunk-tokens", str(args.chunk_tokens),
                 "--shard-tokens", str(args.shard_tokens), "--device", "cpu"]
    row: dict = {"samples": n}
    results["sizes"][str(n)] = row
    steps = [("run", ["run", *run_flags, "--no-progress"]),
             ("resume", ["run", *run_flags, "--no-progress"]),
             ("inspect", ["inspect", str(out)]),
             ("verify", ["verify", str(out), "--no-model"]),
             ("plan", ["plan", *run_flags]),
             ("convert_store", ["convert", str(out), "--out", str(args.scratch / f"conv-store-{n}"),
                                "--hidden-states", "store", "--no-progress"])]
    if args.rows == "fanned":
        steps.append(("convert_merged", ["convert", str(out), "--out", str(args.scratch / f"conv-merged-{n}"),
                                         "--hidden-states", "store", "--merge-prefix-rows", "--no-progress"]))
    if n <= args.hs_files_max:
        steps.append(("convert_files", ["convert", str(out), "--out", str(args.scratch / f"conv-files-{n}"),
                                        "--no-progress"]))
    for name, argv in steps:
        row[name] = measure(argv)
        row[name]["us_per_sample"] = round(row[name]["seconds"] / n * 1e6, 2)
        print(f"N={n:,} {name}: {row[name]['seconds']:.2f} s, {row[name]['peak_rss_mb']:.0f} MB", flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        if name == "run":
            row["store_mb"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    for old in converted:
        shutil.rmtree(old, ignore_errors=True)

# per sample: the whole command / N, and the marginal cost between consecutive sizes (fixed start-up cancels)
names = ["run", "resume", "inspect", "verify", "plan", "convert_store", "convert_merged", "convert_files"]
rows = [row for _, row in sorted(results["sizes"].items(), key=lambda kv: int(kv[0]))]
print("\n| samples | " + " | ".join(f"{s} µs/sample" for s in names) + " | run start-up s | resume start-up s |")
print("|" + " ---: |" * (len(names) + 3))
for row in rows:
    cells = [f"{row[s]['us_per_sample']:.1f}" if s in row else "-" for s in names]
    print(f"| {row['samples']:,} | " + " | ".join(cells) + f" | {row['run'].get('seconds_to_planned')} | "
          f"{row['resume'].get('seconds_to_resuming')} |")
print("\n| samples | " + " | ".join(f"{s} wall / CPU s" for s in names) + " | store MB |")
print("|" + " ---: |" * (len(names) + 2))
for row in rows:
    cells = [f"{row[s]['seconds']:.2f} / {row[s]['cpu_s']:.2f}" if s in row else "-" for s in names]
    print(f"| {row['samples']:,} | " + " | ".join(cells)
          + f" | {row['store_mb']:,.0f} |")
print("\n| samples | " + " | ".join(f"{s} peak RSS MB" for s in names) + " |")
print("|" + " ---: |" * (len(names) + 1))
for row in rows:
    print(f"| {row['samples']:,} | " + " | ".join(f"{row[s]['peak_rss_mb']:.0f}" if s in row else "-" for s in names)
          + " |")
print("\n| from -> to | " + " | ".join(f"{s} marginal wall / CPU µs/sample" for s in names) + " |")
print("|" + " ---: |" * (len(names) + 1))
for a, b in zip(rows, rows[1:], strict=False):
    dn = (b["samples"] - a["samples"]) / 1e6
    cells = [f"{(b[s]['seconds'] - a[s]['seconds']) / dn:.1f} / {(b[s]['cpu_s'] - a[s]['cpu_s']) / dn:.1f}"
             if s in a and s in b else "-" for s in names]
    print(f"| {a['samples']:,} -> {b['samples']:,} | " + " | ".join(cells) + " |")
if not args.keep:
    shutil.rmtree(args.scratch, ignore_errors=True)
