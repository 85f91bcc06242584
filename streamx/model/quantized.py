"""What a quantized checkpoint's weights take on a GPU that runs them as stored, from its config's
`quantization_config` (no weight read): MXFP4 (gpt-oss: the experts at 4 bits with one 8-bit scale per 32 values,
4.25 bits a weight) and FP8 (DeepSeek-V3/R1, Qwen3 FP8, Kimi K2: the decoder's linear layers at 8 bits with a
float32 scale per 128 x 128 block); everything else (embeddings, head, norms, routers, the modules the config
leaves out) at the compute dtype. transformers keeps them so on the GPUs it has kernels for and dequantizes them to
the compute dtype elsewhere (then the plain sizes hold).
"""

from __future__ import annotations

import math
from fnmatch import fnmatch

from torch import nn
from transformers import PretrainedConfig

BITS = {"mxfp4": 4.25, "fp8": 8 + 32 / (128 * 128)}  # bits a stored weight takes, its scales included
NAMES = {"mxfp4": "MXFP4 experts", "fp8": "FP8 linear layers"}


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


def describe(config: PretrainedConfig) -> str | None:
    q = quantization(config)
    return None if q is None else f"{NAMES[q['quant_method']]} at {BITS[q['quant_method']]:.2f} bits as stored"


def _quantized(method: str, name: str, ndim: int) -> bool:
    if method == "mxfp4":
        return ".experts." in name and ndim == 3
    return "layers." in name and ndim >= 2 and not name.endswith((".gate.weight", ".router.weight"))
