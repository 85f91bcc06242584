"""Padding-free forward passes: several samples side by side in one sequence, kept apart.

A packed batch (batching.make_packed_batch) is one row of the samples' real tokens, with position
ids restarting at 0 for each sample and `cu_seq_lens` marking where each one starts (Batch.model_inputs
hands them to the decoder). Three things
must keep the samples apart:

- attention: the `streamx_packed_sdpa` implementation attends within each sample segment (causal inside
  it), so a packed batch costs what its samples cost alone, never a (sum of lengths)^2 mask: on CUDA in
  one call of torch's flash-attention over variable-length sequences (`varlen_attn`), elsewhere sdpa once
  per segment; flash_attention_2/3 read the same `cu_seq_lens` natively (varlen);
- recurrent and convolutional layers (gated delta-net, causal conv1d) must reset at each boundary,
  which depends on the kernels transformers finds (fla reads `cu_seq_lens`; transformers' torch
  fallbacks and its causal conv1d without the `causal-conv1d` package do not): where they do not,
  `SampleWise` runs those layers sample by sample (the rest of the model still sees the whole batch);
- nothing else may mix tokens (MLPs, MoE routing and norms work per token).

Rather than trust versions and kernels, `enable` proves it on the loaded model: a probe runs two
unrelated samples packed and each alone and compares every layer's output of the second one. Where
they differ with the model's own kernels, the linear-attention layers go sample-wise and the probe
runs again; where they still differ, or the attention implementation has no packed path, the run
uses padded batches and says why (in the log and the store's metadata).
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..data.batching import Batch, make_packed_batch, packed_batch
from ..data.sharing import Segment, pieces, share
from ..data.tokenize import Sample
from .capture import find_decoder
from .carry import Carried, carrying

PACKED_SDPA = "streamx_packed_sdpa"
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")  # transformers' own packed (varlen) paths
PROBE_LENGTHS = (48, 24)  # a first sample, then the one that must not see it (and, for shared prefixes, a prefix
# and a first rest)
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # attention features the per-segment path does not implement


class _Segments:
    """The host copy of the running batch's segments: `cu_seq_lens_q` lives on the device, and reading it there
    in every layer would stall the GPU, so it is read once per batch. A segment that continues another (shared
    prefixes, streamx.data.sharing) starts at a position past 0; its parent is the nearest segment before it
    that ends at that position, or a segment an earlier forward computed (streamx.model.carry: a root here, whose
    queries also see the kept keys of that segment's chain). Batches lay each tree out parents first, depth
    first, so a segment's descendants are the segments right after it (`subtree_ends`), and the positions,
    which a pre-hook on the decoder takes (`take_positions`), say the whole tree."""

    tensor: torch.Tensor | None = None
    bounds: list[int] = []
    parents: list[int] | None = None  # None: no segment continues another, here or from an earlier forward
    subtree_ends: list[int] = []  # segment -> where the tokens of its descendants end (its own end: none)
    positions: torch.Tensor | None = None  # the running forward's position_ids
    keys: dict = {}  # segment -> the ranges of tokens its queries attend to: its ancestors', then its own
    joins: list[Join] | None = None  # the running forward's (varlen_joins)

    @classmethod
    def of(cls, cu_seq_lens: torch.Tensor) -> list[int]:
        if cu_seq_lens is not cls.tensor:
            cls.tensor, cls.bounds, cls.keys, cls.joins = cu_seq_lens, cu_seq_lens.tolist(), {}, None
            cls.parents = cls._parents(cls.bounds)
            cls.subtree_ends = [] if cls.parents is None else cls._subtree_ends(cls.bounds, cls.parents)
        return cls.bounds

    @classmethod
    def take_positions(cls, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cls.positions = kwargs.get("position_ids")
        cls.tensor = None  # a new forward: read its boundaries afresh

    @classmethod
    def _parents(cls, bounds: list[int]) -> list[int] | None:
        if cls.positions is None or len(bounds) < 2:
            return None
        firsts = cls.positions[0, bounds[:-1]].tolist()
        if not any(firsts):
            return None
        parents, ending_at = [], {}  # depth -> the last segment ending there
        for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            parents.append(ending_at.get(firsts[s], -1) if firsts[s] and s not in Carried.parents else -1)
            if firsts[s] and parents[-1] < 0 and s not in Carried.parents:
                raise ValueError(f"packed segment {s} starts at position {firsts[s]} after no segment ending there")
            ending_at[firsts[s] + b - a] = s
        return parents

    @staticmethod
    def _subtree_ends(bounds: list[int], parents: list[int]) -> list[int]:
        ends, open_chain = bounds[1:], []  # the segments whose descendants may still follow, root first
        for s, parent in enumerate(parents):
            while open_chain and open_chain[-1] != parent:
                open_chain.pop()
            if parent >= 0 and not open_chain:
                raise ValueError(f"packed segment {s} does not follow its parent's tree (parents first, depth first)")
            for ancestor in open_chain:
                ends[ancestor] = bounds[s + 1]
            open_chain.append(s)
        return ends

    @classmethod
    def key_ranges(cls, segment: int) -> list[tuple[int, int]]:
        """The tokens segment `segment` attends to, as ranges of the packed row: its ancestors', then its own."""
        if segment not in cls.keys:
            ranges, s = [], segment
            while s >= 0:
                ranges.append((cls.bounds[s], cls.bounds[s + 1]))
                s = cls.parents[s]
            cls.keys[segment] = ranges[::-1]
        return cls.keys[segment]

    @classmethod
    def carried_parent(cls, segment: int):
        """The segment an earlier forward computed that `segment`'s chain here starts from (None: none)."""
        while cls.parents[segment] >= 0:
            segment = cls.parents[segment]
        return Carried.parents.get(segment)

    @classmethod
    def carried_spans(cls) -> list[tuple[int, int, object]]:
        """(first, end, kept segment): the runs of this forward's tokens whose queries also attend to a kept
        segment's chain (a root continuing it and its descendants; neighbours continuing the same one joined)."""
        spans: list[tuple[int, int, object]] = []
        for s in sorted(Carried.parents):
            a, end, parent = cls.bounds[s], cls.subtree_ends[s], Carried.parents[s]
            if spans and spans[-1][2] is parent and spans[-1][1] == a:
                spans[-1] = (spans[-1][0], end, parent)
            else:
                spans.append((a, end, parent))
        return spans

    @classmethod
    def varlen_joins(cls) -> list[Join]:
        """What the running forward's queries attend to besides their own segment's keys, as variable-length
        attention calls: one per tree depth (each segment there with descendants: the queries of its descendants,
        which follow it, on its keys; such segments' subtrees are disjoint), then one per kept chain (the runs of
        queries continuing it, on its keys). Built once per forward, on the running forward's device."""
        if cls.joins is None:
            cls.joins = [] if cls.parents is None else cls._joins()
        return cls.joins

    @classmethod
    def _joins(cls) -> list[Join]:
        device, bounds, depth = cls.tensor.device, cls.bounds, []
        for parent in cls.parents:
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
        joins = []
        for level in range(max(depth) + 1):
            pairs = [((bounds[s + 1], end), (bounds[s], bounds[s + 1]))
                     for s, end in enumerate(cls.subtree_ends) if depth[s] == level and end != bounds[s + 1]]
            if pairs:
                joins.append(Join.of([q for q, _ in pairs], [k for _, k in pairs], device))
        by_chain: dict[int, tuple[Segment, list[tuple[int, int]]]] = {}
        for a, end, kept in cls.carried_spans():
            by_chain.setdefault(id(kept), (kept, []))[1].append((a, end))
        joins += [Join.of(spans, [], device, kept) for kept, spans in by_chain.values()]
        return joins


@dataclass(frozen=True)
class Join:
    """One variable-length attention call that adds keys to some queries: sequence i's queries (the packed tokens
    at `queries[cu_q[i]:cu_q[i+1]]`) attend to the keys of the packed tokens at `keys[cu_k[i]:cu_k[i+1]]`, or (one
    sequence) to a kept segment's whole chain (`kept`, streamx.model.carry)."""

    queries: torch.Tensor  # int64, on the forward's device
    cu_q: torch.Tensor  # int32 [sequences + 1]
    max_q: int
    cu_k: torch.Tensor  # int32 [sequences + 1]
    max_k: int
    keys: torch.Tensor | None = None  # int64 (None: the kept chain's)
    kept: Segment | None = None

    @classmethod
    def of(cls, query_ranges: list[tuple[int, int]], key_ranges: list[tuple[int, int]], device: torch.device,
           kept: Segment | None = None) -> Join:
        """Sequence i: the queries of query_ranges[i] on the keys of key_ranges[i]; or every query of the ranges
        on the chain of `kept` (its tokens 0..kept.end)."""
        def index(ranges: list[tuple[int, int]]) -> torch.Tensor:
            return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)

        def cumulative(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device)

        queries = index(query_ranges)
        if kept is not None:
            return cls(queries, cumulative([len(queries)]), len(queries), cumulative([kept.end]), kept.end, kept=kept)
        q_lengths, k_lengths = [b - a for a, b in query_ranges], [b - a for a, b in key_ranges]
        return cls(queries, cumulative(q_lengths), max(q_lengths), cumulative(k_lengths), max(k_lengths),
                   keys=index(key_ranges))


