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


@dataclass
class HostBatch:
    hidden: torch.Tensor  # bfloat16 [N, K, H], host memory (valid after wait())
    finite: torch.Tensor  # bool [B]
    event: torch.cuda.Event | None = None
    release: Callable[[], None] = field(default=lambda: None)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostTransfer:
    def __init__(self, device: torch.device, max_tokens: int, num_slots: int, hidden_size: int, num_buffers: int,
                 stop: threading.Event):
        self.device, self.stop = device, stop
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.free: queue.Queue[torch.Tensor] = queue.Queue()
            for _ in range(num_buffers):
                self.free.put(torch.empty(max_tokens * num_slots * hidden_size, dtype=torch.bfloat16, pin_memory=True))

    def _take_buffer(self) -> torch.Tensor:
        while not self.stop.is_set():
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                continue
        raise RuntimeError("stopped while waiting for a host buffer")

    def start(self, packed: torch.Tensor, finite: torch.Tensor) -> HostBatch:
        if not self.cuda:
            return HostBatch(packed, finite)
        buffer = self._take_buffer()
        host = buffer[: packed.numel()].view(packed.shape)
        finite_host = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(packed, non_blocking=True)
            finite_host.copy_(finite, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # the caching allocator must not hand these to the next forward before the copy ran
        packed.record_stream(self.stream)
        finite.record_stream(self.stream)
        return HostBatch(host, finite_host, event, release=lambda: self.free.put(buffer))
