"""Tensor parallel past the key-value heads: --tp N where N exceeds the model's KV heads (Qwen3-235B-A22B has 4 at
--tp 8), as vLLM and SGLang serve such models: each KV head is copied to the N / KV processes whose query heads
read it.

transformers' plan shards k_proj and v_proj column-wise, N ways, which cuts a head in parts when N > KV. Here the
plan replicates them instead (every process loads them whole: they are a small part of the attention), and after
loading each process keeps the rows of the one KV head its query heads read: query heads are sharded in
contiguous blocks of Q / N, so process r reads KV head r * KV // N, and its attention's `num_key_value_groups`
becomes its Q / N query heads per its one KV head. The forward is then the model's own, head for head.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from .residual import layer_configs

KV_PROJECTIONS = ("k_proj", "v_proj")


def kv_replicas(config: PretrainedConfig, tp: int) -> int:
    """How many processes of a --tp `tp` group hold a copy of each KV head: tp / KV where the group is a multiple
    of the KV heads larger than them, the query heads split evenly, and the plan shards k_proj and v_proj on their
    own (not a fused projection); else 1 (no copies: the plan's own sharding, or a --tp it cannot take)."""
    kv = {getattr(layer, "num_key_value_heads", None) for layer in layer_configs(config)}
    if len(kv) != 1:  # key-value heads differ per layer (Gemma 4): no copies; each layer's must divide --tp
        return 1
    kv, q = kv.pop(), config.num_attention_heads
    plan = getattr(config, "base_model_tp_plan", None) or {}
    separate = all(any(key.endswith(f".{p}") and style == "colwise" for key, style in plan.items())
                   for p in KV_PROJECTIONS)
    if not kv or not separate or tp <= kv or tp % kv or q % tp:
        return 1
    return tp // kv


def replicated_plan(model: nn.Module) -> dict[str, str]:
    """The plan overrides that load k_proj and v_proj whole on every process (`model`: built on the meta device,
    whose `tp_plan` names them as transformers matches them)."""
    return {key: "replicate" for key, style in model.tp_plan.items()
            if key.rsplit(".", 1)[-1] in KV_PROJECTIONS and style == "colwise"}


def keep_own_kv_head(model: nn.Module, config: PretrainedConfig, tp_rank: int, tp: int) -> int:
    """In each attention of `model` (loaded with replicated_plan), keep the KV head this process's query heads read;
    returns how many attentions were changed."""
    kv, q = config.num_key_value_heads, config.num_attention_heads
    head = tp_rank * kv // tp
    changed = 0
    for attention in model.modules():
        projections = [getattr(attention, p, None) for p in KV_PROJECTIONS]
        if not all(isinstance(p, nn.Linear) for p in projections) or not hasattr(attention, "num_key_value_groups"):
            continue
        for linear in projections:
            size = linear.out_features // kv
            rows = slice(head * size, (head + 1) * size)
            linear.weight = nn.Parameter(_local(linear.weight)[rows].clone(), requires_grad=False)
            if linear.bias is not None:
                linear.bias = nn.Parameter(_local(linear.bias)[rows].clone(), requires_grad=False)
            linear.out_features = size
        attention.num_key_value_groups = q // tp  # its query heads, all reading its one KV head
        changed += 1
    return changed


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on this process (a replicated DTensor's local copy)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