def packed_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over each sample of a packed row separately (and over the ancestors' keys of a segment that
    continues others): flash attention over variable-length sequences on CUDA in half precision, else sdpa per
    segment, or the CPU's tree path. [1, heads, T, d] -> [1, T, heads, d]"""
    unsupported = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported or attention_mask is not None:
        raise NotImplementedError(f"packed attention does not implement {unsupported or 'an attention mask'}")
    cu_seq_lens = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(name, None)
    if cu_seq_lens is None:  # one sample (e.g. an unbatched forward)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
    bounds = _Segments.of(cu_seq_lens)
    if Carried.exports:  # what later forwards of this tree continue
        Carried.keep_keys(module.layer_idx, bounds, key, value)
    if _uses_varlen(query):
        return _varlen_tree_attention(query, key, value, kwargs.get("scaling"), module.layer_idx), None
    if _Segments.parents is not None:
        if query.device.type == "cpu" and _ATTENTION_WITH_LSE is not None:
            return _tree_attention(query, key, value, kwargs.get("scaling"), module.layer_idx), None
        key, value = key.contiguous(), value.contiguous()  # continuing segments gather their ancestors' keys
    outputs = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if _Segments.parents is None or (_Segments.parents[s] < 0 and s not in Carried.parents):
            outputs.append(sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                                  is_causal=True, **kwargs)[0])
            continue
        outputs.append(_continued(query[:, :, a:b], key, value, s, kwargs.get("scaling"), module.layer_idx))
    return torch.cat(outputs, dim=1), None


