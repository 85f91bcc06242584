"""A forward's compute per token, for `plan`'s hours where no rate was measured: 2 FLOPs per active weight of the
decoder (a MoE's experts at top-k / E; no embeddings, no LM head: streamx runs neither's matmul) and the attention's
two matmuls over the tokens before it (a sliding window's at most its width), from the model built on the meta
device (no weight read).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .residual import layer_configs, query_width

DEFAULT_MFU = 0.4  # of the GPU's peak a long batched forward sustains: an assumption, said wherever it is used
H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 or H200 SXM


@dataclass(frozen=True)
class Card:
    """A GPU `plan --gpu` knows: its name, dense bf16 peak and memory, from its data sheet."""

    name: str
    tflops: float
    memory_gb: float


# dense bf16 tensor peaks (the sheets' sparse figures halved) and memory per GPU: H100 and H200 SXM; B200 and B300
# from HGX B200 / B300 (36 PFLOPS sparse and 1.4 / 2.3 TB over 8 GPUs); A100 SXM 80 GB; RTX PRO 6000 Blackwell from
# its 4,000 FP4 TOPS (sparse): 2,000 dense, 500 at bf16's quarter rate
CARDS = {"h100": Card("H100", H100_BF16_TFLOPS, 80), "h200": Card("H200", H100_BF16_TFLOPS, 141),
         "b200": Card("B200", 2250.0, 180), "b300": Card("B300", 2250.0, 288),
         "rtx-pro-6000": Card("RTX PRO 6000 Blackwell", 500.0, 96), "a100": Card("A100", 312.0, 80)}


@dataclass(frozen=True)
class TokenCost:
    active_params: int  # decoder weights a token passes through
    attention: float  # FLOPs of its attention at the given context

    @property
    def flops(self) -> float:
        return 2 * self.active_params + self.attention


def token_cost(model: nn.Module, mean_context: float) -> TokenCost:
    """The forward FLOPs of one token that attends to `mean_context` tokens on average."""
    text = model.config.get_text_config()
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or \
        getattr(text, "n_routed_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "experts_per_token", None)
    active = 0
    for name, p in model.named_parameters():
        if "layers." not in name:
            continue
        active += p.numel() * top_k // experts if experts and top_k and ".experts." in name else p.numel()
    layers = layer_configs(model.config)  # (each with its own heads and sizes: Gemma 4)
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * len(layers))
    window = getattr(text, "sliding_window", None) or mean_context
    attention = sum(query_width(layer) * (min(mean_context, window) if t == "sliding_attention" else mean_context)
                    for layer, t in zip(layers, types, strict=False)
                    if t.endswith("attention") and t != "linear_attention")
    return TokenCost(active, 4 * attention)  # QK^T and AV: 2 FLOPs a multiply-add, each


def assumed_rate(cost: TokenCost, gpus: int, mfu: float, tflops: float, card: str = "") -> tuple[float, str]:
    """Tokens/s of `gpus` GPUs (`card`, where named) of `tflops` peak at `mfu` of it, and the assumption in words."""
    rate = gpus * mfu * tflops * 1e12 / cost.flops
    return rate, (f"assumed: {gpus} {card + ' ' if card else ''}GPU{'s' if gpus > 1 else ''} at {mfu:.0%} (an "
                  f"assumed MFU) of {tflops:,.0f} TFLOPS for "
                  f"{cost.flops / 1e9:,.1f} GFLOPs a token ({cost.active_params / 1e9:,.1f} B active weights and "
                  "attention); --tokens-per-s from streamx bench, or --calibrate, for a measured rate")
