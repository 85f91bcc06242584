"""What a target needs on each GPU, whole or tensor-parallel (--tp N): `streamx plan` sizes a run before any GPU is
at hand, and says which N fits.

The weights are counted on the model built on the meta device (no memory, no files read: every family, MoE and
hybrids alike) at the compute dtype, a quantized checkpoint's as it stores them (streamx.model.quantized). Under
--tp each weight is split N ways where transformers' plan shards it (`sharded`: its projections, embeddings and
head as the family's plan has it) and whole on every GPU where it does not (norms, and what a plan leaves out:
gpt-oss's attention under transformers 5.25, which `plan` names); a MoE's experts are whole on every process
unless --ep spreads them (transformers 5.25: Qwen3-MoE's experts are replicated under TP alone). A forward's
working memory grows with the token budget: the residual stream and its norms, the attention projections and the
MLP's widest intermediate (split N ways), and the captured states of the selected layers; about, not measured
(bench/RESULTS.md has measured peaks). Kept keys are those of a shared prefix continued in later batches
(streamx.model.carry), at most one chain of --token-budget tokens, split N ways (split KV ways where N exceeds the
KV heads, each copied N / KV times: streamx.model.kv_heads).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..base.units import gb
from .carry import kept_bytes_per_token
from .kv_heads import KV_PROJECTIONS, kv_replicas
from .load import heads_refusal
from .quantized import weight_bytes
from .residual import layer_configs, query_width

TP_SIZES = (1, 2, 4, 8, 16)
NODE_GPUS = 8  # a --tp above this spans nodes (torchrun --nnodes): slower collectives, for targets no node holds
HEADROOM = 0.9  # of a GPU's memory that a run may plan on: the CUDA context, the allocator's fragmentation


@dataclass(frozen=True)
class Footprint:
    """Bytes on each GPU of a run at --tp `tp`."""

    tp: int
    weights: int
    activations: int  # about
    kept: int
    ep_saves: int = 0  # what --ep would take off the weights (a MoE's experts, split N ways), where it is not on
    kv_copies: int = 1  # processes holding each key-value head (streamx.model.kv_heads)
    refused: str = ""  # why a run refuses this --tp (its sizes are then 0)
    whole: tuple[str, ...] = ()  # the decoder's parts transformers' plan leaves whole on every GPU (whole_parts)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.kept

    def fits(self, gpu_bytes: int) -> bool:
        return not self.refused and self.total <= HEADROOM * gpu_bytes


def footprints(model: nn.Module, token_budget: int, num_slots: int, ep: bool = False,
               sizes: tuple[int, ...] = TP_SIZES) -> list[Footprint]:
    """The footprint at each --tp of `sizes` (`ep`: with --ep); one whose heads it cannot split says why."""
    text = model.config.get_text_config()
    width = next(model.parameters()).element_size()
    params = weight_bytes(model, width)  # as the checkpoint stores them: a quantized one's quantized
    split_by_plan = sharded(model)
    experts = sum(n for name, n in params.items() if ".experts." in name)
    split = sum(n for name, n in params.items() if split_by_plan[name] and ".experts." not in name)
    whole = sum(params.values()) - split - experts
    kv = sum(n for name, n in params.items() if split_by_plan[name] and name.rsplit(".", 2)[-2] in KV_PROJECTIONS)
    hidden = text.hidden_size
    heads = max(query_width(layer) for layer in layer_configs(model.config))  # (the widest layer's: Gemma 4)
    mlp = max(getattr(text, "intermediate_size", 0) or 0,
              (getattr(text, "moe_intermediate_size", 0) or 0) * (getattr(text, "num_experts_per_tok", 0) or 0))
    kept = token_budget * kept_bytes_per_token(model)
    left_whole = tuple(whole_parts(model))
    out = []
    for tp in sizes:
        if why := heads_refusal(text, tp):
            out.append(Footprint(tp, 0, 0, 0, refused=why))
            continue
        copies = kv_replicas(text, tp)
        copied = kv if copies > 1 else 0  # KV projections copied are loaded whole (model.kv_heads)
        weights = whole + copied + (split - copied) // tp + (experts // tp if ep else experts)
        working = token_budget * (width * (6 * hidden + (3 * heads + 3 * mlp) // tp) + 2 * num_slots * hidden)
        out.append(Footprint(tp, weights, working, kept * copies // tp, 0 if ep else experts - experts // tp,
                             kv_copies=copies, whole=left_whole if tp > 1 else ()))
    return out


def sharded(model: nn.Module) -> dict[str, bool]:
    """Whether transformers' tensor-parallel plan splits each parameter over a --tp group: its own rule or its
    module's shards it (column- or row-wise, an embedding's rows); norms it replicates and modules it names in no
    rule stay whole on every process (gpt-oss's attention, under transformers 5.25's plan)."""
    rules = [(re.compile(re.escape(key).replace(r"\*", r"\d+") + r"(\..+)?"), style)
             for key, style in model.tp_plan.items()]
    out = {}
    for name, _ in model.named_parameters():
        style = next((style for rule, style in rules if rule.fullmatch(name)), "")
        out[name] = "colwise" in style or "rowwise" in style or style.startswith("packed")
    return out


def whole_parts(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """The decoder's parts (a layer's submodules: self_attn, mlp) that the plan leaves whole on every process, where
    they are a sizeable share (5%) of its weights besides the experts (reported by `plan` and the run); `skip`: the
    modules (by name) left out of the count (KV projections loaded whole to be copied: model.kv_heads)."""
    split_by_plan, sizes = sharded(model), Counter()
    total = 0
    for name, p in model.named_parameters():
        if ".layers." not in f".{name}" or ".experts." in name or p.ndim < 2 or name.rsplit(".", 2)[-2] in skip:
            continue
        total += p.numel()
        if not split_by_plan[name]:
            sizes[name.split("layers.", 1)[1].split(".")[1]] += p.numel()
    return sorted(part for part, n in sizes.items() if n >= 0.05 * total)


def fit_lines(found: list[Footprint], gpu_bytes: int, dtype: torch.dtype, token_budget: int,
              quantized: str | None = None) -> list[str]:
    """`streamx plan`'s lines: each --tp's bytes per GPU, whether it fits GPUs of `gpu_bytes`, the smallest that
    does; `quantized`: what of the checkpoint is quantized (streamx.model.quantized.describe)."""
    def size(n: int) -> str:  # one decimal in GB at every size: the lines' figures line up
        return f"{n / 1e9:,.1f} GB"

    lines = [f"gpu memory   per GPU, {str(dtype).removeprefix('torch.')}, --token-budget {token_budget:,}: weights + "
             f"a forward's working memory (about) + kept keys, against {size(gpu_bytes)} GPUs ({HEADROOM:.0%} planned)"]
    if whole := next((f.whole for f in found if f.whole), ()):
        lines.append(f"  transformers' tensor-parallel plan leaves {', '.join(whole)} whole on every GPU under --tp "
                     "(counted so)")
    if quantized:
        lines.append(f"  weights: {quantized}")
    for f in found:
        if f.refused:
            lines.append(f"  --tp {f.tp:<6} refused: {f.refused.removeprefix(f'--tp {f.tp} ')}")
            continue
        notes = [f"each key-value head on {f.kv_copies} GPUs"] * (f.kv_copies > 1) + \
            [f"{f.tp // NODE_GPUS} nodes of {NODE_GPUS}: torchrun --nnodes {f.tp // NODE_GPUS}"] * (f.tp > NODE_GPUS)
        lines.append(f"  --tp {f.tp:<6} {size(f.weights)} + {size(f.activations)} + {size(f.kept)} = {size(f.total)}   "
                     + ("fits" if f.fits(gpu_bytes) else "does not fit") + "".join(f" ({n})" for n in notes))
    fitting = next((f.tp for f in found if f.fits(gpu_bytes)), None)
    tried = [f.tp for f in found if not f.refused]
    lines.append("  " + (f"--tp {fitting} is the smallest that fits (docs/scaling.md); --gpu-memory GB for other GPUs"
                         if fitting else f"no --tp of {tried} fits: a smaller --token-budget, more "
                         "GPUs per group, or --device-map over one process's GPUs"))
    spread = next((f for f in found if f.total - f.ep_saves <= HEADROOM * gpu_bytes and f.ep_saves), None)
    if spread and (fitting is None or spread.tp < fitting):
        lines.append(f"  --tp {spread.tp} --ep fits: {size(spread.total - spread.ep_saves)} per GPU with the experts "
                     f"spread over the group, {size(spread.ep_saves)} less (docs/scaling.md)")
    return lines


def held_share(model: nn.Module, tp: int) -> str:
    """What this process of a --tp group holds of the model's weights, measured on the loaded model (a sharded
    parameter holds its shard, a copied KV head its own), and the parts the plan leaves whole: for the run's log,
    beside what `plan` assumed."""
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    copied = kv_replicas(model.config.get_text_config(), tp) > 1
    whole = whole_parts(model, KV_PROJECTIONS if copied else ())
    return (f"this process holds {gb(held)} of the weights' {gb(full)} ({held / full:.1%})"
            + (f"; transformers' plan leaves {', '.join(whole)} whole on every process" if whole else ""))
