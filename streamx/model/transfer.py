"""Device -> host hand-off of packed batches without stalling the forward pass.

On CUDA: a ring of pinned host buffers; each packed batch is copied on a side stream after
the compute stream's work, an event marks completion, and the writer thread waits on that
event (never the GPU stage). A buffer returns to the ring when the writer has stored it, so
the ring bounds host memory and applies back-pressure. On CPU the packed tensor already
lives on the host: the hand-off is the tensor itself.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..base.threads import get


@dataclass
class HostBatch:
    hidden: torch.Tensor  # bfloat16 or float8_e4m3fn [N, K, H], host memory (valid after wait())
    finite: torch.Tensor  # bool [B]
    scales: torch.Tensor | None = None  # float32 [N] with fp8 states (dequantised = hidden * scale), else None
    event: torch.cuda.Event | None = None
    release: Callable[[], None] = field(default=lambda: None)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostTransfer:
    def __init__(self, device: torch.device, max_tokens: int, num_slots: int, hidden_size: int, num_buffers: int,
                 failed: threading.Event, hidden_dtype: torch.dtype = torch.bfloat16):
        self.device, self.failed = device, failed
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.free: queue.Queue[tuple[torch.Tensor, torch.Tensor]] = queue.Queue()
            for _ in range(num_buffers):  # (states, scales): the scales buffer goes unused with bf16 states
                self.free.put((torch.empty(max_tokens * num_slots * hidden_size, dtype=hidden_dtype, pin_memory=True),
                               torch.empty(max_tokens, dtype=torch.float32, pin_memory=True)))

    def start(self, packed: torch.Tensor, finite: torch.Tensor, scales: torch.Tensor | None = None) -> HostBatch:
        """Start copying a packed batch (and its fp8 scales) to the host."""
        if not self.cuda:
            return HostBatch(packed, finite, scales)
        buffers = get(self.free, self.failed)  # Stopped when the writer fails meanwhile
        host = buffers[0][: packed.numel()].view(packed.shape)
        scales_host = None if scales is None else buffers[1][: scales.numel()]
        finite_host = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for src, dst in ((packed, host), (finite, finite_host), (scales, scales_host)):
                if src is not None:
                    dst.copy_(src, non_blocking=True)
                    # the caching allocator must not hand src to the next forward before the copy ran
                    src.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostBatch(host, finite_host, scales_host, event, release=lambda: self.free.put(buffers))
