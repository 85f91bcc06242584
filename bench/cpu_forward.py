"""What slows a CPU forward pass beside streamx's threads, measured: glibc's malloc thresholds
(activations page-faulted in anew) and an OpenMP team in a second thread (libgomp's spin-waits).

    python bench/cpu_forward.py --data spread30.jsonl --pairs 4 --json bench/results/cpu_forward.json

malloc: each pair runs the same batches through the model's forward in two fresh processes, one
with glibc's own adaptive thresholds and one with streamx's (models.keep_freed_host_memory), back
to back in alternating order (mallopt cannot be undone inside a process, so this comparison spans
two). OpenMP: in one process (thresholds kept), forward passes alternate with and without a thread
that holds an OpenMP team, as a producer thread does once it has run a multi-threaded torch op
(what batching.py avoids). Reports seconds, minor page faults and the main thread's voluntary
context switches per pass.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

from streamx.config import load_config
from streamx.data.batching import Batch
from streamx.measure.bench import forward_only, warm_up
from streamx.model import load as models
from streamx.pipeline.plan import make_plan


def load_batches(args, kept: bool):
    if not kept:  # glibc's own thresholds: load_model would fix them
        models.keep_freed_host_memory = lambda: False
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, data=args.data, model=args.model, max_samples=args.max_samples,
                             out=f"{tmp}/s.zarr", space_check=False)
        plan = make_plan(config, log=lambda message: None)
    batches = [b for b in plan.batch_stream() if isinstance(b, Batch)]
    warm_up(plan.model, batches, plan.device)
    return plan, batches


def voluntary_switches() -> int:
    with open(f"/proc/self/task/{threading.main_thread().native_id}/status") as f:
        return int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])


def timed_pass(plan, batches) -> dict[str, float]:
    faults, switches, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, voluntary_switches(), time.perf_counter()
    forward_only(plan.model, batches, plan.device)
    return {"seconds": time.perf_counter() - t0, "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            - faults, "voluntary_switches": voluntary_switches() - switches}


def child(args) -> None:
    """One process: --passes forward passes over the data, as JSON on the last line."""
    plan, batches = load_batches(args, kept=args.child == "kept")
    print(json.dumps([timed_pass(plan, batches) for _ in range(args.passes)]))


def malloc_pairs(args) -> dict:
    runs: dict[str, list[dict]] = {"default": [], "kept": []}
    for pair in range(args.pairs):
        for arm in (("default", "kept") if pair % 2 == 0 else ("kept", "default")):
            command = [sys.executable, __file__, "--child", arm, "--data", args.data, "--model", args.model,
                       "--passes", str(args.passes)]
            if args.max_samples:
                command += ["--max-samples", str(args.max_samples)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[arm] += json.loads(out.strip().splitlines()[-1])
            print(f"malloc pair {pair + 1}/{args.pairs} {arm:<8} {runs[arm][-1]}", flush=True)
    return runs


def openmp_pairs(args) -> dict:
    plan, batches = load_batches(args, kept=True)
    runs: dict[str, list[dict]] = {"one_team": [], "second_team": []}
    for pair in range(args.pairs * args.passes):
        for arm in (("one_team", "second_team") if pair % 2 == 0 else ("second_team", "one_team")):
            release = threading.Event()
            holder = threading.Thread(target=hold_team, args=(release,))
            if arm == "second_team":
                holder.start()
                time.sleep(0.2)
            runs[arm].append(timed_pass(plan, batches))
            release.set()
            if arm == "second_team":
                holder.join()
            print(f"openmp pair {pair + 1}/{args.pairs * args.passes} {arm:<11} {runs[arm][-1]}", flush=True)
    return runs


def hold_team(release: threading.Event) -> None:
    torch.repeat_interleave(torch.arange(16), torch.full((16,), 4096))  # a parallel op: this thread's own team
    release.wait()


def summary(runs: dict[str, list[dict]], base: str, other: str) -> dict:
    med = {arm: {k: statistics.median(r[k] for r in runs[arm]) for k in runs[arm][0]} for arm in (base, other)}
    return {"median": med, "seconds_ratio": med[other]["seconds"] / med[base]["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default=models.EMBEDDED_MODEL)
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--passes", type=int, default=2, help="forward passes over the data per process")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=("default", "kept"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    report = {"malloc": summary(malloc_pairs(args), "kept", "default"),
              "openmp": summary(openmp_pairs(args), "one_team", "second_team"),
              "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "torch": torch.__version__}}
    for name, r in (("glibc's own malloc thresholds / kept", report["malloc"]),
                    ("a second OpenMP team / one team", report["openmp"])):
        m = r["median"]
        print(f"{name}: time {r['seconds_ratio']:.3f}x (median pass "
              + " vs ".join(f"{v['seconds']:.2f} s, {v['minor_faults']:,.0f} faults, "
                            f"{v['voluntary_switches']:,.0f} switches" for v in reversed(m.values())) + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
