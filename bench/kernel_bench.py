"""Gather-pack bandwidth: the Triton kernel vs torch (index_select + copy) vs a plain copy of the same bytes.

One layer moves N * H * (input bytes + 2) bytes: the N real rows read once, written once as bf16.
Each timed call packs all K slots of a batch, as the hooks do; figures are per layer. On CUDA,
timing uses CUDA events (median of --iters) and a second table compares the two host hand-offs:
packing into a device buffer then one async copy to pinned host memory, against the kernel
writing straight into pinned, mapped host memory. On CPU the Triton kernel runs under the
interpreter, only for --tokens up to --interp-max-tokens: proof that it runs, not a speed.

    python bench/kernel_bench.py                                  # H=5120, K=6, bf16 and fp32
    python bench/kernel_bench.py --blocks 4x1024,8x512,1x4096     # sweep the Triton tile (BLOCK_N x BLOCK_H)
    python bench/kernel_bench.py --json bench/kernel.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from collections.abc import Callable

import torch

from streamx.measure.ceilings import median_seconds
from streamx.model.gather import gather_into_torch
from streamx_kernels.gather import gather_into_triton

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def batch(tokens: int, H: int, dtype: torch.dtype, max_length: int, device: torch.device):
    """[B, S, H] activations, about 80% real tokens right-padded, and the flat index of the real ones."""
    S = min(max_length, tokens)
    B = math.ceil(tokens * 1.25 / S)
    lengths = [tokens // B + (b < tokens % B) for b in range(B)]
    index = torch.cat([b * S + torch.arange(n) for b, n in enumerate(lengths)]).to(device)
    return torch.randn(B, S, H, device=device).to(dtype), index


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")] if args.blocks else [(None, None)]
    rows, H, K = [], args.hidden, args.slots
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for tokens in [int(t) for t in args.tokens.split(",")]:
            hidden, index = batch(tokens, H, dtype, args.max_length, device)
            states = torch.empty(tokens, K, H, dtype=torch.bfloat16, device=device)
            layer_bytes = tokens * H * (hidden.element_size() + 2)
            src = torch.empty(layer_bytes // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)

            def each_slot(pack, **kw) -> Callable[[], None]:
                return lambda: [pack(states, k, hidden, index, **kw) for k in range(K)]  # noqa: B023 - this round

            methods = {"copy": lambda: [dst.copy_(src) for _ in range(K)],  # noqa: B023 - timed this round
                       "torch": each_slot(gather_into_torch)}
            if cuda or tokens <= args.interp_max_tokens:
                label = "triton" if cuda else "triton (interpreter)"
                for bn, bh in blocks:
                    tile = f" {bn}x{bh}" if bn else ""
                    methods[label + tile] = each_slot(gather_into_triton, block_n=bn, block_h=bh)
            seconds = {m: median_seconds(fn, args.iters, device, warmups=1) / K for m, fn in methods.items()}
            for m, s in seconds.items():
                rows.append(dict(table="gather", device=str(device), dtype=name, tokens=tokens, H=H, K=K, method=m,
                                 ms_per_layer=s * 1e3, gb_per_s=layer_bytes / s / 1e9,
                                 pct_of_copy=100 * seconds["copy"] / s))
            if cuda:
                rows += host_handoff(states, hidden, index, name, args.iters, device)
    return rows


def host_handoff(states: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor, name: str, iters: int,
                 device: torch.device) -> list[dict]:
    """Per batch (K layers): device buffer + one async copy to pinned host, vs the kernel writing pinned host memory."""
    host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
    K = states.shape[1]

    def device_then_copy() -> None:
        for k in range(K):
            gather_into_triton(states, k, hidden, index)
        host.copy_(states, non_blocking=True)

    def mapped() -> None:
        for k in range(K):
            gather_into_triton(host, k, hidden, index)

    out_bytes = states.numel() * states.element_size()
    seconds = {"device + async D2H": median_seconds(device_then_copy, iters, device, warmups=1),
               "mapped pinned host": median_seconds(mapped, iters, device, warmups=1)}
    base = seconds["device + async D2H"]
    return [dict(table="host", device=str(device), dtype=name, tokens=states.shape[0], H=states.shape[2], K=K,
                 method=m, ms_per_batch=s * 1e3, host_gb_per_s=out_bytes / s / 1e9, speedup=base / s)
            for m, s in seconds.items()]


def print_tables(rows: list[dict]) -> None:
    pack = [r for r in rows if r["table"] == "gather"]
    print(f"{'dtype':5} {'tokens':>7} {'method':28} {'ms/layer':>9} {'GB/s':>8} {'% copy':>7}")
    for r in pack:
        print(f"{r['dtype']:5} {r['tokens']:>7} {r['method']:28} {r['ms_per_layer']:9.3f} {r['gb_per_s']:8.2f} "
              f"{r['pct_of_copy']:6.0f}%")
    host = [r for r in rows if r["table"] == "host"]
    if host:
        print(f"\n{'dtype':5} {'tokens':>7} {'host hand-off':28} {'ms/batch':>9} {'host GB/s':>9} {'speedup':>8}")
        for r in host:
            print(f"{r['dtype']:5} {r['tokens']:>7} {r['method']:28} {r['ms_per_batch']:9.2f} "
                  f"{r['host_gb_per_s']:9.1f} {r['speedup']:7.2f}x")


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--slots", type=int, default=6, help="K: selected layers per batch")
    p.add_argument("--tokens", default="8192,16384,32768,65536" if cuda else "256,8192", help="real tokens per batch")
    p.add_argument("--max-length", type=int, default=4096, help="S of the padded batch")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--blocks", default="", help="Triton tiles to try, BLOCK_NxBLOCK_H,... (default: the heuristic)")
    p.add_argument("--iters", type=int, default=20 if cuda else 3)
    p.add_argument("--interp-max-tokens", type=int, default=256, help="CPU: largest batch run under the interpreter")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = run(args)
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"{machine}; torch {torch.__version__}\n")
    print_tables(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
