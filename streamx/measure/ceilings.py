"""What the machine can do at most, measured in the same run as the figures they bound.

`streamx bench` compares the forward pass with the bf16 matmul peak (utilisation), the device-to-host
copy with the pinned copy bandwidth, and the writer with the filesystem's plain write speed
(`writebench.write_ceiling`). Datasheet numbers are not used: clocks, power limits and the host
differ from machine to machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def matmul_peak_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float | None:
    """bf16 TFLOP/s of an n x n x n matmul on random data (median of `iters` after 3 warm-ups); CUDA only."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / median_seconds(lambda: a @ b, iters, device) / 1e12


def host_copy_gb_per_s(device: torch.device, nbytes: int = 1 << 30, iters: int = 5) -> float | None:
    """GB/s of one device-to-host copy into pinned memory, as the pipeline's transfer does; CUDA only."""
    if device.type != "cuda":
        return None
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / median_seconds(lambda: dst.copy_(src, non_blocking=True), iters, device) / 1e9


def median_seconds(fn: Callable[[], object], iters: int, device: torch.device, warmups: int = 3) -> float:
    """Median seconds of one call to fn after `warmups` calls (which also compile): CUDA events on the
    GPU (no host-side noise), perf_counter elsewhere."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
