"""The attention of packed batches: each segment attends within its own sample, and a segment that continues
others (shared prefixes) also to its ancestors' keys, with whatever its layer asks.

Registered with transformers as `streamx_packed`, so the model's own attention modules call it with their
queries, keys and values (after the rotary embedding) and the running forward's segments (PackedForward, a keyword
argument of the forward). Each call reads what its layer asks (`LayerAttention`): a sliding window, chunked
attention (Llama 4), logit soft-capping (Gemma 2), attention sinks (gpt-oss), a value head size other than the
query's (MLA). Plain causal layers take the fast paths:

- on CUDA in half precision, torch's flash attention over variable-length sequences: every segment's queries on
  its own keys in one call, then a few calls whose queries and keys differ (a continuing segment's queries on its
  ancestors' keys), the parts joined by their log-sum-exps as flash attention joins its blocks;
- on the CPU, the tree: each segment's queries on its own keys, and the queries of its descendants (which follow it)
  on all of its keys in one product, joined the same way, with no key copied per segment;
- elsewhere sdpa per segment, a continuing segment gathering its ancestors' keys.

Layers with a window, chunks, soft-capping or sinks run as runs of queries (PackedForward.runs), each on the keys
its queries may see, gathered from its chain: on CUDA all runs in one variable-length call (a window as flash
attention's window_size; sinks joined by log-sum-exp), elsewhere a product per run with its mask. A window or
chunk at least as long as every chain in the forward changes nothing, and such a layer takes the fast path.

What this implements is proven on the loaded model at start against its own forward (streamx.proof.check): a
feature it missed sends the run to a slower correct path.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .segments import FORWARD_KWARG, PackedForward, Run, Runs

PACKED_ATTENTION = "streamx_packed"  # (no "sdpa" in it: transformers would ask such a name for sdpa support)
RUN_BLOCK = 128  # queries per run off the varlen path: a run's scores are heads x 128 x (128 + window) floats


@dataclass(frozen=True)
class LayerAttention:
    """What one attention call asks beyond causal attention within its sample, in transformers' terms."""

    scale: float | None
    window: int | None = None  # a query sees its own and the window - 1 positions before it (`sliding_window`)
    chunk: int | None = None  # a query sees the positions of its own chunk only (Llama 4's `chunked_attention`)
    softcap: float | None = None  # scores pass through softcap * tanh(score / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None  # a logit per head that joins every query's softmax, with no value (gpt-oss)

    @classmethod
    def of(cls, module: nn.Module, kwargs: dict, forward: PackedForward) -> LayerAttention:
        """The call's features; a window or chunk that reaches past every chain of the forward is dropped."""
        config = getattr(module, "config", None)
        types = getattr(config, "layer_types", None) or ()
        index = getattr(module, "layer_idx", None)
        chunk = None
        if index is not None and index < len(types) and types[index] == "chunked_attention":
            chunk = getattr(config, "attention_chunk_size", None)
        window, reach = kwargs.get("sliding_window"), forward.reach
        return cls(kwargs.get("scaling"), window if window and window < reach else None,
                   chunk if chunk and chunk < reach else None, kwargs.get("softcap"), kwargs.get("s_aux"))

    @property
    def plain(self) -> bool:
        return self.window is None and self.chunk is None and self.softcap is None and self.sinks is None


