"""Padding-free forward passes: several samples side by side in one sequence, kept apart.

A packed batch (batching.make_packed_batch) is one row of the samples' real tokens, with position ids
restarting at 0 for each sample (or, for a segment that continues a shared prefix, at the prefix's end) and
`cu_seq_lens` marking where each one starts (Batch.model_inputs hands them to the decoder, with the forward's
segments: streamx.model.segments). Three things must keep the samples apart:

- attention: `streamx_packed` (streamx.model.attention) attends within each sample segment (causal inside
  it, with the layer's window, chunks, soft-capping and sinks), so a packed batch costs what its samples cost
  alone, never a (sum of lengths)^2 mask; flash_attention_2/3 read the same `cu_seq_lens` natively (varlen);
- recurrent and convolutional layers (gated delta-net, causal conv1d) must reset at each boundary,
  which depends on the kernels transformers finds (fla reads `cu_seq_lens`; transformers' torch
  fallbacks and its causal conv1d without the `causal-conv1d` package do not): where they do not,
  `SampleWise` runs those layers sample by sample (the rest of the model still sees the whole batch);
- nothing else may mix tokens (MLPs, MoE routing and norms work per token).

Rather than trust versions and kernels, `enable` proves it on the loaded model (streamx.proof.check): probe rows
packed against each row alone through the model's own forward. Where they differ with the model's own kernels,
the linear-attention layers go sample-wise and the check runs again; where they still differ, or the attention
implementation has no packed path, the run uses padded batches and says why (in the log and the store's metadata).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from ..proof.check import Probes, check_packing, check_padded
from .attention import PACKED_ATTENTION
from .capture import find_decoder
from .lengths import LengthSplit, keep_rope_fresh, length_split
from .segments import FORWARD_KWARG, PackedForward

NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")  # transformers' own packed (varlen) paths
REPLACED = (None, "sdpa", "eager")  # the model's own attention implementations streamx_packed stands in for

# layers that mix tokens through a state rather than attention (transformers' layer_types; their caches hold conv and
# recurrent states alike), and where a decoder layer keeps that mixer: gated delta-net (Qwen3-Next/3.5/3.6), Mamba2
# (Granite 4, Nemotron-H), LFM2's short convolution
MIXER_LAYER_TYPES = ("linear_attention", "conv")
SEQUENCE_MIXERS = ("linear_attn", "mamba", "conv", "mixer")
_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class SampleWise:
    """Runs the decoder's sequence-mixing layers (gated delta-net linear attention with its causal conv1d)
    segment by segment of a packed row, so that each starts from a clean state whatever kernels transformers
    found; everything else still runs over the whole row. The segments that others continue run alone, in
    order; the rest as batches of alike lengths, padded after their tokens (which a causal layer's outputs
    never see), a few calls a layer rather than one per segment. A segment that continues another (a shared
    prefix, streamx.data.sharing) starts from that segment's final states instead, its conv window's inputs and
    its recurrent state, handed over through a transformers cache of the layer as generation would (or kept from
    an earlier forward: streamx.model.carry). A pre-hook on the decoder takes each forward's segments (its
    PackedForward); a forward without them (padded batches) runs the layers as they are."""

    def __init__(self, model: nn.Module, native: bool = False):
        decoder = find_decoder(model).module
        self.native = native  # the layers keep packed samples apart themselves: sample-wise only to hand over
        self.modules = sequence_mixers(model)
        self.config = model.config.get_text_config()
        self.forward: PackedForward | None = None  # the running forward's segments (this model's, not global)
        self._hook = decoder.register_forward_pre_hook(self._take_forward, with_kwargs=True)
        self._own_forwards = [module.__dict__.get("forward") for module in self.modules]  # e.g. accelerate's hooks
        for index, module in enumerate(self.modules):
            module.forward = self._per_sample(module.forward, index)

    def _take_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.forward = kwargs.get(FORWARD_KWARG)

    def _per_sample(self, forward, index: int):
        def per_sample(*args, **kwargs):
            packed = self.forward
            if packed is None or (self.native and packed.parents is None and not packed.exports):
                return forward(*args, **kwargs)  # not packed, or nothing handed over: the model's own kernels
            bounds = packed.bounds
            hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
            args = args[1:] if args and hidden is args[0] else args
            # each call sees plain sequences (a group's padding follows its tokens) and the start states given here
            for name in (*_BOUNDARY_KWARGS, FORWARD_KWARG, "attention_mask", "cache"):
                kwargs.pop(name, None)
            parents = packed.parents or [-1] * (len(bounds) - 1)
            continued = set(parents) | set(packed.exports)
            ends: dict[int, Cache] = {}  # segment -> its final states, for the segments that continue it
            outputs: list[torch.Tensor | None] = [None] * len(parents)

            def run(x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
                out = forward(x, *args, **kwargs, **({"cache": cache} if cache is not None else {}))
                if not isinstance(out, torch.Tensor):
                    raise NotImplementedError(f"sample-wise layers return tensors; got {type(out).__name__}")
                return out

            def start(s: int) -> Cache | None:
                """The states segment s starts from (None: a clean start)."""
                if parents[s] >= 0:
                    return ends[parents[s]]
                if s in packed.carried:  # an earlier forward's segment (streamx.model.carry)
                    return packed.kept.end(packed.carried[s], index)
                return None

            # segments that others continue run alone, in order (parents come first), each keeping its end states
            for s in sorted(continued - {-1}):
                begun = start(s)
                cache = handed_over(begun) if begun is not None else DynamicCache(config=self.config)
                outputs[s] = run(hidden[:, bounds[s]:bounds[s + 1]], cache)
                ends[s] = cache
                if s in packed.exports:
                    packed.kept.keep_end(packed.exports[s], index, cache)
            # the rest end rows: those about as long run as one batch, padded after their tokens (which, causal,
            # never see it), each row from a copy of its start states
            leaves = [s for s in range(len(parents)) if s not in continued]
            for group in _alike(leaves, bounds):
                lengths = [bounds[s + 1] - bounds[s] for s in group]
                if len(group) == 1:
                    batch = hidden[:, bounds[group[0]]:bounds[group[0] + 1]]
                else:
                    batch = hidden.new_zeros(len(group), max(lengths), hidden.shape[-1])
                    for row, s in enumerate(group):
                        batch[row, : lengths[row]] = hidden[0, bounds[s]:bounds[s + 1]]
                out = run(batch, _group_start([start(s) for s in group], self.modules[index].layer_idx))
                for row, s in enumerate(group):
                    outputs[s] = out[row: row + 1, : lengths[row]]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

        return per_sample

    def remove(self) -> None:
        self._hook.remove()
        for module, forward in zip(self.modules, self._own_forwards, strict=True):
            if forward is None:
                del module.forward  # back to the class's own
            else:
                module.forward = forward


def hand_states_over(model: nn.Module) -> bool:
    """Have the sequence-mixing layers of a model whose own kernels keep packed samples apart, but start each from
    a clean state (flash-linear-attention's varlen kernels), run once per segment in forwards where a segment
    continues another's state (SampleWise, native): True when that is new, so the continuation probe is worth
    running again."""
    if sample_wise_layers(model) or not sequence_mixers(model):
        return False
    model._streamx_sample_wise = SampleWise(model, native=True)
    return True


def keep_samples_apart_natively(model: nn.Module) -> None:
    """Undo hand_states_over: the layers run as the model's own kernels run them again."""
    model._streamx_sample_wise.remove()
    del model._streamx_sample_wise


def handed_over(cache: Cache) -> Cache:
    """A segment's final states for one segment that continues it (a copy: its siblings continue them too)."""
    return copy.deepcopy(cache)


PADDING_ALLOWED = 0.25  # a group of sample-wise rows pads at most this share of its tokens


def _alike(segments: list[int], bounds: list[int]) -> Iterator[list[int]]:
    """`segments` in groups that one padded call runs: lengths alike enough that padding to the longest adds at
    most PADDING_ALLOWED of the group's tokens; longest first."""
    group, tokens, longest = [], 0, 0
    for s in sorted(segments, key=lambda s: bounds[s] - bounds[s + 1]):  # longest first
        n = bounds[s + 1] - bounds[s]
        if group and longest * (len(group) + 1) > (1 + PADDING_ALLOWED) * (tokens + n):
            yield group
            group, tokens = [], 0
        if not group:
            longest = n
        group.append(s)
        tokens += n
    if group:
        yield group


def _group_start(starts: list[Cache | None], layer: int) -> Cache | None:
    """One cache whose row r holds starts[r]'s conv and recurrent states at `layer` (zeros for None, which a
    causal conv and a recurrence starting from zeros read as a clean start); None when every start is clean."""
    given = [c for c in starts if c is not None]
    if not given:
        return None
    cache = handed_over(given[0])
    cache.reorder_cache(torch.zeros(len(starts), dtype=torch.long, device=given[0].get_conv_state(layer).device))
    for state in ("get_conv_state", "get_recurrent_state"):  # (a short convolution keeps no recurrent state)
        rows = getattr(cache, state)(layer)  # fresh rows (index_select)
        for row, begun in enumerate(starts):
            if rows is None:
                break
            if begun is None:
                rows[row].zero_()
            elif begun is not given[0]:
                rows[row].copy_(getattr(begun, state)(layer)[0])
    return cache


def sequence_mixers(model: nn.Module) -> list[nn.Module]:
    """The sequence mixers of the decoder's MIXER_LAYER_TYPES layers (none in a plain transformer): the first of
    SEQUENCE_MIXERS each such layer holds."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    layers = find_decoder(model).layers
    mixers = []
    for layer, kind in zip(layers, types, strict=False):
        found = [getattr(layer, name) for name in SEQUENCE_MIXERS if getattr(layer, name, None) is not None]
        if kind in MIXER_LAYER_TYPES and found:
            mixers.append(found[0])
    return mixers


def sample_wise_layers(model: nn.Module) -> int:
    """How many of `model`'s layers run once per packed sample (SampleWise), 0 when none do."""
    wrapper = getattr(model, "_streamx_sample_wise", None)
    return len(wrapper.modules) if wrapper is not None else 0


def own_attention(model: nn.Module) -> str:
    """The attention implementation the model was loaded with (before streamx_packed stood in for it)."""
    return getattr(model, "_streamx_own_attention", None) or model.config._attn_implementation or "sdpa"


@contextmanager
def padded_attention(model: nn.Module) -> Iterator[None]:
    """The model's own attention for padded batches for a while (bench runs both kinds on one model)."""
    packed = model.config._attn_implementation == PACKED_ATTENTION
    if packed:
        model.set_attn_implementation(own_attention(model))
    try:
        yield
    finally:
        if packed:
            model.set_attn_implementation(PACKED_ATTENTION)


@dataclass(frozen=True)
class Packing:
    """How a run's batches go through the model: packed, or padded (asked for, or because packed samples
    would mix in this model: `reason`), or one row per forward (asked for with --max-batch-size 1, or because
    padded rows differ too: the model's own forward of each row alone, by definition right)."""

    on: bool
    reason: str | None = None  # why they are padded although packing was asked for, or why one row per forward
    sample_wise_layers: int = 0  # linear-attention layers run once per packed sample (SampleWise)
    alone: bool = False  # one row per forward
    split: LengthSplit | None = None  # rows past a length the forward depends on never batched with shorter ones
    probes: Probes | None = field(default=None, repr=False, compare=False)  # the start-up check's rows, and the
    # model's own forward of them (streamx.proof.check), which the later checks reuse

    @property
    def setting(self) -> str:
        """on or off: what a resume must match (packed and padded forwards round differently)."""
        return "on" if self.on else "off"

    def __str__(self) -> str:  # as the store's metadata records it
        said = self.setting if self.reason is None else f"{self.setting}: {self.reason}"
        return said + ("; one row per forward" if self.alone else "") + (f"; {self.split.note()}" if self.split else "")

    def note(self) -> str:
        """The run's log line."""
        split = f"; {self.split.note()}" if self.split else ""
        if self.on:
            layers = (f"; its {self.sample_wise_layers} linear-attention layers run sample by sample (in padded "
                      "groups of alike lengths)" if self.sample_wise_layers else "")
            return ("on: each forward's samples side by side, no padding (checked against this model's own forward: "
                    f"a sample packed after another has the states it has alone, {self.probes.scope}){layers}{split}")
        if self.alone:
            return (f"off: {self.reason}; " if self.reason else "off: ") + \
                "one row per forward, the model's own forward of each row (slow, but right)" + split
        return (f"off: {self.reason}; padded batches" if self.reason else "off: padded batches") + split


def configure(model: nn.Module, packing: str, max_length: int, max_batch_size: int = 256,
              token_budget: int | None = None) -> Packing:
    """Set `model` up for --packing (on or off): packed where packed batches give each row the states the
    model's own forward gives it alone, else padded with the reason (the model then keeps its own attention),
    else one row per forward, the model's own forward by definition. The check's rows are at most `max_length`
    tokens (the run's --max-length: no row is longer) and half `token_budget` (the check's forwards fit where the
    run's do); rows past a length the model's forward depends on are never batched with shorter ones
    (streamx.model.lengths)."""
    disable(model)
    keep_rope_fresh(model)
    split = length_split(model.config, max_length)
    probes = Probes.of(model, max_length, split, token_budget)
    why = enable(model, probes) if packing == "on" else None
    if packing == "on" and why is None:
        return Packing(on=True, sample_wise_layers=sample_wise_layers(model), split=split, probes=probes)
    if max_batch_size == 1:  # asked for: each row alone is the model's own forward
        return Packing(on=False, reason=why, alone=True, split=split, probes=probes)
    wrong = check_padded(model, probes)
    if wrong is not None:
        return Packing(on=False, reason=f"padded batches differ from the model's own forward too ({wrong})"
                       + (f", as packed ones do ({why})" if why else ""), alone=True, split=split, probes=probes)
    return Packing(on=False, reason=why, split=split, probes=probes)


def enable(model: nn.Module, probes: Probes) -> str | None:
    """Switch `model` to packed batches if they keep samples apart: None when it is on, else the reason
    it stays off (the model is then left as it would run padded batches)."""
    own = model.config._attn_implementation
    if own not in (*REPLACED, *NATIVE_VARLEN):
        return f"attention implementation {own} has no packed path (sdpa, eager or flash_attention_2/3 have)"
    model._streamx_own_attention = own
    if own in REPLACED:
        model.set_attn_implementation(PACKED_ATTENTION)
    leak = check_packing(model, probes)
    if leak is not None and not sample_wise_layers(model) and sequence_mixers(model):
        model._streamx_sample_wise = SampleWise(model)  # the model's own kernels mix samples: one at a time
        leak = check_packing(model, probes)
    if leak is not None:
        disable(model)
    return leak


def disable(model: nn.Module) -> None:
    """Back to the model's own attention and layers (a model that an earlier plan set up for packing)."""
    if model.config._attn_implementation == PACKED_ATTENTION:
        model.set_attn_implementation(own_attention(model))
    wrapper = getattr(model, "_streamx_sample_wise", None)
    if wrapper is not None:
        wrapper.remove()
        del model._streamx_sample_wise
