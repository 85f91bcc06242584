"""The fp8 storage format (--storage fp8), speculators' own: float8_e4m3fn states with one float32
scale per token over all K x H values of the token (docs/store.md, "fp8 storage").

    scale = max(amax(|x|) / 448, 1e-12)     value = fp8(x / scale)     dequantised = bf16(value) * bf16(scale)

The same float32 operations as speculators' quantiser (hs_connectors.fp8_utils), so the bytes are
identical to it (tests/test_fp8.py), on whichever device the batch is.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
QUANTIZE_TOKENS = 4096  # tokens per step of quantize_fp8: bounds its float32 temporary


def quantize_fp8(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [N, K, H] (bf16 or wider) -> (float8_e4m3fn [N, K, H], float32 scales [N]), on packed's device."""
    N = packed.shape[0]
    values = torch.empty(packed.shape, dtype=FP8, device=packed.device)
    scales = torch.empty(N, dtype=torch.float32, device=packed.device)
    for a in range(0, N, QUANTIZE_TOKENS):
        x = packed[a : a + QUANTIZE_TOKENS].float()
        scale = (x.abs().amax(dim=(1, 2)) / FP8_MAX).clamp_(min=1e-12)
        scales[a : a + QUANTIZE_TOKENS] = scale
        values[a : a + QUANTIZE_TOKENS] = (x / scale[:, None, None]).to(FP8)
    return values, scales


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [T, K, H] and float32 scales [T] -> bf16, as speculators' fp8 loader does (scale rounded to bf16)."""
    return values.to(torch.bfloat16) * scales.to(torch.bfloat16)[:, None, None]
