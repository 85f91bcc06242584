"""States one forward keeps for later ones: a segment tree too large for one forward (streamx.data.sharing) runs
as several batches, in order, and a segment one of them computes is continued by the later ones rather than
computed again.

The batch that computes such a segment (`Carry.exports`) keeps what continuing it takes, for each layer the
forward runs: the attention layers' keys and values over its tokens (after the rotary embedding, as attention
sees them), and the linear-attention layers' states at its end (conv window and recurrent state, in a
transformers cache as generation holds them). A later batch's segment that continues it (`Carry.parents`)
attends to the keys of its whole chain and starts from its end state (streamx.model.packing); the last batch that
continues it lets it go (`Carry.releases`). What is kept is at most one chain of segments: at most
`token_budget` tokens of keys and values per attention layer (e.g. 147 KB a token for Qwen3-8B's 36 layers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import Cache

from ..data.batching import Carry
from ..data.sharing import Segment


class Carried:
    """The kept states, and what the running forward continues and keeps (one forward at a time)."""

    keys: dict[Segment, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # segment -> layer -> key, value
    ends: dict[Segment, dict[int, Cache]] = {}  # segment -> sequence mixer -> its state at the segment's end
    parents: dict[int, Segment] = {}  # the running forward's segment -> the kept segment it continues
    exports: dict[int, Segment] = {}  # the running forward's segment -> kept for later forwards

    @classmethod
    def keep_keys(cls, layer: int, bounds: list[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """An attention layer's keys and values [1, kv heads, T, d] over the running forward's kept segments."""
        for s, segment in cls.exports.items():
            a, b = bounds[s], bounds[s + 1]
            cls.keys.setdefault(segment, {})[layer] = (key[:, :, a:b].clone(), value[:, :, a:b].clone())

    @classmethod
    def chain_keys(cls, parent: Segment, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `parent`'s chain (root first) at attention layer `layer`."""
        parts = [cls.keys[s][layer] for s in parent.chain()]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    @classmethod
    def keep_end(cls, segment: Segment, mixer: int, cache: Cache) -> None:
        cls.ends.setdefault(segment, {})[mixer] = cache

    @classmethod
    def end(cls, segment: Segment, mixer: int) -> Cache:
        return cls.ends[segment][mixer]

    @classmethod
    def clear(cls) -> None:
        cls.keys, cls.ends, cls.parents, cls.exports = {}, {}, {}, {}


@contextmanager
def carrying(carry: Carry | None) -> Iterator[None]:
    """Around a batch's forward: what it continues and keeps, then let go of what no later batch continues."""
    if carry is None:
        yield
        return
    Carried.parents, Carried.exports = carry.parents, carry.exports
    try:
        yield
    except BaseException:
        Carried.clear()  # a failed forward ends the run (or the probe): nothing kept is read again
        raise
    finally:
        Carried.parents, Carried.exports = {}, {}
    for segment in carry.releases:
        Carried.keys.pop(segment, None)
        Carried.ends.pop(segment, None)


def kept_bytes_per_token(model: nn.Module) -> int:
    """What a kept token costs: the keys and values of every attention layer (not the linear-attention layers,
    which keep one state per segment, whatever its length), at the model's dtype."""
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    types = getattr(text, "layer_types", None)
    layers = sum(t != "linear_attention" for t in types) if types else text.num_hidden_layers
    return layers * 2 * heads * head_dim * next(model.parameters()).element_size()

