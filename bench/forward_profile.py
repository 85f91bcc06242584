"""Where a forward pass's time goes with rows shared and without: torch's profiler over the decoder alone
(bench's forward_only mode), the run's own batches with --sharing on, then the first batches of the same rows
computed in full (about as many tokens), per computed token, op by op; and for the shared batches' tree attention
(streamx.model.attention._tree_attention, the CPU's), the time of its attention calls on each segment's own keys
(causal) and on what it continues (its ancestors' or a kept chain's keys).

    python bench/forward_profile.py --data sysprompt360.jsonl --json bench/results/forward_profile.json

Two rounds each, interleaved (this VM's rounds differ by up to 10%); the profiled pass comes after them.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import time
from collections import Counter

from torch.profiler import ProfilerActivity, profile

from streamx.config import load_config
from streamx.measure.bench import Workload, forward_only
from streamx.model import attention
from streamx.pipeline.plan import make_plan

kernel_seconds: Counter = Counter()
_attention = attention._ATTENTION_WITH_LSE


def timed_attention(*args, **kwargs):
    """The CPU's flash attention with log-sum-exps, timed by what it attends to."""
    start = time.perf_counter()
    out = _attention(*args, **kwargs)
    kernel_seconds["own keys (causal)" if kwargs.get("is_causal") else "continued keys"] += time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="rows, as `streamx run --data` takes them")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="ops listed per arm")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    plan = make_plan(load_config(None, data=args.data), log=lambda m: None)
    shared = Workload.build(plan, padded=False).batches
    full = Workload.build(plan.unshared(), padded=False).batches
    reached = list(itertools.accumulate(b.num_tokens for b in full))  # the first batches, as many tokens or more
    full = full[: bisect.bisect_left(reached, sum(b.num_tokens for b in shared)) + 1]
    attention._ATTENTION_WITH_LSE = timed_attention  # _tree_attention looks it up at each call
    arms = {"shared": shared, "unshared": full}
    report: dict = {"data": args.data, "arms": {}}
    for batches in arms.values():
        forward_only(plan.model, batches, plan.device)  # every shape once
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    tree_attention: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, batches in arms.items():
            kernel_seconds.clear()
            start = time.perf_counter()
            forward_only(plan.model, batches, plan.device)
            seconds[name].append(time.perf_counter() - start)
            if name == "shared":
                for part, spent in kernel_seconds.items():
                    tree_attention.setdefault(part, []).append(spent)
    for name, batches in arms.items():
        computed = sum(b.num_tokens for b in batches)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            forward_only(plan.model, batches, plan.device)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        arm = {"batches": len(batches), "rows": sum(len(b.samples) for b in batches), "computed_tokens": computed,
               "us_per_token_rounds": [s / computed * 1e6 for s in seconds[name]],
               "ops_us_per_token": {e.key: e.self_cpu_time_total / computed for e in ops},
               "ops_calls": {e.key: e.count for e in ops}}
        if name == "shared":
            arm["tree_attention_us_per_token_rounds"] = {part: [s / computed * 1e6 for s in spent]
                                                         for part, spent in tree_attention.items()}
        report["arms"][name] = arm
        rounds = ", ".join(f"{u:.0f}" for u in arm["us_per_token_rounds"])
        print(f"{name}: {arm['batches']} batches, {arm['rows']} rows, {computed:,} computed tokens; "
              f"us per computed token by round: {rounds}")
        for part, spent in arm.get("tree_attention_us_per_token_rounds", {}).items():
            print(f"  tree attention, {part}: " + ", ".join(f"{u:.0f}" for u in spent) + " us/token by round")
        for op, us in arm["ops_us_per_token"].items():
            print(f"  {op:55s} {us:7.1f} us/token  {arm['ops_calls'][op]:7d} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