SPARSE_KWARGS = ("indices", "block_indices", "topk_indices")  # keys a sparse attention layer selects per query


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over each sample of a packed row separately (and over the ancestors' keys of a segment that
    continues others). [1, heads, T, d] -> [1, T, heads, d]"""
    if attention_mask is not None:
        raise NotImplementedError("packed attention does not implement an attention mask")
    sparse = [name for name in SPARSE_KWARGS if kwargs.get(name) is not None]
    if sparse:  # (DeepSeek-V3.2 / GLM-5's indexer, MiniMax-M3's blocks): the check falls back to the model's own
        raise NotImplementedError(f"packed attention does not select the keys this layer's sparse attention picks "
                                  f"({', '.join(sparse)})")
    forward: PackedForward | None = kwargs.pop(FORWARD_KWARG, None)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(name, None)
    if forward is None:  # one sequence, not a streamx batch (e.g. a plain forward of the model)
        forward = PackedForward.single(query.shape[2], query.device)
    layer, index = LayerAttention.of(module, kwargs, forward), module.layer_idx
    query = _at_own_positions(module, query, forward.position_ids)
    for s, segment in forward.exports.items():  # what later forwards of this tree continue
        a, b = forward.bounds[s], forward.bounds[s + 1]
        forward.kept.keep_keys(segment, index, key[:, :, a:b], value[:, :, a:b])
    if not layer.plain:
        return _runs_attention(query, key, value, forward, layer, index), None
    if _uses_varlen(query):
        return _varlen_tree_attention(query, key, value, forward, layer.scale, index), None
    if forward.parents is not None:
        if query.device.type == "cpu" and _ATTENTION_WITH_LSE is not None:
            return _tree_attention(query, key, value, forward, layer.scale, index), None
        key, value = key.contiguous(), value.contiguous()  # continuing segments gather their ancestors' keys
    outputs = []
    for s in forward.segments:
        a, b = forward.bounds[s], forward.bounds[s + 1]
        if forward.starts_clean(s):
            outputs.append(sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                                  is_causal=True, **kwargs)[0])
        else:
            outputs.append(_continued(query[:, :, a:b], key, value, forward, s, layer.scale, index))
    return torch.cat(outputs, dim=1), None


def _at_own_positions(module: nn.Module, query: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Llama 4's layers without rotary embedding scale each query by a function of its position (attention
    temperature tuning), which transformers counts from 0 over the whole forward, not from position_ids: in a
    packed forward, each query rescaled to its token's own position, as the row alone has it."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True) \
            or position_ids is None:
        return query

    def scale(positions: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    index = torch.arange(query.shape[2], device=query.device)
    return (query * (scale(position_ids[0]) / scale(index)).view(1, 1, -1, 1)).to(query.dtype)


def _continued(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward: PackedForward, segment: int,
               scale: float | None, layer: int) -> torch.Tensor:
    """A continuing segment's attention: its queries see its ancestors' keys (kept by an earlier forward, then
    here) and its own causally, a causal mask aligned at the end (lower right, which torch's fused kernels take
    without a mask); grouped-query heads share their keys rather than copies (enable_gqa).
    [1, heads, t, d] -> [1, t, heads, d]"""
    ranges = forward.key_ranges(segment)
    kept = forward.carried_parent(segment)
    before = [forward.kept.chain_keys(kept, layer)] if kept is not None else []
    keys = torch.cat([*(k for k, _ in before), *(key[:, :, a:b] for a, b in ranges)], dim=2)
    values = torch.cat([*(v for _, v in before), *(value[:, :, a:b] for a, b in ranges)], dim=2)
    out = F.scaled_dot_product_attention(query, keys, values, causal_lower_right(query.shape[2], keys.shape[2]),
                                         scale=scale, enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


# torch's CPU flash attention, which also returns each query's log-sum-exp of its scores (None where absent)
_ATTENTION_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward: PackedForward,
                    scale: float | None, layer: int) -> torch.Tensor:
    """A packed batch of trees on the CPU, with no key gathered or copied per segment: each segment's queries
    attend to its own keys (causal), and the queries of its descendants, which follow it, to all of its keys
    (one product for all of them), as do those of the segments continuing a kept segment (streamx.model.carry)
    to its chain's keys; each query's parts are joined by their log-sum-exps, as flash attention joins its
    blocks. [1, heads, T, d] -> [1, T, heads, d]"""
    heads, values_size = query.shape[1], value.shape[-1]

    def as_query(t: torch.Tensor) -> torch.Tensor:  # the fused kernel takes as many key heads as query heads, and
        t = t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)  # values of the query's
        return t if t.shape[-1] == query.shape[-1] else F.pad(t, (0, query.shape[-1] - t.shape[-1]))  # size (MLA)

    key, value = as_query(key), as_query(value)  # one copy a layer
    joined = torch.empty(query.shape[0], query.shape[2], heads, query.shape[3], dtype=torch.float32)
    out = joined.transpose(1, 2)  # [1, heads, T, d] over the returned layout
    lse = torch.empty(query.shape[:3], dtype=torch.float32)
    pairs = list(zip(forward.bounds, forward.bounds[1:], strict=False))
    for a, b in pairs:
        out[:, :, a:b], lse[:, :, a:b] = _ATTENTION_WITH_LSE(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                             is_causal=True, scale=scale)

    def join(a: int, b: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # queries a:b also see these
        _join_parts(out[:, :, a:b], lse[:, :, a:b], *_ATTENTION_WITH_LSE(query[:, :, a:b], keys, values, scale=scale))

    for (a, b), end in zip(pairs, forward.subtree_ends, strict=True):
        if end != b:
            join(b, end, key[:, :, a:b], value[:, :, a:b])
    for a, end, kept in forward.carried_spans():
        join(a, end, *(as_query(t) for t in forward.kept.chain_keys(kept, layer)))
    return joined[..., :values_size].to(query.dtype)


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
                      cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float | None,
                      window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention over variable-length sequences: sequence i's queries cu_q[i]:cu_q[i+1] attend to its keys
    cu_k[i]:cu_k[i+1] (causal: aligned at the end, so a query sees the keys before its own position; a window:
    only the window - 1 keys before it too). Queries [Tq, heads, d], keys [Tk, kv heads, d], values [Tk, kv heads,
    dv] (dv below d, as MLA's, padded to d for the kernel); returns the output [Tq, heads, dv] and each query's
    log-sum-exp of its scores [heads, Tq]."""
    values_size = value.shape[-1]
    if values_size != query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - values_size))
    out, lse = _VARLEN(query, key, value, cu_q, cu_k, max_q, max_k, return_aux=_AuxRequest(lse=True), scale=scale,
                       window_size=((window - 1 if window else -1), 0) if causal else (-1, -1),
                       enable_gqa=query.shape[1] != key.shape[1])
    return out[..., :values_size], lse


