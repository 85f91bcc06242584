"""A length past which a model's forward changes every row's states with the batch's longest position.

Length-dependent rope picks its frequencies once per forward, from the largest position in the batch
(transformers' `dynamic_rope_update`): longrope (Phi-3.5, Phi-4-mini) takes its long factors for the whole forward
once a position reaches `original_max_position_embeddings`, dynamic NTK rescales its base to the forward's longest
row past `max_position_embeddings` (and keeps that scale for later forwards until a short one resets it). A row
at most that long, packed, padded or shared beside a longer one, then gets other states than its own forward
gives it alone. So the run keeps the two sides apart (streamx.data.batching): rows of at most `limit` tokens never
share a forward or a prefix with longer rows; past it, longrope's rows are batched among themselves (every such
forward takes the long factors, as each row alone does) and dynamic NTK's run one row per forward, from a fresh
scale (`keep_rope_fresh`), as the model's own forward of the row alone in a new process does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LengthSplit:
    """Rows longer than `limit` tokens never share a forward or a prefix with shorter ones."""

    limit: int
    alone: bool  # past the limit, one row per forward (its frequencies depend on its own length)
    why: str  # the feature, for the log

    def past(self, length: int) -> bool:
        """True for a row past the limit."""
        return length > self.limit

    def note(self) -> str:
        past = "each in a forward of its own" if self.alone else "batched among themselves"
        return (f"{self.why}: rows of at most {self.limit:,} tokens never share a forward or a prefix with longer "
                f"ones, which run {past}")


def _rope_parameters(config) -> Iterator[dict]:
    """The rope parameter sets of a (text) config: one, or one per layer type."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        yield from rope.values()
    elif isinstance(rope, dict):
        yield rope


def length_split(config, max_length: int) -> LengthSplit | None:
    """The split a model's text config asks for, where rows of the run (at most `max_length` tokens) reach past it;
    None where no rope of the model depends on the forward's length."""
    text = config.get_text_config()
    found = None
    for params in _rope_parameters(text):
        kind = str(params.get("rope_type", params.get("type", "")))
        limit = (params.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                             None)) if kind == "longrope" else \
            getattr(text, "max_position_embeddings", None) if "dynamic" in kind else None
        if not isinstance(limit, int) or limit < 1:  # no length-dependent rope (or none with a length to split at)
            continue
        if kind == "longrope":
            split = LengthSplit(limit, False, f"longrope (long factors past {limit:,} positions in a forward)")
        else:
            split = LengthSplit(limit, True, f"dynamic NTK rope (rescaled past {limit:,} positions to the forward's "
                                             "longest row)")
        found = split if found is None else LengthSplit(min(found.limit, split.limit), found.alone or split.alone,
                                                        f"{found.why}; {split.why}")
    return found if found is not None and max_length > found.limit else None


def keep_rope_fresh(model: nn.Module) -> None:
    """Every forward's dynamic NTK rope from its original scale, as in a process that runs that forward first:
    transformers keeps the scale of the longest forward so far until a short one resets it, so a row's states would
    depend on the rows before it. Once per model (a pre-hook on each such rope module, for the model's life)."""

    def prefixes(module: nn.Module) -> list[str]:
        """The attribute prefixes of its dynamic ropes: "" for one rope, "<layer type>_" for one per layer type."""
        kinds = getattr(module, "rope_type", None)
        if isinstance(kinds, dict):
            return [f"{kind}_" for kind, rope in kinds.items() if "dynamic" in str(rope)]
        return [""] if "dynamic" in str(kinds) and hasattr(module, "original_inv_freq") else []

    def reset(module: nn.Module, args) -> None:
        for p in prefixes(module):
            original = getattr(module, f"{p}original_inv_freq")
            setattr(module, f"{p}inv_freq", original.to(getattr(module, f"{p}inv_freq").device))
            setattr(module, f"{p}max_seq_len_cached", module.original_max_seq_len)

    for module in model.modules():
        if prefixes(module) and not getattr(module, "_streamx_fresh", False):
            module.register_forward_pre_hook(reset)
            module._streamx_fresh = True