def _continued(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segment: int,
               scale: float | None, layer: int) -> torch.Tensor:
    """A continuing segment's attention: its queries see its ancestors' keys (kept by an earlier forward, then
    here) and its own causally, a causal mask aligned at the end (lower right, which torch's fused kernels take
    without a mask); grouped-query heads share their keys rather than copies (enable_gqa).
    [1, heads, t, d] -> [1, t, heads, d]"""
    ranges = _Segments.key_ranges(segment)
    kept = _Segments.carried_parent(segment)
    before = [Carried.chain_keys(kept, layer)] if kept is not None else []
    keys = torch.cat([*(k for k, _ in before), *(key[:, :, a:b] for a, b in ranges)], dim=2)
    values = torch.cat([*(v for _, v in before), *(value[:, :, a:b] for a, b in ranges)], dim=2)
    out = F.scaled_dot_product_attention(query, keys, values, causal_lower_right(query.shape[2], keys.shape[2]),
                                         scale=scale, enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


# torch's CPU flash attention, which also returns each query's log-sum-exp of its scores (None where absent)
_ATTENTION_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                    layer: int) -> torch.Tensor:
    """A packed batch of trees on the CPU, with no key gathered or copied per segment: each segment's queries
    attend to its own keys (causal), and the queries of its descendants, which follow it, to all of its keys
    (one product for all of them), as do those of the segments continuing a kept segment (streamx.model.carry)
    to its chain's keys; each query's parts are joined by their log-sum-exps, as flash attention joins its
    blocks. [1, heads, T, d] -> [1, T, heads, d]"""
    heads = query.shape[1]

    def all_heads(t: torch.Tensor) -> torch.Tensor:  # the fused kernel takes as many key heads as query heads
        return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)

    key, value = all_heads(key), all_heads(value)  # one copy a layer
    joined = torch.empty(query.shape[0], query.shape[2], heads, query.shape[3], dtype=torch.float32)
    out = joined.transpose(1, 2)  # [1, heads, T, d] over the returned layout
    lse = torch.empty(query.shape[:3], dtype=torch.float32)
    pairs = list(zip(_Segments.bounds, _Segments.bounds[1:], strict=False))
    for a, b in pairs:
        out[:, :, a:b], lse[:, :, a:b] = _ATTENTION_WITH_LSE(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                             is_causal=True, scale=scale)

    def join(a: int, b: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # queries a:b also see these
        _join_parts(out[:, :, a:b], lse[:, :, a:b], *_ATTENTION_WITH_LSE(query[:, :, a:b], keys, values, scale=scale))

    for (a, b), end in zip(pairs, _Segments.subtree_ends, strict=True):
        if end != b:
            join(b, end, key[:, :, a:b], value[:, :, a:b])
    for a, end, kept in _Segments.carried_spans():
        join(a, end, *(all_heads(t) for t in Carried.chain_keys(kept, layer)))
    return joined.to(query.dtype)


def _join_parts(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Attention over more keys, in place: `out` (float32, [..., d]) and its log-sum-exps `lse` ([...]) over some
    keys, joined with `part` and `part_lse` over others, as flash attention joins its blocks."""
    gain = part_lse - lse  # the part's weight in the joined softmax is sigmoid(gain)
    out.lerp_(part.float(), torch.sigmoid(gain).unsqueeze(-1))
    lse += F.softplus(gain)  # log(exp(lse) + exp(part_lse))


def _uses_varlen(query: torch.Tensor) -> bool:
    """Whether packed attention runs as variable-length flash attention: torch's, on CUDA (Ampere or later), in
    half precision, heads of at most 256 dimensions (what its flash kernels take)."""
    return (_VARLEN is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] <= 256 and _flash_capable(query.device.index))


@functools.cache
def _flash_capable(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 8


def _varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                      cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                      scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention over variable-length sequences: sequence i's queries cu_q[i]:cu_q[i+1] attend to its keys
    cu_k[i]:cu_k[i+1] (causal: aligned at the end, so a query sees the keys before its own position). Queries
    [Tq, heads, d], keys and values [Tk, kv heads, d]; returns the output [Tq, heads, d] and each query's log-sum-exp
    of its scores [heads, Tq]."""
    return _VARLEN(query, key, value, cu_q, cu_k, max_q, max_k, return_aux=_AuxRequest(lse=True), scale=scale,
                   window_size=(-1, 0) if causal else (-1, -1), enable_gqa=query.shape[1] != key.shape[1])


def _varlen_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                           layer: int) -> torch.Tensor:
    """A packed batch (of trees, or of plain samples) as a few variable-length attention calls: every segment's
    queries on its own keys (causal), in one call; then each of `_Segments.varlen_joins` (its queries on their
    ancestors' keys, where cu_q differs from cu_k), joined by log-sum-exps as in `_tree_attention`.
    [1, heads, T, d] -> [1, T, heads, d]"""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, d]
    bounds = _Segments.bounds
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    out, lse = _varlen_attention(q, k, v, _Segments.tensor, _Segments.tensor, longest, longest, True, scale)
    joins = _Segments.varlen_joins()
    if joins:
        out = out.float()
    for join in joins:
        if join.kept is None:
            keys, values = k.index_select(0, join.keys), v.index_select(0, join.keys)
        else:
            keys, values = (t[0].transpose(0, 1).contiguous() for t in Carried.chain_keys(join.kept, layer))
        part, part_lse = _varlen_attention(q.index_select(0, join.queries), keys, values, join.cu_q, join.cu_k,
                                           join.max_q, join.max_k, False, scale)
        joined, joined_lse = out.index_select(0, join.queries), lse[:, join.queries].T  # [n, heads, d], [n, heads]
        _join_parts(joined, joined_lse, part, part_lse.T)
        out.index_copy_(0, join.queries, joined)
        lse[:, join.queries] = joined_lse.T
    return out.to(query.dtype)[None]


