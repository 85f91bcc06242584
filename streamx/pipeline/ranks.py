"""Multi-process runs on torch.distributed (torchrun), nothing home-made.

Each rank takes the sorting windows w with w % world_size == rank (windows are fixed ranges of
source rows, see batching.iter_windows) and writes its own store part, so no two processes
write one array, any world size computes identical batches, and a resume with a different
number of ranks skips exactly the rows some part has committed."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def part_name(self) -> str:
        return f"part-{self.rank:05d}"

    def owns(self, window: int) -> bool:
        """Whether this rank computes sorting window number `window` (source rows window * sort_window
        onwards): windows go round the ranks, so every rank gets a share of every part of the data."""
        return window % self.world_size == self.rank

    def device(self, device: str) -> str:
        """`auto` under torchrun picks this process's GPU (LOCAL_RANK)."""
        if device == "auto" and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return device

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init_from_env() -> Rank:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; a plain `streamx run` is rank 0 of 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Rank()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return Rank(rank, world_size, local_rank)
