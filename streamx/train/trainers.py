"""The drafter trainers a store converts for besides speculators, each as its reader sees rows (docs/trainers.md):
the layout, the keys, how it counts layers, which last state it takes, and the command that trains on the folder.

Every trainer here counts layer ids as the output of 0-based decoder block k (SpecForge, ModelOpt, TorchSpec's HF
engine), which is streamx id k + 1 (streamx and speculators count the input of block k: docs/layers.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

Row = dict[str, object]


@dataclass(frozen=True)
class Trainer:
    name: str  # --format
    title: str
    last: Literal["post_norm", "pre_norm"] | None  # the last state it reads: after the final norm, before, or none
    suffix: str  # a row file's
    version: str  # of the trainer whose reader the layout follows (and the tests prove)
    default_ids: Callable[[int, list[int]], list[int]]  # (L, the store's ids in its counting) -> its default ids
    row: Callable[[dict[str, torch.Tensor]], Row | None]  # one row's file (None: a row it cannot train)
    command: str  # how to train on the folder DIR (its own command)
    ids_setting: str  # where its config says the layer ids
    ascending: bool = False  # it sorts the ids it is given (the states go in that order)

    def describe_ids(self, ids: list[int]) -> str:
        return f"{self.ids_setting} = {ids} (the output of block k = streamx id k+1)"


def eagle3_ids(L: int, stored: list[int]) -> list[int]:
    """The EAGLE-3 default of SpecForge and ModelOpt: blocks 1, L//2 - 1 and L - 4 (streamx's eagle3 preset)."""
    return [1, L // 2 - 1, L - 4]


def stored_ids(L: int, stored: list[int]) -> list[int]:
    """Every auxiliary layer the store holds but the last (its dflash preset: the DFlash drafts' five)."""
    return [k for k in stored if 0 <= k < L - 1]


def _consecutive_supervised(mask: torch.Tensor) -> bool:
    return bool((mask[1:].bool() & mask[:-1].bool()).any())


def _specforge_eagle3(r: dict[str, torch.Tensor]) -> Row:
    return {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "aux_hidden_state": r["aux"][None],
            "hidden_state": r["last"][None]}


def _specforge_dflash(r: dict[str, torch.Tensor]) -> Row | None:
    if not _consecutive_supervised(r["loss_mask"]):  # its reader raises on such a row
        return None
    return {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "hidden_states": r["aux"][None]}


def _modelopt(r: dict[str, torch.Tensor]) -> Row:
    return {"input_ids": r["input_ids"], "hidden_states": r["last"], "aux_hidden_states": r["aux"],
            "loss_mask": r["loss_mask"], "conversation_id": f"row-{int(r['row']):09d}"}


TRAINERS = {t.name: t for t in (
    Trainer("specforge-eagle3", "SpecForge EAGLE-3", "post_norm", ".ckpt", "specforge 0.2.0", eagle3_ids,
            _specforge_eagle3, "specforge train -c CONFIG.yaml data.hidden_states_path=DIR",
            "model.aux_hidden_state_layer_ids (or the draft config's eagle_config.eagle_aux_hidden_state_layer_ids)"),
    Trainer("specforge-dflash", "SpecForge DFlash", None, ".ckpt", "specforge 0.2.0", stored_ids,
            _specforge_dflash, "specforge train -c CONFIG.yaml training.strategy=dflash data.hidden_states_path=DIR",
            "the draft config's dflash_config.target_layer_ids, in this order"),
    Trainer("modelopt", "NVIDIA ModelOpt (EAGLE-3, DFlash)", "post_norm", ".pt", "nvidia-modelopt 0.47.0",
            eagle3_ids, _modelopt, "set data.offline_data_path: DIR in the training config of ModelOpt's "
            "examples/speculative_decoding (EAGLE-3 or DFlash)",
            "the draft's aux layer ids (eagle_aux_hidden_state_layer_ids; sorted)", ascending=True),
)}
