"""The drafter trainers a store converts for besides speculators, each as its reader sees rows (docs/trainers.md):
the layout, the keys, how it counts layers, which last state it takes, the index files its reader opens first
(where it has them), and the command that trains on the folder.

Every trainer here counts layer ids as the output of 0-based decoder block k (SpecForge, ModelOpt, TorchSpec's HF
engine), which is streamx id k + 1 (streamx and speculators count the input of block k: docs/layers.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from ..base import durable

Row = dict[str, object]
Written = list[tuple[int, Path, int]]  # (row, its file relative to the folder, tokens) for every row file, by row


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
    index: Callable[[Path, Written], None] | None = None  # writes the files that list the rows, once all are written

    def describe_ids(self, ids: list[int]) -> str:
        return f"{self.ids_setting} = {ids} (the output of block k = streamx id k+1)"


def eagle3_ids(L: int, stored: list[int]) -> list[int]:
    """The EAGLE-3 default of SpecForge and ModelOpt: blocks 1, L//2 - 1 and L - 4 (streamx's eagle3 preset), each
    once (ModelOpt takes the set: on 6 layers, 1 and 2) and within the model's blocks on a small one."""
    return sorted({min(max(k, 0), L - 1) for k in (1, L // 2 - 1, L - 4)})


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


def data_id(row: int) -> str:
    """A row's id in the trainers that name their samples (the store's row number)."""
    return f"row-{row:09d}"


def _modelopt(r: dict[str, torch.Tensor]) -> Row:
    return {"input_ids": r["input_ids"], "hidden_states": r["last"], "aux_hidden_states": r["aux"],
            "loss_mask": r["loss_mask"], "conversation_id": data_id(int(r["row"]))}


def packed_loss_mask(mask: torch.Tensor) -> str:
    """TorchSpec's packed mask: the lengths of the runs of 0s and 1s, comma-joined, the first a run of 0s (maybe
    empty): [0, 0, 1, 1, 1, 0] -> "2,3,1"."""
    m = mask.to(torch.int8)
    edges = (torch.nonzero(m[1:] != m[:-1]).flatten() + 1).tolist()
    runs = torch.tensor([0, *edges, m.numel()]).diff().tolist()
    return ",".join(map(str, ([0] if int(m[0]) else []) + runs))


def _torchspec(r: dict[str, torch.Tensor]) -> Row:
    row = int(r["row"])
    return {"input_ids": r["input_ids"], "hidden_states": r["aux"], "last_hidden_states": r["last"],
            "data_id": data_id(row), "packed_loss_mask": packed_loss_mask(r["loss_mask"]),
            "metadata": {"streamx_row": row}}


def _torchspec_index(out: Path, written: Written) -> None:
    """Its manifest (one line per row, all in the train split), then dataset.json, without which its reader opens
    nothing: a folder whose convert was killed is never read as a dataset."""
    def manifest(tmp: Path) -> None:  # line by line: a million rows' lines are not held at once
        with open(tmp, "w") as f:
            for row, path, n in written:
                f.write(json.dumps({"split": "train", "data_id": data_id(row), "file": path.as_posix(),
                                    "seq_len": n}) + "\n")

    durable.write_file(out / "manifest.jsonl", manifest)
    dataset = {"version": 1, "last_hidden_states_prenorm": False}  # we apply the norm (why: its TRAINERS entry)
    durable.write_file(out / "dataset.json", lambda tmp: tmp.write_text(json.dumps(dataset, indent=2) + "\n"))


TRAINERS = {t.name: t for t in (
    Trainer("specforge-eagle3", "SpecForge EAGLE-3", "post_norm", ".ckpt", "specforge 0.2.0", eagle3_ids,
            _specforge_eagle3, "specforge train -c CONFIG.yaml data.hidden_states_path=DIR",
            "model.aux_hidden_state_layer_ids (or the draft config's eagle_config.eagle_aux_hidden_state_layer_ids)"),
    Trainer("specforge-dflash", "SpecForge DFlash", None, ".ckpt", "specforge 0.2.0", stored_ids,
            _specforge_dflash, "specforge train -c CONFIG.yaml training.strategy=dflash data.hidden_states_path=DIR",
            "the draft config's dflash_config.target_layer_ids, in this order"),
    Trainer("modelopt", "NVIDIA ModelOpt (EAGLE-3, DFlash)", "post_norm", ".pt", "nvidia-modelopt 0.47.0",
            eagle3_ids, _modelopt, "set data.offline_data_path: DIR and training.answer_only_loss: true (its recipe "
            "leaves it false and trains on every token, the loss mask unread) in the training config of ModelOpt's "
            "examples/speculative_decoding (EAGLE-3 or DFlash), with bf16: true (the files are bf16)",
            "the draft's aux layer ids (eagle_aux_hidden_state_layer_ids; sorted)", ascending=True),
    # post-norm although TorchSpec can norm a pre-norm state itself: its norm is a plain RMSNorm read from
    # `norm_key` (model.norm.weight) where it cannot build the model's own, wrong for 1 + weight norms and for
    # checkpoints that nest the decoder; ours is the model's own class and parameters
    Trainer("torchspec", "TorchSpec (EAGLE-3, DFlash)", "post_norm", ".pt", "TorchSpec's offline dataset at "
            "Dogacel/TorchSpec@0d74194 (torchspec/offline/dataset.py)", eagle3_ids, _torchspec,
            "python -m torchspec.train_entry --config CONFIG.yaml inference.inference_engine_type=offline "
            "inference.offline.data_path=DIR",
            "inference.aux_hidden_states_layers (DFlash: the draft config's target_layer_ids), in this order",
            index=_torchspec_index),
)}