def _varlen_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward: PackedForward,
                           scale: float | None, layer: int) -> torch.Tensor:
    """A packed batch (of trees, or of plain samples) as a few variable-length attention calls: every segment's
    queries on its own keys (causal), in one call; then each of `forward.varlen_joins` (its queries on their
    ancestors' keys, where cu_q differs from cu_k), joined by log-sum-exps as in `_tree_attention`.
    [1, heads, T, d] -> [1, T, heads, d]"""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, d]
    longest = max(forward.length(s) for s in forward.segments)
    out, lse = _varlen_attention(q, k, v, forward.cu_seq_lens, forward.cu_seq_lens, longest, longest, True, scale)
    joins = forward.varlen_joins()
    if joins:
        out = out.float()
    for join in joins:
        if join.kept is None:
            keys, values = k.index_select(0, join.keys), v.index_select(0, join.keys)
        else:
            keys, values = (t[0].transpose(0, 1).contiguous() for t in forward.kept.chain_keys(join.kept, layer))
        part, part_lse = _varlen_attention(q.index_select(0, join.queries), keys, values, join.cu_q, join.cu_k,
                                           join.max_q, join.max_k, False, scale)
        joined, joined_lse = out.index_select(0, join.queries), lse[:, join.queries].T  # [n, heads, d], [n, heads]
        _join_parts(joined, joined_lse, part, part_lse.T)
        out.index_copy_(0, join.queries, joined)
        lse[:, join.queries] = joined_lse.T
    return out.to(query.dtype)[None]


