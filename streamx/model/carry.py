"""States one forward keeps for later ones: a segment tree too large for one forward (streamx.data.sharing) runs
as several batches, in order, and a segment one of them computes is continued by the later ones rather than
computed again.

The batch that computes such a segment (`Carry.exports`) keeps what continuing it takes, for each layer the
forward runs: the attention layers' keys and values over its tokens (after the rotary embedding, as attention
sees them), and the linear-attention layers' states at its end (conv window and recurrent state, in a
transformers cache as generation holds them). A later batch's segment that continues it (`Carry.parents`)
attends to the keys of its whole chain and starts from its end state (streamx.model.attention,
streamx.model.packing); the last batch that continues it lets it go (`Carry.releases`). What is kept is at most
one chain of segments: at most `token_budget` tokens of keys and values per attention layer (e.g. 147 KB a token
for Qwen3-8B's 36 layers).

The kept states belong to whoever runs the batches (a run's capture, bench, a start-up check): a `Kept` each, so
that two models, or a check beside a run, never read each other's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import Cache

from ..data.batching import Carry
from ..data.sharing import Segment
from .residual import layer_configs


class Kept:
    """The states a run's forwards keep for its later forwards, by segment."""

    def __init__(self) -> None:
        self.keys: dict[Segment, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # segment -> layer -> key, value
        self.ends: dict[Segment, dict[int, Cache]] = {}  # segment -> sequence mixer -> its state at its end

    def keep_keys(self, segment: Segment, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """An attention layer's keys and values [1, kv heads, t, d] over a kept segment's tokens."""
        self.keys.setdefault(segment, {})[layer] = (key.clone(), value.clone())

    def chain_keys(self, parent: Segment, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `parent`'s chain (root first) at attention layer `layer`."""
        parts = [self.keys[s][layer] for s in parent.chain()]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    def keep_end(self, segment: Segment, mixer: int, cache: Cache) -> None:
        self.ends.setdefault(segment, {})[mixer] = cache

    def end(self, segment: Segment, mixer: int) -> Cache:
        return self.ends[segment][mixer]

    def release(self, segments: list[Segment]) -> None:
        for segment in segments:
            self.keys.pop(segment, None)
            self.ends.pop(segment, None)

    def clear(self) -> None:
        self.keys, self.ends = {}, {}

    @property
    def nbytes(self) -> int:
        """The bytes of the keys and values kept."""
        return sum(k.nbytes + v.nbytes for layers in self.keys.values() for k, v in layers.values())


@contextmanager
def carrying(carry: Carry | None, kept: Kept) -> Iterator[None]:
    """Around a batch's forward: let go of what no later batch continues once it ran; a failed forward ends the
    run (or the check), so nothing kept is read again."""
    try:
        yield
    except BaseException:
        kept.clear()
        raise
    if carry is not None:
        kept.release(carry.releases)


def kept_bytes_per_token(model: nn.Module) -> int:
    """What a kept token costs: the keys and values of every attention layer (not the layers that mix tokens
    through a state, which keep one state per segment, whatever its length, nor MLP and MoE blocks), at the model's
    dtype; MLA's keys are its query-key heads (rope and no-rope parts), its values narrower."""
    types = getattr(model.config.get_text_config(), "layer_types", None)
    total = 0
    for k, layer in enumerate(layer_configs(model.config)):  # (each with its own heads and sizes: Gemma 4)
        if types and (not types[k].endswith("attention") or types[k] == "linear_attention"):
            continue
        heads = getattr(layer, "num_key_value_heads", None) or getattr(layer, "num_attention_heads", None)
        if not heads:  # no attention (Mamba's mixers keep a state per segment)
            continue
        if getattr(layer, "qk_nope_head_dim", None):
            key_size = layer.qk_nope_head_dim + layer.qk_rope_head_dim
        else:
            key_size = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
        total += heads * (key_size + (getattr(layer, "v_head_dim", None) or key_size))
    return total * next(model.parameters()).element_size()
