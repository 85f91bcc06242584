"""Multi-process runs on torch.distributed (torchrun), or on no rendezvous at all: nothing home-made.

Each rank takes the sorting windows w with w % world_size == rank (windows are fixed ranges of
source rows, see batching.iter_windows) and writes its own store part, so no two processes
write one array, any world size computes identical batches, and a resume with a different
number of ranks skips exactly the rows some part has committed.

Schedulers that start independent processes with no process group (Slurm job arrays, as NVIDIA's
recipes shard with --shard-id $SLURM_ARRAY_TASK_ID) give each its rank by `--rank N --world-size M`
or the array's own variables. Such ranks never wait for each other: each creates or opens the store
itself (store.prepare creates it in one write), and the result is the same, bit for bit, as torchrun's."""

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
    group: bool = False  # a torch.distributed process group joins the ranks (torchrun); else they never wait

    @property
    def independent(self) -> bool:
        """One of several processes that share no process group: each prepares the store itself."""
        return self.world_size > 1 and not self.group

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
        if self.group:
            dist.barrier()


def init_from_env(rank: int | None = None, world_size: int | None = None) -> Rank:
    """This process's rank: `rank` of `world_size` when given (--rank, --world-size); else torchrun's
    WORLD_SIZE/RANK/LOCAL_RANK (joining its process group); else a Slurm job array's task; else rank 0 of 1."""
    if rank is not None or world_size is not None:
        return _independent(rank, world_size, "--rank and --world-size")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _torchrun()
    if "SLURM_ARRAY_TASK_ID" in os.environ and "SLURM_ARRAY_TASK_COUNT" in os.environ:
        task, first = int(os.environ["SLURM_ARRAY_TASK_ID"]), int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        step = int(os.environ.get("SLURM_ARRAY_TASK_STEP", "1"))
        return _independent((task - first) // step, int(os.environ["SLURM_ARRAY_TASK_COUNT"]),
                            f"the Slurm array's task {task} (of {os.environ['SLURM_ARRAY_TASK_COUNT']} from {first} "
                            f"by {step}; an array of listed ids needs --rank and --world-size)")
    return Rank()


def _independent(rank: int | None, world_size: int | None, what: str) -> Rank:
    if rank is None or world_size is None:
        raise ValueError("--rank and --world-size go together: name both")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank {rank} of a world of {world_size} is not one of 0..{world_size - 1}")
    return Rank(rank, world_size)


def _torchrun() -> Rank:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return Rank(rank, int(os.environ["WORLD_SIZE"]), local_rank, group=True)
