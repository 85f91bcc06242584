"""Multi-process runs on torch.distributed (torchrun), or on no rendezvous at all: nothing home-made.

Each rank takes the sorting windows w with w % world_size == rank (windows are fixed ranges of
source rows, see batching.iter_windows) and writes its own store part, so no two processes
write one array, any world size computes identical batches, and a resume with a different
number of ranks skips exactly the rows some part has committed.

Schedulers that start independent processes with no process group (Slurm job arrays, as NVIDIA's
recipes shard with --shard-id $SLURM_ARRAY_TASK_ID) give each its rank by `--rank N --world-size M`
or the array's own variables. Such ranks never wait for each other: each creates or opens the store
itself (store.prepare creates it in one write), and the result is the same, bit for bit, as torchrun's.

Tensor parallel (--tp N, torchrun only): the job's WORLD_SIZE processes form WORLD_SIZE / N groups of N
consecutive ranks (a node's GPUs, where N is its GPU count). The model is sharded over each group (transformers'
tp_plan on the group's device mesh); the groups are the data-parallel ranks above: group g takes the windows and
writes the part of rank g. Every process of a group tokenizes and batches the group's windows itself (the batches
never depend on anything but the rows), so only a word per batch travels between them (pipeline.follow): the
group's first process captures and writes, the others run the forward with it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Rank:
    rank: int = 0  # the data-parallel rank: its windows and its part (a tensor-parallel group's)
    world_size: int = 1  # data-parallel ranks
    local_rank: int = 0
    group: bool = False  # a torch.distributed process group joins the ranks (torchrun); else they never wait
    tp_rank: int = 0  # within its tensor-parallel group: 0 captures and writes
    tp_size: int = 1
    mesh: DeviceMesh | None = field(default=None, compare=False)  # ("dp", "tp") under --tp
    tasks: int = 1  # torchrun jobs the ranks are spread over (a job array's tasks), no process group between them
    job_first: int = 0  # the first data-parallel rank of this process's torchrun job

    @property
    def leads(self) -> bool:
        """Captures and writes its group's part (every process but tensor parallel's others)."""
        return self.tp_rank == 0

    @property
    def process(self) -> int:
        """Its rank in the torchrun job."""
        return (self.rank - self.job_first) * self.tp_size + self.tp_rank

    @property
    def independent(self) -> bool:
        """One of several processes, or torchrun jobs, that share no process group."""
        return self.tasks > 1 or (self.world_size > 1 and not self.group)

    @property
    def prepares(self) -> bool:
        """Creates (or checks) the store before the others open it: the first process of its torchrun job, or each
        process where no process group joins it to others."""
        return not self.group or (self.rank == self.job_first and self.leads)

    @property
    def is_main(self) -> bool:
        return self.rank == 0 and self.leads

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


def init_from_env(rank: int | None = None, world_size: int | None = None, tp: int = 1) -> Rank:
    """This process's rank. The task: `rank` of `world_size` when given (--rank, --world-size), else a Slurm job
    array's task, else none. Under torchrun (WORLD_SIZE/RANK/LOCAL_RANK; joining its process group; with `tp` > 1,
    in groups of `tp` that shard the model) the job is that task of several such jobs, its groups the task's share
    of the data-parallel ranks; without torchrun the process is the task; else rank 0 of 1."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1:
        raise ValueError(f"--tp must be 1 or more, got {tp}")
    if tp > 1 and (processes == 1 or processes % tp):
        raise ValueError(f"--tp {tp} shards the model over processes of one torchrun job: run it under torchrun with a "
                         f"multiple of {tp} processes (torchrun --nproc-per-node {tp} ...; a job array of such jobs "
                         "names each by --rank/--world-size or its Slurm variables)"
                         + (f"; this job has {processes}" if processes > 1 else ""))
    task = _task(rank, world_size)
    if processes > 1:
        return _torchrun(tp, *(task or (0, 1)))
    return Rank(*task) if task else Rank()


def _task(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """(task, tasks) from --rank/--world-size, else from a Slurm job array's variables, else None."""
    if rank is not None or world_size is not None:
        what = "--rank and --world-size"
    elif "SLURM_ARRAY_TASK_ID" in os.environ and "SLURM_ARRAY_TASK_COUNT" in os.environ:
        task, first = int(os.environ["SLURM_ARRAY_TASK_ID"]), int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        step = int(os.environ.get("SLURM_ARRAY_TASK_STEP", "1"))
        rank, world_size = (task - first) // step, int(os.environ["SLURM_ARRAY_TASK_COUNT"])
        what = (f"the Slurm array's task {task} (of {world_size} from {first} by {step}; an array of listed ids needs "
                "--rank and --world-size)")
    else:
        return None
    if rank is None or world_size is None:
        raise ValueError("--rank and --world-size go together: name both")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank {rank} of a world of {world_size} is not one of 0..{world_size - 1}")
    return rank, world_size


WAIT_MINUTES = 180  # the longest legitimate wait in a collective: rank 0 sizing the store from every row, a large
# model's load (the run itself waits in none: each rank ends on its own)


def collective_timeout() -> timedelta:
    """How long a collective may wait: $STREAMX_WAIT_MINUTES, else WAIT_MINUTES (torch's own default, 10 minutes on
    NCCL, is shorter than a large model's load or the sizing of a large dataset)."""
    return timedelta(minutes=float(os.environ.get("STREAMX_WAIT_MINUTES", WAIT_MINUTES)))


def _torchrun(tp: int, task: int, tasks: int) -> Rank:
    """A process of torchrun job `task` of `tasks`: the job's groups are data-parallel ranks task * groups on."""
    rank, local_rank, processes = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), \
        int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=collective_timeout())
    mesh = None if tp == 1 else init_device_mesh("cuda" if cuda else "cpu", (processes // tp, tp),
                                                 mesh_dim_names=("dp", "tp"))
    groups = processes // tp
    return Rank(task * groups + rank // tp, tasks * groups, local_rank, group=True, tp_rank=rank % tp, tp_size=tp,
                mesh=mesh, tasks=tasks, job_first=task * groups)
