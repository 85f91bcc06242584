"""A PyTorch Dataset over a streamx store, for any trainer (speculators' through
streamx.speculators_backend, SpecForge, DeepSpec, a loop of your own): item i is one sample's token
ids, loss mask and hidden states of the layer ids you choose, bf16 (an fp8 store's dequantised as
speculators' fp8 loader does).

    from torch.utils.data import DataLoader
    from streamx.train.dataset import StoreDataset

    data = StoreDataset("out.zarr", layer_ids=[2, 18, 33, 36])     # any subset of the store's ids
    for item in DataLoader(data, batch_size=None, shuffle=True, num_workers=4):
        item["input_ids"], item["loss_mask"], item["hidden_states"]   # [T], [T], [T, 4, H]

The store is opened once in each process: DataLoader workers that are spawned get the dataset pickled
without it, and workers that are forked (torch's default on Linux) open it again rather than use the
parent's (an object store's session belongs to the process, and its event loop, that opened it). A sample's
tokens are read in as few reads as the layout allows (store.shards.ShardFiles).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..store import Store, StoreError, open_store


class StoreDataset(Dataset):
    """Item i: the sample of source row `rows[i]` (default: every committed row, ascending), with the
    states of `layer_ids` (default: all the store holds) in that order."""

    def __init__(self, path: str, layer_ids: Sequence[int] | None = None, rows: Sequence[int] | None = None,
                 store: Store | None = None):
        self.path = path
        store = store or open_store(path)  # `store`: the one at `path`, already open
        stored = store.layer_ids
        self.layer_ids = list(stored if layer_ids is None else layer_ids)
        missing = [i for i in self.layer_ids if i not in stored]
        if missing:
            raise StoreError(f"{path} holds layer ids {stored}, not {missing}; extract them with `streamx run "
                             f"--layers ...` or choose among {stored}")
        self.slots = [stored.index(i) for i in self.layer_ids]
        self.rows = np.asarray(store.row_ids() if rows is None else rows, dtype=np.int64)
        self._store: Store | None = store
        self._opened_in = os.getpid()

    @property
    def store(self) -> Store:
        if self._store is None or self._opened_in != os.getpid():  # in a DataLoader worker: open it there
            self._store, self._opened_in = open_store(self.path), os.getpid()
        return self._store

    def __len__(self) -> int:
        return int(self.rows.size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.store.sample(int(self.rows[i]), slots=self.slots)
        return {"input_ids": s.input_ids, "loss_mask": s.loss_mask, "hidden_states": s.hidden_states}

    def ids_and_states(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Item i's token ids and hidden states only: what a trainer that takes no loss mask from it reads (the
        speculators backend), one read fewer."""
        store = self.store
        position = store.position(int(self.rows[i]))
        hidden_states, _ = store.states_at(position, slots=self.slots)
        return torch.from_numpy(store.read_tokens(position, "input_ids")), hidden_states

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None}  # zarr's handles stay in the process that opened them
