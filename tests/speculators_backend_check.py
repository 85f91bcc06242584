"""Runs inside the isolated speculators==0.9.0 venv with streamx installed as docs/speculators.md says (see
tests/test_speculators_backend.py): the `streamx` backend against speculators' own file backends.

For each `FILES_DIR=STORE_DIR[=IDS]` argument (a normal convert and a `--hidden-states store` convert of one
store with one seed; IDS, comma-separated, a --target-layer-ids subset), every row's `get_cached` from the
streamx backend is compared with what speculators' file or fp8 backend loads from FILES_DIR: token ids
equal, hidden states bit for bit (the subset's slots and the last one). The rows are also read through a
torch DataLoader with spawned workers (the transfer pickled, the store opened in each worker). Prints one
JSON document.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from hs_connectors import HiddenStatesBackend

import streamx.speculators_backend  # noqa: F401 - registers the backend, as `python -m streamx.speculators_backend`


def backend(name: str, data: str, **args) -> object:
    namespace = argparse.Namespace(**{"hidden_states_path": None, "streamx_store": None, "target_layer_ids": None,
                                      **args})
    return HiddenStatesBackend.registry[name].from_train_args(namespace, data)


class Rows(torch.utils.data.Dataset):
    def __init__(self, transfer, n: int):
        self.transfer, self.n = transfer, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.transfer.get_cached(i)


def compare(files: str, store: str, ids: list[int] | None) -> dict:
    meta = json.loads((Path(files) / "streamx_meta.json").read_text())
    stored = meta["layer_ids"]
    theirs = backend("fp8" if meta["hidden_states_dtype"] == "fp8" else "file", files)
    ids = ids or meta["target_layer_ids"]  # as the saved train commands pass them
    ours = backend("streamx", store, target_layer_ids=ids)
    wanted = [*ids, meta["num_layers"]]
    slots = [stored.index(i) for i in wanted]
    n, equal, shapes = meta["counts"]["rows"], 0, set()
    for i in range(n):
        a, b = theirs.get_cached(i), ours.get_cached(i)
        same = (torch.equal(a["token_ids"], b["token_ids"]) and b["hidden_states"].dtype == a["hidden_states"].dtype
                and torch.equal(a["hidden_states"][:, slots].contiguous().view(torch.int16),
                                b["hidden_states"].view(torch.int16)))
        equal += int(same)
        shapes.add(tuple(b["hidden_states"].shape[1:]))
    loader = torch.utils.data.DataLoader(Rows(ours, n), batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn")
    in_workers = 0
    for i, item in enumerate(loader):  # each worker opened the store itself: the same tensors, bit for bit
        ref = theirs.get_cached(i)
        in_workers += int(torch.equal(item["token_ids"], ref["token_ids"]) and torch.equal(
            ref["hidden_states"][:, slots].contiguous().view(torch.int16), item["hidden_states"].view(torch.int16)))
    return {"rows": n, "equal": equal, "in_workers_equal": in_workers, "slots": slots, "shapes": sorted(shapes),
            "beyond_last_row": ours.get_cached(n) is None}


def refusal(data: str, **args) -> str:
    try:
        backend("streamx", data, **args)
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "accepted"


def speculators_requirements() -> list[str]:
    """speculators' own requirements that the installed packages no longer meet (torchvision and torchaudio
    are removed on purpose: tests/conftest.py says why)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    broken = []
    for line in importlib.metadata.requires("speculators") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}) or req.name in ("torchvision",
                                                                                            "torchaudio"):
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            broken.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            broken.append(f"{req}: {version} installed")
    return broken


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pairs", nargs="*", help="FILES_DIR=STORE_DIR[=IDS]")
    parser.add_argument("--refuse", action="append", default=[], help="NAME=STORE_DIR[=STREAMX_STORE][=IDS]")
    opts = parser.parse_args()
    out = {"pairs": {}, "refusals": {}, "speculators_requirements_broken": speculators_requirements()}
    for pair in opts.pairs:
        files, store, *ids = pair.split("=")
        out["pairs"][pair] = compare(files, store, [int(i) for i in ids[0].split(",")] if ids else None)
    for item in opts.refuse:
        name, data, *rest = item.split("=")
        args = {}
        if rest and rest[0]:
            args["streamx_store"] = rest[0]
        if len(rest) > 1:
            args["target_layer_ids"] = [int(i) for i in rest[1].split(",")]
        out["refusals"][name] = refusal(data, **args)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
