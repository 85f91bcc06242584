"""Run in a trainer's own venv (conftest.trainer_venv): read folders `streamx convert --format ...` wrote with that
trainer's own reader, as its training does, and save what it hands its training loop per row file, for the test
to compare with the store and with an independent forward. Never imports streamx.

    python trainer_check.py RESULT.pt FORMAT=DIR [FORMAT=DIR ...]

specforge-eagle3 / specforge-dflash (specforge 0.2.0): OfflineManifestReader lists the files (as its offline
training does), load_feature_file opens each, and process_offline_eagle3_sample / process_offline_dflash_sample
normalise it for the loader. modelopt (nvidia-modelopt 0.47.0): the files its examples list (`rglob("*.pt")`
under data.offline_data_path), read by OfflineSupervisedDataset with answer_only_loss, and collated by
EagleOfflineDataCollator.
"""

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
    dataset = OfflineSupervisedDataset([str(f) for f in files], answer_only_loss=True)
    rows = [{"file": f.name, **dataset[i]} for i, f in enumerate(files)]
    batch = EagleOfflineDataCollator(train_len=64)([dataset[0], dataset[1]])  # the trainer's collation takes them
    assert batch["base_model_outputs"]["aux_hidden_states"].shape[:2] == (2, 64)
    return rows


def main() -> None:
    result, *folders = sys.argv[1:]
    out = {"versions": {}}
    for item in folders:
        fmt, folder = item.split("=", 1)
        if fmt.startswith("specforge"):
            out["versions"]["specforge"] = version("specforge")
            out[fmt] = specforge(folder, fmt.removeprefix("specforge-"))
        else:
            out["versions"]["modelopt"] = version("nvidia-modelopt")
            out[fmt] = modelopt(folder)
    torch.save(out, result)


if __name__ == "__main__":
    main()
