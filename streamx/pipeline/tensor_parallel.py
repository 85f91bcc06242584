"""What travels within a tensor-parallel group (--tp): a word before each forward, from the process that captures
and writes (its first) to the others, which run the same forwards with it (runner.follow).

Every process of the group makes the group's planned batches itself, from the same rows (the batches depend on the
rows alone), so a planned batch is not sent: the word says "your next planned batch" (its token count and a
checksum of its ids, which each process compares with its own, so that a group whose batches differ stops with one
line instead of waiting forever inside a collective). What only the first process decides travels whole: the rows
the in-run audit computes again alone, the batches of a rung the audit went down to (the planned batch then passed
over), the rung itself, and the rows healed at the end (proof.audit, proof.ladder, pipeline.heal). "No more" ends
the group's forwards (the end of the data, or a signal that wound the run up: the first process decides, and the
others stop with it)."""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

from ..data.batching import Batch
from .ranks import Rank


class Word(IntEnum):
    END = 0  # no more forwards
    NEXT = 1  # your next planned batch, as planned
    PASS = 2  # your next planned batch is computed otherwise: the batches sent next
    BATCH = 3  # this batch (sent), through the run's capture
    ALONE = 4  # this row (sent), the model's own forward of it alone (padded attention), as the audit computes it
    RUNG = 5  # the run stands on this rung of the ladder from now on


class GroupWord:
    """One process's end of the words of its tensor-parallel group."""

    def __init__(self, rank: Rank, device: torch.device):
        self.group = rank.mesh.get_group("tp")
        self.first = rank.process - rank.tp_rank  # the group's first process, in the job
        self.device = device if device.type == "cuda" else torch.device("cpu")  # (gloo: host tensors)

    # the first process's words
    def planned(self, batch: Batch, computed: bool = True) -> None:
        """The next planned batch is `batch`: computed as planned, or (not `computed`) passed over."""
        self._say(self._checked(Word.NEXT if computed else Word.PASS, batch))

    def send(self, word: Word, batch: Batch) -> None:
        """A forward only this process decided (BATCH, ALONE): the batch travels whole."""
        self._say(torch.tensor([word, batch.num_tokens, 0], dtype=torch.int64, device=self.device))
        dist.broadcast_object_list([batch], src=self.first, group=self.group, device=self.device)

    def rung(self, rung: int) -> None:
        self._say(torch.tensor([Word.RUNG, rung, 0], dtype=torch.int64, device=self.device))

    def end(self) -> None:
        self._say(torch.zeros(3, dtype=torch.int64, device=self.device))

    # the others'
    def receive(self) -> tuple[Word, torch.Tensor | int | Batch]:
        """The next word: with NEXT and PASS its checksum (`check` it against this process's next planned batch),
        with BATCH and ALONE the batch, with RUNG the rung."""
        word = torch.zeros(3, dtype=torch.int64, device=self.device)
        dist.broadcast(word, src=self.first, group=self.group)
        kind = Word(int(word[0]))
        if kind in (Word.BATCH, Word.ALONE):
            sent: list = [None]
            dist.broadcast_object_list(sent, src=self.first, group=self.group, device=self.device)
            return kind, sent[0]
        return kind, (int(word[1]) if kind == Word.RUNG else word)

    def check(self, word: torch.Tensor, batch: Batch | None) -> Batch:
        """`batch`, this process's next planned one, if it is the first process's (`word`); else the run stops."""
        if batch is None or not torch.equal(word, self._checked(Word(int(word[0])), batch)):
            raise RuntimeError("this process's batches are not its tensor-parallel group's first process's: the "
                               "processes of a --tp group must read the same data with the same settings")
        return batch

    def _say(self, word: torch.Tensor) -> None:
        dist.broadcast(word, src=self.first, group=self.group)

    def _checked(self, kind: Word, batch: Batch) -> torch.Tensor:
        ids = batch.input_ids
        checksum = int((ids * torch.arange(1, ids.numel() + 1).view_as(ids)).sum()) % (1 << 61)
        return torch.tensor([kind, batch.num_tokens, checksum], dtype=torch.int64, device=self.device)
