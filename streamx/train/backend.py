"""speculators trains from a streamx store, with no second copy of the hidden states: the `streamx` backend.

    streamx convert STORE --out DIR --hidden-states store        # the Arrow rows, token_freq.pt, store_rows.npy
    python -m streamx.speculators_backend --data-path DIR --hidden-states-backend streamx ...
    torchrun --nproc-per-node 8 -m streamx.speculators_backend --data-path DIR --hidden-states-backend streamx ...

`python -m streamx.speculators_backend` is speculators' own train CLI (`speculators.train`: the same
arguments, the same config resolution) with this backend registered first: speculators finds hidden
states backends in `hs_connectors.HiddenStatesBackend.registry` and collects their flags when it
resolves its config, so the backend must be imported before that. Importing this module registers it.
It runs in speculators' own environment (docs/speculators.md says how to install streamx there).

The contract, checked when the backend starts (`StoreTransfer`):
- Which slots, in which order: the --target-layer-ids, ascending (refused otherwise, and when empty, repeated
  or holding L: streamx.train.meta.backend_layer_ids), then id L, the last layer's output before the final
  norm. Without --target-layer-ids, speculators' own default 2, L//2, L-3. Every id must be in the store.
- What row i is: `get_cached(i)` returns {"hidden_states": bf16 [T, len(ids) + 1, H], "token_ids": int64
  [T]} for the store sample of source row store_rows.npy[i]; bit for bit what `streamx convert` with the same
  store and seed writes in hs_{i}.safetensors, restricted to those slots (an fp8 store's states dequantised
  as speculators' fp8 backend does). A subset of the stored ids serves any drafter whose ids the store holds.
- Beyond the folder's rows, `get_cached` returns None (as a missing hs file: speculators' --on-missing
  decides); `get_generated` returns None (nothing is generated: there is no vLLM server).
- The store must be the one converted (its creation, compat record and committed rows), else the backend
  refuses to start; `--streamx-store PATH` points at a store that moved since.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hs_connectors import HiddenStatesBackend
from hs_connectors.transfer import HiddenStatesTransfer

from ..store import StoreError, open_store
from .dataset import StoreDataset
from .folder import FROM_STORE, META, STORE_ROWS
from .meta import BACKEND, backend_layer_ids


class StoreTransfer(HiddenStatesTransfer):
    """Dataset row i -> {"hidden_states": bf16 [T, K'+1, H], "token_ids": int64 [T]}, read from the store (the
    module's contract)."""

    def __init__(self, data_path: str, store_path: str | None = None, target_layer_ids: list[int] | None = None):
        meta_path = Path(data_path) / META
        if not meta_path.exists():
            raise ValueError(f"{data_path} is not a `streamx convert` folder (no {META}): convert the store with "
                             f"--hidden-states {FROM_STORE}")
        try:
            meta = json.loads(meta_path.read_text())
            meta["identity"]["hidden_states"], meta["source"]["store"]  # noqa: B018 - what is read below
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{meta_path} is damaged: convert the store again (streamx convert STORE --out "
                             f"{data_path} --hidden-states {FROM_STORE} --overwrite)") from None
        if meta["identity"]["hidden_states"] != FROM_STORE:
            raise ValueError(f"{data_path} holds hs files ({meta['hidden_states_dtype']}): train it with speculators' "
                             f"file backend, or convert the store again with --hidden-states {FROM_STORE}")
        self.store_path = store_path or meta["source"]["store"]
        try:
            store = open_store(self.store_path)
        except StoreError as err:
            moved = "" if store_path else "; if it moved, pass --streamx-store NEWPATH"
            raise StoreError(f"{err}{moved}") from None
        _check_unchanged(store, meta, self.store_path)
        layer_ids = backend_layer_ids(target_layer_ids, store.metadata.num_layers)
        rows = np.load(Path(data_path) / STORE_ROWS)
        self.dataset = StoreDataset(self.store_path, layer_ids=layer_ids, rows=rows, store=store)  # opened once

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        if not 0 <= file_idx < len(self.dataset):
            return None  # as a missing hs file: speculators' --on-missing decides
        token_ids, hidden_states = self.dataset.ids_and_states(file_idx)
        return {"hidden_states": hidden_states, "token_ids": token_ids}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return None  # every row is in the store: nothing is generated


def _check_unchanged(store: Any, meta: dict[str, Any], path: str) -> None:
    """The store must be the one converted: the rows it has committed since would not be in the training order."""
    from .convert import order_sha256, training_order

    identity = meta["identity"]
    now = {"store_created": store.metadata.created, "store_compat": asdict(store.metadata.compat),
           "order_sha256": order_sha256(training_order(store.row_ids(), identity["seed"]))}
    changed = [name for name, value in now.items() if json.loads(json.dumps(value)) != identity[name]]
    if changed:
        what = {"store_created": "it was created anew", "store_compat": "another model, layers or tokenization",
                "order_sha256": f"its committed rows changed ({len(store):,} samples now, {identity['rows']:,} when "
                                "converted)"}
        reasons = "; ".join(what[c] for c in changed)
        raise ValueError(f"{path} is not the store this folder was converted from: {reasons}; convert it again "
                         f"(streamx convert {path} --hidden-states {FROM_STORE})")


@HiddenStatesBackend.register(BACKEND)
class StreamxBackend(HiddenStatesBackend):
    """Hidden states read from the streamx store a `convert --hidden-states store` folder names."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        if not any(action.dest == "streamx_store" for action in parser._actions):  # noqa: SLF001 - as hs_connectors
            parser.add_argument("--streamx-store", type=str, default=None,
                                help="The streamx store to read (default: the one recorded by `streamx convert`; "
                                     "a path or s3:// URL, for a store that moved since).")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """No vLLM server: the states are in the store already."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> StoreTransfer:
        return StoreTransfer(data_path, getattr(args, "streamx_store", None), getattr(args, "target_layer_ids", None))

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise ValueError("the streamx backend reads a finished store: it serves no vLLM server")


def main() -> None:
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve())


if __name__ == "__main__":
    main()