def _runs_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, forward: PackedForward,
                    layer: LayerAttention, index: int) -> torch.Tensor:
    """A layer with a window, chunks, soft-capping or sinks: its queries as runs, each on the keys its queries may
    see; on CUDA in one variable-length call (but soft-capping, which torch's flash kernel lacks), elsewhere a
    product per run of at most RUN_BLOCK queries. [1, heads, T, d] -> [1, T, heads, dv]"""
    varlen = _uses_varlen(query) and layer.softcap is None
    runs = forward.runs(layer.window, layer.chunk, None if varlen else RUN_BLOCK)
    key, value = forward.key_source(key, value, index)
    if varlen:
        return _varlen_runs(query, key, value, runs, layer)
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    for run in runs.runs:
        a, b = run.queries
        keys, values = _take(key, run.keys), _take(value, run.keys)
        out[:, a:b] = _attend(query[:, :, a:b], keys, values, _allowed(run, b - a, keys.shape[2], layer),
                              layer).transpose(1, 2)
    return out


def _take(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The tokens of `ranges` of t [1, heads, tokens, d] (a view where they are one range)."""
    if len(ranges) == 1:
        return t[:, :, ranges[0][0]:ranges[0][1]]
    return torch.cat([t[:, :, a:b] for a, b in ranges], dim=2)


def _allowed(run: Run, queries: int, keys: int, layer: LayerAttention) -> torch.Tensor:
    """[queries, keys] bool: which of its keys (consecutive positions from run.key_position, up to its last
    query's) each query of the run sees: those at its position or before, within the window. The run's keys start
    at its chunk's first position, so a chunk adds nothing here."""
    q = torch.arange(run.position, run.position + queries)[:, None]
    k = torch.arange(run.key_position, run.key_position + keys)[None]
    allowed = k <= q
    if layer.window:
        allowed &= k > q - layer.window
    return allowed


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
            layer: LayerAttention) -> torch.Tensor:
    """Attention of query [1, heads, n, d] on key, value [1, kv heads, m, d|dv] where `allowed` [n, m]:
    soft-capped scores and sinks as transformers' eager attention computes them (in float32), else sdpa."""
    allowed = allowed.to(query.device)
    if layer.softcap is None and layer.sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=layer.scale,
                                              enable_gqa=query.shape[1] != key.shape[1])
    heads = query.shape[1]
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1).float() for t in (key, value))
    scale = layer.scale if layer.scale is not None else query.shape[-1] ** -0.5
    scores = query.float() @ key.transpose(-1, -2) * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if layer.sinks is not None:
        sinks = layer.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return (weights @ value).to(query.dtype)


def _varlen_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: Runs,
                 layer: LayerAttention) -> torch.Tensor:
    """Every run in one variable-length flash attention call (the window as its window_size); sinks joined by
    their log-sum-exps: a sink adds exp(sink) to a query's softmax sum and nothing to its output."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, d]
    gather, cu_q, cu_k, max_q, max_k = runs.varlen(query.device)
    if gather is not None:
        k, v = k.index_select(0, gather), v.index_select(0, gather)
    out, lse = _varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, True,
                                 layer.scale, layer.window)
    if layer.sinks is not None:
        kept_share = torch.sigmoid(lse - layer.sinks.float()[:, None])  # [heads, T]
        out = (out.float() * kept_share.T[..., None]).to(query.dtype)
    return out[None]


try:  # torch >= 2.12: with grouped-query heads and window_size (2.10 and 2.11 took is_causal and no enable_gqa)
    from torch.nn.attention.varlen import AuxRequest as _AuxRequest
    from torch.nn.attention.varlen import varlen_attn as _VARLEN

    if not {"window_size", "enable_gqa", "scale"} <= set(inspect.signature(_VARLEN).parameters):
        _VARLEN = None
except ImportError:
    _VARLEN = _AuxRequest = None

AttentionInterface.register(PACKED_ATTENTION, packed_attention)
