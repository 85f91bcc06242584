"""Run in NeMo AutoModel's venv (conftest.trainer_venv): read caches `streamx convert --format nemo-dspark|nemo-eagle3`
wrote with nemo-automodel 0.7.0's own code, as its recipes' cached path reads them, and save every sample for the
test to compare with the store and with an independent forward. Never imports streamx.

    python nemo_check.py RESULT.pt TARGET FORMAT[@LABEL]=DIR [FORMAT[@LABEL]=DIR ...]

Each folder: `read_manifest` (the format version; DSpark's `complete`), the recipe's own manifest check against the
target's config and the settings the convert's train line gives (seq_length, target_layer_ids,
mask_generation_prompt true, CUDA's bf16): `_validate_cached_dspark_manifest` and `ensure_supervision_options_match`
as train_dspark calls them, `_validate_cached_eagle3_manifest` as train_eagle3 does (each function run from its
recipe module's source, whose imports pull torchao, torchdata and Triton kernels that reading a cache never uses);
then the recipe's dataloader over the cache (CachedDSparkDataset / CachedEagle3Dataset and their collation), its
target weights reader, and every sample. A folder that cannot be read records the error instead.
"""

import ast
import importlib.util
import logging
import sys
from pathlib import Path

import torch
from transformers import AutoConfig


def recipe_function(module: str, name: str, namespace: dict):
    """NeMo's own function `name` from the source of recipe `module`, run with `namespace` as its globals."""
    source = Path(importlib.util.find_spec(module).origin)
    tree = ast.parse(source.read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    scope = dict(namespace)
    exec(compile(ast.Module(body=found, type_ignores=[]), str(source), "exec"), scope)
    return scope[name]


def dspark(folder: str, config) -> dict:
    from nemo_automodel.components.datasets.llm import dspark_cache as cache
    from nemo_automodel.components.datasets.llm.offline_cache import ensure_supervision_options_match

    validate = recipe_function("nemo_automodel.recipes.llm.train_dspark", "_validate_cached_dspark_manifest",
                               {"torch": torch, "DTYPE_MAP": cache.DTYPE_MAP, "logger": logging.getLogger("dspark")})
    manifest = cache.read_manifest(folder)
    validate(folder, manifest, config, manifest["target_layer_ids"], target_model=manifest["target_model"],
             target_model_type=config.model_type, seq_length=manifest["seq_length"], compute_dtype=torch.bfloat16)
    ensure_supervision_options_match(manifest, {"mask_reasoning_content": False, "mask_generation_prompt": True},
                                     cache_name="DSpark", cache_dir=folder, producer_name="precompute_dspark")
    embed, head = cache.read_target_weight_modules(folder)
    loader = cache.build_cached_dspark_dataloader(cache_dir=folder, batch_size=2, shuffle=False)
    batch = next(iter(loader))
    assert batch["target_hidden_states"].shape[:2] == (2, manifest["seq_length"])
    return {"manifest": manifest, "embed": embed.weight, "head": head.weight,
            "samples": [loader.dataset[i] for i in range(len(loader.dataset))]}


def eagle3(folder: str, config) -> dict:
    from nemo_automodel.components.datasets.llm import eagle3_cache as cache
    from nemo_automodel.components.datasets.llm.offline_cache import ensure_supervision_options_match

    validate = recipe_function("nemo_automodel.recipes.llm.train_eagle3", "_validate_cached_eagle3_manifest",
                               {"ensure_supervision_options_match": ensure_supervision_options_match})
    manifest = cache.read_manifest(folder)
    validate(folder, manifest, config, mask_reasoning_content=False, mask_generation_prompt=True)
    loader = cache.build_cached_eagle3_dataloader(cache_dir=folder, batch_size=2, shuffle=False)
    batch = next(iter(loader))
    assert batch["target_probs"].shape == (2, manifest["seq_length"], manifest["draft_vocab_size"])
    return {"manifest": manifest, "embed": cache.read_target_embeddings(folder),
            "samples": [loader.dataset[i] for i in range(len(loader.dataset))]}


def main() -> None:
    result, target, *folders = sys.argv[1:]
    config = AutoConfig.from_pretrained(target)
    out = {}
    for item in folders:
        key, folder = item.split("=", 1)
        read = eagle3 if key.split("@")[0] == "nemo-eagle3" else dspark
        try:
            out[key] = read(folder, config)
        except Exception as err:  # noqa: BLE001 - what NeMo says of the folder is the test's to judge
            out[key] = {"error": f"{type(err).__name__}: {err}"}
    torch.save(out, result)


if __name__ == "__main__":
    main()
