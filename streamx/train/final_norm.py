"""The target's own final norm, read from its checkpoint without loading the model, for the trainers that take the
last state after it (SpecForge, ModelOpt): streamx stores id L before the norm (docs/layers.md); and its embeddings
and lm_head, for the trainers whose caches hold them or the target's next-token probabilities (NeMo AutoModel).

The norm is the model's own module class (transformers builds the model on the meta device, so Gemma's and
Qwen3-Next's `1 + weight`, an epsilon or a bias are the model's), with only its own parameters read from the
checkpoint's safetensors; it runs in float32 and the caller casts to the trainer's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from ..model.capture import find_decoder
from ..model.load import causal_lm, fingerprint_weights


class FinalNormError(ValueError):
    """The final norm cannot be read: one line saying why and what to pass."""


class FinalNorm:
    """`norm(states)`: the target's final norm over [..., H] states, in float32."""

    def __init__(self, module: nn.Module, name: str):
        self.module, self.name = module.float().eval(), name  # name: its parameters' key prefix in the checkpoint

    @classmethod
    def from_checkpoint(cls, path: str, fingerprint: str | None = None) -> FinalNorm:
        """The final norm of the model at `path` (a local folder with safetensors, or a hub id in the local cache);
        with `fingerprint` (the store's weights fingerprint), a checkpoint whose weights differ is refused."""
        folder = _local_folder(path)
        if fingerprint and not fingerprint.startswith("random-init:") and fingerprint_weights(folder) != fingerprint:
            raise FinalNormError(f"the checkpoint at {folder} is not the one the store was made with (its weights "
                                 "fingerprint differs); give the very weights the store was computed from (convert "
                                 "--model DIR, verify --checkpoint DIR)")
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = causal_lm(lambda auto: auto.from_config(config))
        norm = find_decoder(model).norm
        if norm is None:
            raise FinalNormError(f"{type(model).__name__} has no final norm streamx can find (a module its decoder "
                                 "holds after its layers, with a norm's weight)")
        name = next(n for n, m in model.named_modules() if m is norm)
        norm.to_empty(device="cpu")
        tensors = _checkpoint_tensors(folder, name, [p for p, _ in norm.named_parameters()], "the final norm")
        for p, value in tensors.items():
            norm.get_parameter(p).data.copy_(value)
        return cls(norm, name)

    @torch.no_grad()
    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        return self.module(states.float())


def embeddings_and_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embeddings and lm_head weights, each [vocab, hidden], read from its checkpoint (a tied
    lm_head, which the checkpoint does not hold: the embeddings)."""
    folder = _local_folder(path)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = causal_lm(lambda auto: auto.from_config(config))
    names = {module: name for name, module in model.named_modules()}
    embed = _checkpoint_tensors(folder, names[model.get_input_embeddings()], ["weight"], "the embeddings")["weight"]
    try:
        head = _checkpoint_tensors(folder, names[model.get_output_embeddings()], ["weight"], "the lm_head")["weight"]
    except FinalNormError:
        if not getattr(config.get_text_config(), "tie_word_embeddings", False):
            raise
        head = embed
    return embed, head


def _local_folder(path: str) -> Path:
    if Path(path).is_dir():
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure is "not here"
        raise FinalNormError(f"the target's checkpoint {path} is not on this machine; give the folder of the weights "
                             "the store was made with (convert --model DIR, verify --checkpoint DIR): its final norm "
                             "is read from it") from None


def _checkpoint_tensors(folder: Path, name: str, params: list[str], what: str) -> dict[str, torch.Tensor]:
    """`what`'s parameters from the checkpoint: at `name` (the in-memory path), or, where the checkpoint names
    the decoder otherwise (a multimodal one saved before transformers moved its language model), the one key that
    ends as it does outside the layers and any vision tower."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        files = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                files.update(dict.fromkeys(f.keys(), path))
    found = {}
    for p in params:
        key = f"{name}.{p}"
        if key not in files:
            tail = ".".join([*name.split(".")[-1:], p])
            near = [k for k in files if k.endswith("." + tail) and ".layers." not in k
                    and not any(part in k for part in ("vision", "visual", "mtp", "audio"))]
            if len(near) != 1:
                raise FinalNormError(f"cannot find {what}'s {p} in {folder}: no key {key}"
                                     f"{'' if not near else ' and several like it: ' + ', '.join(near[:3])}")
            key = near[0]
        with safe_open(str(files[key]), "pt") as f:
            found[p] = f.get_tensor(key)
    return found
