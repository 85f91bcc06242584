"""What travels within a tensor-parallel group (--tp): a word per batch from the process that captures and writes
(its first) to the others, which run the same forwards with it (runner.follow).

Every process of the group makes the group's batches itself, from the same rows (the batches depend on the rows
alone), so no batch is sent: the word says "this batch next" (its token count and a checksum of its ids, which
each process compares with its own, so that a group whose batches differ stops with one line instead of waiting
forever inside a collective) or "no more" (the end of the data, or a signal that wound the run up: the first
process decides, and the others stop with it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.batching import Batch
from .ranks import Rank


class GroupWord:
    """One process's end of the words of its tensor-parallel group."""

    def __init__(self, rank: Rank, device: torch.device):
        self.group = rank.mesh.get_group("tp")
        self.first = rank.process - rank.tp_rank  # the group's first process, in the job
        self.device = device if device.type == "cuda" else torch.device("cpu")  # (gloo: host tensors)

    def send(self, batch: Batch | None) -> None:
        """From the group's first process: `batch` is the next forward (None: there is none)."""
        dist.broadcast(self._word(batch), src=self.first, group=self.group)

    def receive(self, batch: Batch | None) -> bool:
        """In the others: whether the next forward is `batch`, this process's own next one (False: the first
        process ran no more); one that is not stops the run."""
        word = torch.zeros(3, dtype=torch.int64, device=self.device)
        dist.broadcast(word, src=self.first, group=self.group)
        if not word[0]:
            return False
        if batch is None or not torch.equal(word, self._word(batch)):
            raise RuntimeError("this process's batches are not its tensor-parallel group's first process's: the "
                               "processes of a --tp group must read the same data with the same settings")
        return True

    def _word(self, batch: Batch | None) -> torch.Tensor:
        values = [0, 0, 0] if batch is None else \
            [1, batch.num_tokens, int((batch.input_ids * torch.arange(1, batch.input_ids.numel() + 1).view_as(
                batch.input_ids)).sum()) % (1 << 61)]
        return torch.tensor(values, dtype=torch.int64, device=self.device)
