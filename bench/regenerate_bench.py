"""`streamx regenerate` against a real OpenAI-compatible server: rows/s and generated tokens/s with 1..64
requests in flight, and the client's own cost against a plain `openai` client loop doing the same work.

The server is `transformers serve` (transformers' `serving` extra) of --model on localhost, started and
stopped here. The rows are the first --rows conversations of --data; every assistant turn is generated again
with the model's own history, greedy, at most --max-tokens each. Modes, interleaved round by round so that
drift hits all of them:

    streamx@C   streamx.regen.runner.regenerate(..., endpoint=[server], concurrency=C), in this process
    openai@C    the same turns through openai.OpenAI().chat.completions.create, C threads (a plain loop at C=1)

Per mode: wall seconds, rows/s, generated tokens/s (the server's usage counts) and the client's CPU seconds
per row (this process's CPU time: the server is another process), best round of --rounds.

    python bench/regenerate_bench.py --json bench/results/regenerate-cpu.json
    python bench/regenerate_bench.py --concurrency 1,8 --server-arg=--continuous-batching
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from streamx.config import RegenerateConfig  # noqa: E402
from streamx.data.source import open_source  # noqa: E402
from streamx.model.load import EMBEDDED_MODEL, resolve_model_path  # noqa: E402
from streamx.regen import regenerate  # noqa: E402
from streamx.regen.conversation import plan_turns  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=EMBEDDED_MODEL)
parser.add_argument("--data", default="chatterbot:english")
parser.add_argument("--rows", type=int, default=24)
parser.add_argument("--max-tokens", type=int, default=24)
parser.add_argument("--concurrency", default="1,4,16,64", help="requests in flight, e.g. 1,2,4,8,16,32,64")
parser.add_argument("--openai-concurrency", default="1,16", help="the plain openai loop's thread counts")
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--server-arg", action="append", default=[], help="an extra `transformers serve` flag")
parser.add_argument("--json", type=Path, default=None)
args = parser.parse_args()


def start_server(model_dir: str, log: Path) -> tuple[subprocess.Popen, str]:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    proc = subprocess.Popen([exe, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             *args.server_arg], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"transformers serve exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"transformers serve did not start; see {log}")


def streamx_mode(data: Path, url: str, concurrency: int, scratch: Path) -> dict:
    out = scratch / f"streamx-{concurrency}.jsonl"
    cfg = RegenerateConfig(data=str(data), out=str(out), overwrite=True, endpoint=[url], concurrency=concurrency,
                           max_tokens=args.max_tokens, temperature=0.0)
    cpu, wall = time.process_time(), time.perf_counter()
    summary = regenerate(cfg, progress=False, log=lambda m: None, wind_up_on_signals=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert summary.rows == args.rows and not summary.errors, summary.lines()
    return {"seconds": wall, "client_cpu_s": cpu, "rows": summary.rows, "turns": summary.turns,
            "generated_tokens": summary.completion_tokens}


def openai_mode(records: list[dict], url: str, model: str, concurrency: int) -> dict:
    import openai
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=5, timeout=600)

    def one(record: dict) -> tuple[int, int]:
        items, _ = plan_turns(record)
        history, turns, tokens = [], 0, 0
        for item in items:
            if item is not None:
                history.append(item)
                continue
            reply = client.chat.completions.create(model=model, messages=history, max_tokens=args.max_tokens,
                                                   temperature=0.0, seed=0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            turns, tokens = turns + 1, tokens + reply.usage.completion_tokens
        return turns, tokens

    cpu, wall = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, records))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"seconds": wall, "client_cpu_s": cpu, "rows": len(done), "turns": sum(t for t, _ in done),
            "generated_tokens": sum(n for _, n in done)}


def main() -> None:
    model_dir = resolve_model_path(args.model)
    scratch = Path(tempfile.mkdtemp(prefix="streamx-regen-bench-"))
    records = [row.record for row in open_source(args.data, max_samples=args.rows)]
    data = scratch / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    server, url = start_server(model_dir, scratch / "serve.log")
    modes = {f"streamx@{c}": (lambda c=c: streamx_mode(data, url, c, scratch)) for c in
             map(int, args.concurrency.split(","))}
    modes |= {f"openai@{c}": (lambda c=c: openai_mode(records, url, model_dir, c)) for c in
              map(int, args.openai_concurrency.split(","))}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        streamx_mode(data, url, 1, scratch)  # warm-up: the server's first request loads and compiles
        for r in range(args.rounds):
            for name, measure in modes.items():
                runs[name].append(measure())
                print(f"round {r + 1} {name}: {runs[name][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    finally:
        server.kill()
        server.wait(30)
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": platform.platform(),
              "cpus": os.cpu_count(), "model": args.model, "rows": args.rows, "max_tokens": args.max_tokens,
              "server": "transformers serve " + " ".join(args.server_arg), "runs": runs,
              "best": {m: min(rs, key=lambda x: x["seconds"]) for m, rs in runs.items()}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    base = report["best"].get("openai@1")
    print("| mode | rows/s | generated tok/s | client CPU ms/row | wall vs openai@1 |\n|---|---|---|---|---|")
    for name, b in report["best"].items():
        ratio = f"{b['seconds'] / base['seconds']:.2f}" if base else "-"
        print(f"| {name} | {b['rows'] / b['seconds']:.2f} | {b['generated_tokens'] / b['seconds']:.1f} | "
              f"{1000 * b['client_cpu_s'] / b['rows']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
