"""Run in a trainer's own venv (conftest.trainer_venv): training steps of that trainer's own draft on the CPU, from
folders `streamx convert --format ...` wrote, and the losses it reports saved as JSON. Never imports streamx.

    python trainer_train.py RESULT.json specforge TARGET WORK eagle3=DIR:IDS [dflash=DIR:IDS]
    python trainer_train.py RESULT.json modelopt TARGET WORK eagle3=DIR:IDS [dflash=DIR:IDS]

specforge (0.2.0): its own command, `python -m specforge.cli train -c CONFIG.yaml`, in offline mode. On a CPU it
needs `training.fsdp_sharding: NO_SHARD` (DDP over gloo: FSDP wants an accelerator) and TRITON_INTERPRET=1 (its
loss is a Triton kernel); its target head reads lm_head through a `*.index.json`, so a single-file checkpoint gets
one (in WORK, the checkpoint's files linked). The DFlash draft config is the one SpecForge generates for the
target, with `dflash_config.target_layer_ids` set to the converted layers. Where the draft's vocabulary is smaller
than the target's (EAGLE-3's 32,000), SpecForge builds its vocab mapping from the folder's ids and loss masks.
modelopt (0.47.0): the target converted by `mtsp.convert` into its EAGLE-3 model (`eagle_offline=True`, the
converted aux layers) or its DFlash model (`dflash_offline=True`, the converted layers as `target_layer_ids`, one
draft layer each, token 0 as the mask token), fed batches of its OfflineSupervisedDataset and
EagleOfflineDataCollator, its loss stepped by AdamW (its examples drive the same forward through the HF Trainer).
TorchDynamo off: ModelOpt compiles parts of the draft, a minute of autotuning on a CPU for no difference to what is
computed.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

STEPS = 2


def specforge_target(target: str, work: Path) -> tuple[str, str]:
    """A checkpoint folder SpecForge's TargetHead reads, and the key of its lm_head (tied: the embedding)."""
    from safetensors import safe_open

    config = json.loads((Path(target) / "config.json").read_text())
    key = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if list(Path(target).glob("*.index.json")):
        return target, key
    folder = work / "target"
    folder.mkdir(parents=True, exist_ok=True)
    for f in Path(target).iterdir():
        (folder / f.name).unlink(missing_ok=True)
        (folder / f.name).symlink_to(f.resolve())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(folder), key


def specforge_steps(strategy: str, folder: str, ids: list[int], target: str, lm_head_key: str, work: Path) -> dict:
    import yaml

    model = {"target_model_path": target, "lm_head_key": lm_head_key, "torch_dtype": "bfloat16"}
    training = {"strategy": strategy, "fsdp_sharding": "NO_SHARD", "max_steps": STEPS, "log_interval": 1,
                "attention_backend": "sdpa"}
    if strategy == "eagle3":
        model["aux_hidden_state_layer_ids"] = ids
        training["ttt_length"] = 2
    data = {"hidden_states_path": folder, "max_length": 512, "cache_dir": str(work / f"cache-{strategy}")}
    config = {"model": model, "data": data, "training": training, "output_dir": str(work / f"out-{strategy}")}
    path = work / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(config))
    if strategy == "dflash":  # SpecForge's generated draft config for the target, reading the converted layers
        from specforge.application import resolve_run
        from specforge.config.schema import load_config
        from specforge.training.model_loading import resolve_draft_config

        resolved = resolve_run(load_config(str(path)))
        draft = resolve_draft_config(resolved.config, provider=resolved.algorithm.providers.model.draft_config)
        draft = draft.to_dict()
        draft["dflash_config"] = {**(draft.get("dflash_config") or {}), "target_layer_ids": ids}
        (work / "dflash_draft.json").write_text(json.dumps(draft))
        model["draft_model_config"] = str(work / "dflash_draft.json")
        path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "train", "-c", str(path)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"specforge train ({strategy}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    steps = [ast.literal_eval(line.split(": ", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith("step ")]
    import torch

    state = torch.load(Path(config["output_dir"]) / f"specforge-run-step{STEPS}" / "training_state.pt",
                       weights_only=False)
    # a draft vocabulary smaller than the target's: SpecForge maps it from the folder's ids and loss masks
    mappings = list(Path(data["cache_dir"]).glob("vocab_mapping/*.pt"))
    mapping = torch.load(mappings[0]) if mappings else None
    return {"losses": [s["loss"] for s in steps], "grad_norms": [s["grad_norm"] for s in steps],
            "global_step": state["global_step"], "rows_read": state["dataset_size"],
            "draft_vocab": None if mapping is None else int(mapping["t2d"].sum())}


def modelopt_steps(strategy: str, folder: str, ids: list[int], target: str) -> dict:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import modelopt.torch.speculative as mtsp
    import torch
    from modelopt.torch.speculative.config import DFLASH_DEFAULT_CFG, EAGLE3_DEFAULT_CFG
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    if strategy == "eagle3":
        config = {**EAGLE3_DEFAULT_CFG["config"], "eagle_offline": True}
        config["eagle_architecture_config"] = {**config["eagle_architecture_config"],
                                               "eagle_aux_hidden_state_layer_ids": ids}
        mtsp.convert(model, [("eagle", config)])
    else:  # ModelOpt wants one draft layer per target layer, and the target's layer count as its offline loader
        model.config.num_orig_hidden_layers = model.config.num_hidden_layers
        config = {**DFLASH_DEFAULT_CFG["config"], "dflash_offline": True, "dflash_mask_token_id": 0,
                  "dflash_architecture_config": {"num_hidden_layers": len(ids), "target_layer_ids": ids}}
        mtsp.convert(model, [("dflash", config)])
    files = sorted(str(f) for f in Path(folder).rglob("*.pt"))
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    collate = EagleOfflineDataCollator(train_len=128)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    model.train()
    losses, grad_norms = [], []
    for step in range(STEPS):
        out = model(**collate([dataset[2 * step], dataset[2 * step + 1]]))
        out.loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(trained, 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
    return {"losses": losses, "grad_norms": grad_norms, "global_step": STEPS, "rows_read": len(dataset)}


def main() -> None:
    result, trainer, target, work, *folders = sys.argv[1:]
    work_dir = Path(work)
    work_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for item in folders:
        strategy, spec = item.split("=", 1)
        folder, ids = spec.rsplit(":", 1)
        layer_ids = [int(k) for k in ids.split(",")]
        if trainer == "specforge":
            checkpoint, key = specforge_target(target, work_dir)
            out[strategy] = specforge_steps(strategy, folder, layer_ids, checkpoint, key, work_dir)
        else:
            out[strategy] = modelopt_steps(strategy, folder, layer_ids, target)
    Path(result).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
