"""What a quantized checkpoint's weights take on a GPU that runs them as stored, from its config's
`quantization_config` (no weight read): MXFP4 (gpt-oss: the experts at 4 bits with one 8-bit scale per 32 values,
4.25 bits a weight) and FP8 (DeepSeek-V3/R1, Qwen3 FP8, Kimi K2: the decoder's linear layers at 8 bits with a
float32 scale per 128 x 128 block); everything else (embeddings, head, norms, routers, the modules the config
leaves out) at the compute dtype. transformers keeps them so on the GPUs it has kernels for and dequantizes them to
the compute dtype elsewhere (then the plain sizes hold).

Loading: on the CPU, or with --dequantize, streamx asks transformers for the dequantized weights (it has no FP8 kernels
there, and would fetch MXFP4's from the hub); on a GPU transformers decides. An FP8 checkpoint whose blocks
transformers would dequantize wrong is refused (`check_dequantizable`). What was loaded is read back from the
model (`loaded`) and said in the log and the store. The states are always the loaded model's own forward: the start-up
check and the audit run on it.
"""

from __future__ import annotations

import math
import re
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import FineGrainedFP8Config, Mxfp4Config, PretrainedConfig

BITS = {"mxfp4": 4.25, "fp8": 8 + 32 / (128 * 128)}  # bits a stored weight takes, its scales included
NAMES = {"mxfp4": "MXFP4 experts", "fp8": "FP8 linear layers"}
KEPT = "kept as stored"


def quantization(config: PretrainedConfig) -> dict | None:
    """The checkpoint's quantization_config as a dict, where it is one sized here."""
    q = getattr(config, "quantization_config", None)
    q = q if isinstance(q, dict) or q is None else q.to_dict()
    return q if q and q.get("quant_method") in BITS else None


def weight_bytes(model: nn.Module, width: int) -> dict[str, int]:
    """Each parameter's bytes as the checkpoint stores it (`model`: built from its config, unquantized)."""
    q = quantization(model.config)
    kept = [m.rstrip(".*") for m in (q or {}).get("modules_to_not_convert") or []]
    out = {}
    for name, p in model.named_parameters():
        stored = q is not None and _quantized(q["quant_method"], name, p.ndim) and \
            not any(fnmatch(name, f"{m}*") for m in kept)
        out[name] = math.ceil(p.numel() * BITS[q["quant_method"]] / 8) if stored else p.numel() * width
    return out


def describe(config: PretrainedConfig, dequantize: bool = False) -> str | None:
    """`plan`'s line on the weights a quantized checkpoint's sizes count (`dequantize`: --dequantize's)."""
    q = quantization(config)
    if q is None:
        return None
    if dequantize:
        return f"{NAMES[q['quant_method']]} dequantized to the compute dtype (--dequantize), sized so"
    return (f"{NAMES[q['quant_method']]} at {BITS[q['quant_method']]:.2f} bits as stored, as transformers keeps them "
            "on GPUs it has kernels for (dequantized elsewhere: plan --dequantize sizes that)")


def load_options(config: PretrainedConfig, device: str, dequantize: bool) -> dict:
    """from_pretrained's quantization_config: the checkpoint's own, dequantized on the CPU and where asked."""
    q = quantization(config)
    if q is None or not (dequantize or device.startswith("cpu")):
        return {}
    kind = Mxfp4Config if q["quant_method"] == "mxfp4" else FineGrainedFP8Config
    return {"quantization_config": kind.from_dict({**q, "dequantize": True})}


def dequantized_on_load(config: PretrainedConfig, device: str, dequantize: bool) -> bool:
    """Whether the checkpoint will load dequantized: on the CPU and where asked (load_options), and on a GPU that
    transformers has no kernels for (FP8 below compute capability 8.9, MXFP4 below 7.5)."""
    q = quantization(config)
    if q is None:
        return False
    if dequantize or device.startswith("cpu"):
        return True
    least = (8, 9) if q["quant_method"] == "fp8" else (7, 5)
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) < least


def check_dequantizable(config: PretrainedConfig, folder: Path) -> None:
    """Refuse an FP8 checkpoint that transformers would dequantize wrong, from its files' headers (no weight read):
    it takes a weight's block size from its scales' grid, which is wrong where the last block is partial (DeepSeek-V3's
    kv_a_proj_with_mqa, 576 rows in blocks of 128): the scales then land on the wrong rows, or it raises."""
    q = quantization(config)
    if q is None or q["quant_method"] != "fp8" or not q.get("weight_block_size"):
        return
    shapes = {}  # every tensor of every shard: a weight and its scales may lie in different files
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    block = q["weight_block_size"]
    for scales in sorted(n for n in shapes if n.endswith(".weight_scale_inv")):
        weight = scales.removesuffix("_scale_inv")
        if weight not in shapes or len(shapes[scales]) < 2:  # a scale per tensor or per row: no blocks
            continue
        shape, grid = shapes[weight][-2:], shapes[scales][-2:]
        if any(n > 1 and size % b for size, n, b in zip(shape, grid, block, strict=True)):
            raise ValueError(
                f"transformers dequantizes FP8 blocks by the scales' grid, wrong for {weight} ({shape[0]} x "
                f"{shape[1]} in blocks of {block[0]} x {block[1]}, the last one partial): streamx will not store "
                "states of misplaced scales; run it on a GPU with FP8 kernels (compute capability 8.9+, without "
                "--dequantize)")


def loaded(model: nn.Module, config: PretrainedConfig, dequantize: bool) -> str | None:
    """What a quantized checkpoint's weights were loaded as (`config`: its own, read before loading), from the model's
    modules: transformers' quantized ones, or plain ones holding the dequantized weights."""
    q = quantization(config)
    if q is None:
        return None
    name = NAMES[q["quant_method"]]
    if kept_quantized(model):
        return f"{name} {KEPT} ({BITS[q['quant_method']]:.2f} bits, transformers' kernels)"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    why = "as asked (--dequantize)" if dequantize else \
        "on the CPU" if next(model.parameters()).device.type == "cpu" else "transformers has no kernels for them here"
    return f"{name} dequantized to {dtype} on load ({why}): the states are those of the checkpoint's values"


def kept(weights: str | None) -> bool | None:
    """From a store's `weights` (what `loaded` said): kept as stored, dequantized, or None (not quantized, or a store
    older than the field)."""
    return None if weights is None else KEPT in weights


def without_kernels(err: Exception, config: PretrainedConfig | None, options: dict) -> Exception:
    """A load's error, with the way out where transformers failed to fetch or run a quantized checkpoint's kernels
    (MXFP4's come from the hub, which a cluster's nodes often cannot reach); any other error as it is."""
    q = quantization(config)
    if q is None or options or not re.search(r"\bkernels?\b", str(err), re.IGNORECASE):
        return err
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return ValueError(f"transformers could not load the {NAMES[q['quant_method']]} as stored ({first.rstrip('.')}): "
                      "streamx run --dequantize loads them dequantized, in 2-4x the memory (plan --dequantize sizes "
                      "it)")


def kept_quantized(model: nn.Module) -> bool:
    """Whether transformers kept quantized weights (its FP8 linear layers and experts, MXFP4 experts) rather than
    plain dequantized ones."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear  # (seconds to import: only here)
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    return any(isinstance(m, (FP8Linear, FP8Experts, Mxfp4GptOssExperts)) for m in model.modules())


def _quantized(method: str, name: str, ndim: int) -> bool:
    if method == "mxfp4":
        return ".experts." in name and ndim == 3
    return "layers." in name and ndim >= 2 and not name.endswith((".gate.weight", ".router.weight"))