try:  # torch >= 2.12: with grouped-query heads and window_size (2.10 and 2.11 took is_causal and no enable_gqa)
    from torch.nn.attention.varlen import AuxRequest as _AuxRequest
    from torch.nn.attention.varlen import varlen_attn as _VARLEN

    if not {"window_size", "enable_gqa", "scale"} <= set(inspect.signature(_VARLEN).parameters):
        _VARLEN = None
except ImportError:
    _VARLEN = _AuxRequest = None

AttentionInterface.register(PACKED_SDPA, packed_sdpa)

SEQUENCE_MIXERS = ("linear_attn",)  # decoder-layer modules that mix tokens besides attention (Qwen3-Next/3.5/3.6)
_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class SampleWise:
    """Runs the decoder's sequence-mixing layers (gated delta-net linear attention with its causal conv1d)
    segment by segment of a packed row, so that each starts from a clean state whatever kernels transformers
    found; everything else still runs over the whole row. The segments that others continue run alone, in
    order; the rest as batches of alike lengths, padded after their tokens (which a causal layer's outputs
    never see), a few calls a layer rather than one per segment. A segment that continues another (a shared
    prefix, streamx.data.sharing) starts from that segment's final states instead, its conv window's inputs and
    its recurrent state, handed over through a transformers cache of the layer as generation would (or kept from
    an earlier forward: streamx.model.carry). A pre-hook on the decoder takes each forward's boundaries
    (`cu_seq_lens_q`); a forward without them (padded batches) runs the layers as they are."""

    def __init__(self, model: nn.Module, native: bool = False):
        decoder = find_decoder(model).module
        self.native = native  # the layers keep packed samples apart themselves: sample-wise only to hand over
        self.modules = sequence_mixers(model)
        self.config = model.config.get_text_config()
        self.bounds: list[int] | None = None
        self._hook = decoder.register_forward_pre_hook(self._take_bounds, with_kwargs=True)
        self._own_forwards = [module.__dict__.get("forward") for module in self.modules]  # e.g. accelerate's hooks
        for index, module in enumerate(self.modules):
            module.forward = self._per_sample(module.forward, index)

    def _take_bounds(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        self.bounds = None if cu_seq_lens is None else _Segments.of(cu_seq_lens)

    def _per_sample(self, forward, index: int):
        def per_sample(*args, **kwargs):
            bounds = self.bounds
            if bounds is None or (self.native and _Segments.parents is None and not Carried.exports):
                return forward(*args, **kwargs)  # not packed, or nothing handed over: the model's own kernels
            hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
            args = args[1:] if args and hidden is args[0] else args
            for name in (*_BOUNDARY_KWARGS, "attention_mask", "cache"):  # each call sees plain sequences (a group's
                kwargs.pop(name, None)  # padding follows its tokens) and the start states given here
            parents = _Segments.parents or [-1] * (len(bounds) - 1)
            continued = set(parents) | set(Carried.exports)
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
                if s in Carried.parents:  # an earlier forward's segment (streamx.model.carry)
                    return Carried.end(Carried.parents[s], index)
                return None

            # segments that others continue run alone, in order (parents come first), each keeping its end states
            for s in sorted(continued - {-1}):
                begun = start(s)
                cache = handed_over(begun) if begun is not None else DynamicCache(config=self.config)
                outputs[s] = run(hidden[:, bounds[s]:bounds[s + 1]], cache)
                ends[s] = cache
                if s in Carried.exports:
                    Carried.keep_end(Carried.exports[s], index, cache)
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
    conv, recurrent = cache.get_conv_state(layer), cache.get_recurrent_state(layer)  # fresh rows (index_select)
    for row, begun in enumerate(starts):
        if begun is None:
            conv[row].zero_()
            recurrent[row].zero_()
        elif begun is not given[0]:
            conv[row].copy_(begun.get_conv_state(layer)[0])
            recurrent[row].copy_(begun.get_recurrent_state(layer)[0])
    return cache


def sequence_mixers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' SEQUENCE_MIXERS modules (none in a plain transformer)."""
    layers = find_decoder(model).layers
    return [getattr(layer, name) for layer in layers for name in SEQUENCE_MIXERS if hasattr(layer, name)]


def sample_wise_layers(model: nn.Module) -> int:
    """How many of `model`'s layers run once per packed sample (SampleWise), 0 when none do."""
    wrapper = getattr(model, "_streamx_sample_wise", None)
    return len(wrapper.modules) if wrapper is not None else 0


@contextmanager
def padded_attention(model: nn.Module) -> Iterator[None]:
    """The model's attention for padded batches for a while (bench runs both kinds on one model)."""
    packed = model.config._attn_implementation == PACKED_SDPA
    if packed:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if packed:
            model.set_attn_implementation(PACKED_SDPA)


@dataclass(frozen=True)
class Packing:
    """How a run's batches go through the model: packed, or padded (asked for, or because packed samples
    would mix in this model: `reason`)."""

    on: bool
    reason: str | None = None  # why they are padded although packing was asked for
    sample_wise_layers: int = 0  # linear-attention layers run once per packed sample (SampleWise)

    @property
    def setting(self) -> str:
        """on or off: what a resume must match (packed and padded forwards round differently)."""
        return "on" if self.on else "off"

    def __str__(self) -> str:  # as the store's metadata records it
        return self.setting if self.reason is None else f"off: {self.reason}"

    def note(self) -> str:
        """The run's log line."""
        if self.on:
            layers = (f"; its {self.sample_wise_layers} linear-attention layers run sample by sample (in padded "
                      "groups of alike lengths)" if self.sample_wise_layers else "")
            return ("on: each forward's samples side by side, no padding (checked on this model: a sample packed "
                    f"after another has the states it has alone){layers}")
        return f"{self}; padded batches" if self.reason else "off: padded batches"


def configure(model: nn.Module, packing: str) -> Packing:
    """Set `model` up for --packing (on or off): packed where packed batches keep its samples apart, else
    padded with the reason (the model then keeps its own attention)."""
    if packing == "off":
        disable(model)
        return Packing(on=False)
    why = enable(model)
    return Packing(on=True, sample_wise_layers=sample_wise_layers(model)) if why is None else Packing(False, why)


def enable(model: nn.Module) -> str | None:
    """Switch `model` to packed batches if they keep samples apart: None when it is on, else the reason
    it stays off (the model is then left as it would run padded batches)."""
    before = model.config._attn_implementation
    if before not in (None, "sdpa", PACKED_SDPA, *NATIVE_VARLEN):
        return f"attention implementation {before} has no packed path (sdpa or flash_attention_2/3 have)"
    if before in (None, "sdpa"):
        model.set_attn_implementation(PACKED_SDPA)
    if getattr(model, "_streamx_positions", None) is None:  # before SampleWise's hook, which reads the segments
        model._streamx_positions = find_decoder(model).module.register_forward_pre_hook(_Segments.take_positions,
                                                                                        with_kwargs=True)
    leak = probe(model)
    if leak is not None and not sample_wise_layers(model) and sequence_mixers(model):
        model._streamx_sample_wise = SampleWise(model)  # the model's own kernels mix samples: one at a time
        leak = probe(model)
    if leak is not None:
        disable(model)
    return leak


def disable(model: nn.Module) -> None:
    """Back to the model's own attention and layers (a model that an earlier plan set up for packing)."""
    if model.config._attn_implementation == PACKED_SDPA:
        model.set_attn_implementation("sdpa")
    wrapper = getattr(model, "_streamx_sample_wise", None)
    if wrapper is not None:
        wrapper.remove()
        del model._streamx_sample_wise
    hook = getattr(model, "_streamx_positions", None)
    if hook is not None:
        hook.remove()
        del model._streamx_positions


def _random_samples(model: nn.Module, lengths: tuple[int, ...]) -> list[Sample]:
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    return [Sample(i, torch.randint(0, vocab, (n,), generator=g), torch.ones(n, dtype=torch.long))
            for i, n in enumerate(lengths)]


def _alone(rows: list[Sample], model: nn.Module) -> dict[int, tuple[torch.Tensor, ...]]:
    """Each row's states at every layer output, computed alone (the reference the probes compare with), by the
    row's id(): computed once however many of the probe's batches hold the row."""
    device = next(model.parameters()).device
    decoder = find_decoder(model).module
    return {id(row): decoder(input_ids=row.input_ids[None].to(device), use_cache=False,
                             output_hidden_states=True).hidden_states for row in rows}


def _difference(batch: Batch, alone: dict[int, tuple[torch.Tensor, ...]], model: nn.Module) -> tuple[int, float] | str:
    """Run `batch`; the layer output where its rows' states differ most from those rows computed `alone`
    (_alone; the batch's other rows are not compared), and by how much (relative to the largest state), or why
    the batch could not run."""
    device = next(model.parameters()).device
    decoder = find_decoder(model).module
    try:
        with carrying(batch.carry):
            together = decoder(**batch.model_inputs(device), use_cache=False, output_hidden_states=True).hidden_states
    except (NotImplementedError, TypeError, ValueError, RuntimeError, KeyError, AttributeError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    worst = (0, 0.0)
    for k, (row, ranges) in enumerate(zip(batch.samples, batch.row_ranges, strict=True)):
        if id(row) not in alone:
            continue
        index = torch.cat([torch.arange(a, a + n) for a, n in ranges]).to(device)
        here = batch.carried_tokens(k)  # the tokens before were checked with the batch that computed them
        for layer, (t, a) in enumerate(zip(together, alone[id(row)], strict=True)):
            got, want = t[0].index_select(0, index).float(), a[0, here:].float()
            error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
            if not error <= worst[1]:
                worst = (layer, error)
    return worst


def _tolerance(model: nn.Module) -> float:
    return 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2  # a leak moves states by O(1)


@torch.inference_mode()
def probe(model: nn.Module) -> str | None:
    """Run two unrelated samples packed and each alone; None when the second one's states at every layer
    are the same both ways (up to rounding), else where they differ."""
    first, second = _random_samples(model, PROBE_LENGTHS)
    found = _difference(make_packed_batch([first, second]), _alone([second], model), model)
    if isinstance(found, str):
        return f"the packed forward failed ({found})"
    layer, error = found
    if not error <= _tolerance(model):
        return (f"a sample's states depend on the sample packed before it (layer output {layer}: relative "
                f"difference {error:.2g}); this model's layers or kernels do not reset at sample boundaries")
    return None


@torch.inference_mode()
def probe_continuation(model: nn.Module) -> str | None:
    """Run two rows that share a leading run as a segment tree (the run once, each rest continuing from its
    state: streamx.data.sharing), in one forward and cut into two (the second continuing from what the first
    kept: streamx.model.carry), and each row alone; None when every layer's states of both rows are the same
    every way (up to rounding), else why they are not. Call it on a model `enable` set up."""
    prefix, first, second = _random_samples(model, PROBE_LENGTHS + (16,))
    rows = [Sample(i, ids, torch.ones(len(ids), dtype=torch.long))
            for i, ids in enumerate(torch.cat([prefix.input_ids, rest.input_ids]) for rest in (first, second))]
    together = [packed_batch(pieces(share(rows, 1), len(prefix.input_ids) * 4))]
    cut = [packed_batch([piece]) for piece in pieces(share(rows, 1), len(rows[0].input_ids))]
    if together[0].segment_parents is None or len(cut) != 2 or cut[1].carry is None:
        raise AssertionError("the probe's rows must share their leading run")
    alone = _alone(rows, model)
    try:
        for way, batches in (("in one forward", together), ("across two forwards", cut)):
            for batch in batches:
                found = _difference(batch, alone, model)
                if isinstance(found, str):
                    return f"the forward with a shared prefix {way} failed ({found})"
                layer, error = found
                if not error <= _tolerance(model):
                    return (f"a row continued from a shared prefix's state {way} differs from the row computed "
                            f"alone (layer output {layer}: relative difference {error:.2g}); this model's layers do "
                            "not continue from the prefix's state")
    finally:
        Carried.clear()  # what the cut kept, had it stopped before its last forward
    return None
