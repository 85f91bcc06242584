"""What a decoder's layers pass on from one to the next, per token, and how many layers it has.

Most decoders pass one hidden-wide residual vector per token. Some pass several streams and contract them only after
the last layer: hyper-connections (DeepSeek-V4, GLM-5-next: [B, S, streams, D] between layers; Qwen4-exp: the
same flattened to [B, S, streams * D]) and Gemma 3n's AltUp ([streams, B, S, D]). There is then no hidden-wide
"output of layer k": a layer's output is the whole multi-stream residual, as transformers' own
`output_hidden_states` holds it at every id but the last (whose entry it replaces by the contracted, normed state).
streamx stores that whole residual at every id, id L included (before the contraction, as before a final norm):
streams x D values per token, stream after stream, which the store's metadata, `inspect` and `plan` say.

The layer count is the model's: its decoder's layer list (and a config's count of decoder layers before a model
is loaded), not a config field that counts something else (LongCat-Flash's num_hidden_layers counts its attention
sublayers, twice the decoder layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Residual:
    """The residual a decoder's layers pass on: `streams` vectors of `hidden_size` per token."""

    streams: int
    hidden_size: int  # one stream's width (the config's hidden_size)
    streams_first: bool = False  # [streams, B, S, D] (AltUp) rather than [B, S, streams, D] or [B, S, streams * D]
    kind: str = ""  # what makes the streams, for people

    @property
    def width(self) -> int:
        """Values stored per token and layer id."""
        return self.streams * self.hidden_size

    def flat(self, hidden: torch.Tensor) -> torch.Tensor:
        """A layer's input or output as [B, S, width]."""
        if self.streams == 1:
            return hidden
        if self.streams_first:
            hidden = hidden.permute(1, 2, 0, 3)
        return hidden.reshape(*hidden.shape[:2], self.width)

    def describe(self) -> str:
        if self.streams == 1:
            return f"hidden {self.hidden_size}"
        return (f"hidden {self.width} per token: the whole residual, {self.streams} streams of {self.hidden_size} "
                f"({self.kind}; id L before their contraction)")


def residual_of(config) -> Residual:
    """The residual of a model with this (or this composite) config."""
    text = config.get_text_config()
    for field, kind, first in (("hc_mult", "hyper-connections", False), ("hc_count", "hyper-connections", False),
                               ("altup_num_inputs", "AltUp", True)):
        streams = getattr(text, field, None)
        if isinstance(streams, int) and streams > 1:
            return Residual(streams, text.hidden_size, first, kind)
    return Residual(1, declared(text, "hidden_size"))


def layer_configs(config) -> list:
    """Each layer's settings, as the config counts layers (num_hidden_layers: LongCat-Flash's counts its attention
    sublayers, two per decoder layer): its own config where the (text) config declares settings per layer
    (transformers' per_layer_config: Gemma 4's head sizes and key-value heads, which the global config refuses to
    give), else the text config itself, once per layer."""
    text = config.get_text_config()
    if getattr(text, "is_heterogeneous", False):
        return list(text.per_layer_config)
    return [text] * text.num_hidden_layers


def query_width(layer) -> int:
    """A layer's attention query width (heads x head size) from its config; 0 for a layer without attention heads
    (Mamba's mixers)."""
    heads = getattr(layer, "num_attention_heads", None)
    if not heads:
        return 0
    return heads * (getattr(layer, "head_dim", None) or layer.hidden_size // heads)


def config_layers(config) -> int:
    """The decoder layers a (text) config declares: `num_layers` where the config keeps it beside a
    num_hidden_layers that counts sublayers (LongCat-Flash), else num_hidden_layers."""
    layers, total = getattr(config, "num_layers", None), declared(config, "num_hidden_layers")
    return layers if isinstance(layers, int) and 0 < layers < total else total


def declared(config, name: str) -> int:
    """A size every decoder's config declares (hidden_size, num_hidden_layers); refused in one line where the model
    is made of sub-models of their own sizes instead (BLT)."""
    value = getattr(config, name, None)
    if not isinstance(value, int):
        raise ValueError(f"{type(config).__name__} declares no {name}: streamx runs decoders whose layers pass one "
                         "hidden state per token, and this model is made of sub-models of their own sizes (as BLT's "
                         "patcher, byte encoder, global transformer and byte decoder); no per-token state to store")
    return value
