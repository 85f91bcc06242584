"""Run in a trainer's own venv (conftest.trainer_venv): read folders `streamx convert --format ...` wrote with that
trainer's own reader, as its training does, and save what it hands its training loop per row file, for the test
to compare with the store and with an independent forward. Never imports streamx.

    python trainer_check.py RESULT.pt FORMAT[@LABEL]=DIR [FORMAT[@LABEL]=DIR ...]

specforge-eagle3 / specforge-dflash (specforge 0.2.0): OfflineManifestReader lists the files (as its offline
training does), load_feature_file opens each, and process_offline_eagle3_sample / process_offline_dflash_sample
normalise it for the loader. modelopt (nvidia-modelopt 0.47.0): the files its examples list (`rglob("*.pt")`
under data.offline_data_path), read by OfflineSupervisedDataset with answer_only_loss, and collated by
EagleOfflineDataCollator.

torchspec: no package holds TorchSpec's offline reader (`torchspec` 0.0.1 on PyPI is empty), so `torchspec()` reads
as its published source does at Dogacel/TorchSpec@0d74194 (written after it, not copied; it needs only torch and
runs in the test's own interpreter): OfflineDataset (torchspec/offline/dataset.py) and configure_offline_args,
the data fetcher's reshape (torchspec/training/data_fetcher.py) and resolve_loss_mask (torchspec/data/utils.py).
"""

import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch

MAX_LEN = 4096


def specforge(folder: str, strategy: str) -> list[dict]:
    from specforge.data.preprocessing import process_offline_dflash_sample, process_offline_eagle3_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    keys = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state") if strategy == "eagle3" else \
        ("input_ids", "loss_mask", "hidden_states")
    reader = OfflineManifestReader(folder, strategy=strategy, feature_keys=keys, max_len=MAX_LEN, validate_files=True)
    process = process_offline_eagle3_sample if strategy == "eagle3" else process_offline_dflash_sample
    rows = []
    for ref in reader:
        path = ref.feature_store_uri.removeprefix("file://")
        sample = process(load_feature_file(path), MAX_LEN)
        rows.append({"file": Path(path).name, "num_tokens": ref.num_tokens, **sample})
    return rows


def modelopt(folder: str) -> list[dict]:
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    files = sorted(Path(folder).rglob("*.pt"))
    if not files:  # nothing to train on (its collation below needs two rows)
        return []
    dataset = OfflineSupervisedDataset([str(f) for f in files], answer_only_loss=True)
    rows = [{"file": f.name, **dataset[i]} for i, f in enumerate(files)]
    batch = EagleOfflineDataCollator(train_len=64)([dataset[0], dataset[1]])  # the trainer's collation takes them
    assert batch["base_model_outputs"]["aux_hidden_states"].shape[:2] == (2, 64)
    return rows


def unpack_loss_mask(packed: str) -> torch.Tensor:
    """TorchSpec's unpack_loss_mask: comma-joined lengths of alternating runs of 0s and 1s, 0s first."""
    runs = [int(x) for x in packed.split(",")] if packed else []
    if not runs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.full((n,), i % 2, dtype=torch.long) for i, n in enumerate(runs)])


def torchspec(folder: str) -> list[dict]:
    root = Path(folder).resolve()
    meta = json.loads((root / "dataset.json").read_text())  # absent: "Offline dataset not found"
    assert meta.get("version") == 1, meta
    assert meta.get("last_hidden_states_prenorm") is not None  # configure_offline_args refuses an undeclared one
    seen, rows = set(), []
    for line in (root / "manifest.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        assert entry["split"] in ("train", "eval") and str(entry["data_id"]) not in seen  # else it raises
        seen.add(str(entry["data_id"]))
        path = (root / entry["file"]).resolve()
        assert root in path.parents and path.is_file(), path
        record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # OfflineDataset.load
        assert isinstance(record, dict) and str(record.get("data_id")) == str(entry["data_id"])
        assert all(isinstance(record.get(k), torch.Tensor) for k in ("input_ids", "hidden_states"))
        ids = record["input_ids"]
        mask = unpack_loss_mask(record["packed_loss_mask"])
        mask = torch.nn.functional.pad(mask[:ids.shape[-1]], (0, max(0, ids.shape[-1] - mask.numel())))
        batch = {k: record[k] for k in ("input_ids", "hidden_states", "last_hidden_states") if k in record}
        batch = {k: v[None] for k, v in batch.items()}  # the fetcher: [T] -> [1, T], [T, D] -> [1, T, D]
        rows.append({"file": path.name, "seq_len": entry["seq_len"], "loss_mask": mask,
                     "prenorm": bool(meta["last_hidden_states_prenorm"]), **batch})
    return rows


def main() -> None:
    result, *folders = sys.argv[1:]
    out = {"versions": {}}
    for item in folders:
        key, folder = item.split("=", 1)  # FORMAT or FORMAT@LABEL (two folders of one format)
        fmt = key.split("@")[0]
        if fmt.startswith("specforge"):
            out["versions"]["specforge"] = version("specforge")
            out[key] = specforge(folder, fmt.removeprefix("specforge-"))
        elif fmt == "modelopt":
            out["versions"]["modelopt"] = version("nvidia-modelopt")
            out[key] = modelopt(folder)
        else:
            out[key] = torchspec(folder)
    torch.save(out, result)


if __name__ == "__main__":
    main()
