"""Padding-free forward passes: several samples side by side in one sequence, kept apart.

A packed batch (batching.make_packed_batch) is one row of the samples' real tokens, with position
ids restarting at 0 for each sample and `cu_seq_lens` marking where each one starts (Batch.model_inputs
hands them to the decoder). Three things
must keep the samples apart:

- attention: the `streamx_packed_sdpa` implementation runs transformers' own sdpa attention once
  per sample segment (causal inside it), so a packed batch costs what its samples cost alone, never
  a (sum of lengths)^2 mask; flash_attention_2/3 read the same `cu_seq_lens` natively (varlen);
- recurrent and convolutional layers (gated delta-net, causal conv1d) must reset at each boundary,
  which depends on the kernels transformers finds (fla reads `cu_seq_lens`; transformers' torch
  fallbacks and its causal conv1d without the `causal-conv1d` package do not): where they do not,
  `SampleWise` runs those layers once per sample (the rest of the model still sees the whole batch);
- nothing else may mix tokens (MLPs, MoE routing and norms work per token).

Rather than trust versions and kernels, `enable` proves it on the loaded model: a probe runs two
unrelated samples packed and each alone and compares every layer's output of the second one. Where
they differ with the model's own kernels, the linear-attention layers go sample-wise and the probe
runs again; where they still differ, or the attention implementation has no packed path, the run
uses padded batches and says why (in the log and the store's metadata).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..data.batching import make_packed_batch
from ..data.tokenize import Sample
from .capture import find_decoder

PACKED_SDPA = "streamx_packed_sdpa"
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")  # transformers' own packed (varlen) paths
PROBE_LENGTHS = (48, 24)  # a first sample, then the one that must not see it
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # attention features the per-segment path does not implement


class _Segments:
    """The host copy of the running batch's boundaries: `cu_seq_lens_q` lives on the device, and reading
    it there in every layer would stall the GPU, so it is read once per batch."""

    tensor: torch.Tensor | None = None
    bounds: list[int] = []

    @classmethod
    def of(cls, cu_seq_lens: torch.Tensor) -> list[int]:
        if cu_seq_lens is not cls.tensor:
            cls.tensor, cls.bounds = cu_seq_lens, cu_seq_lens.tolist()
        return cls.bounds


def packed_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa attention over each sample of a packed row separately: [1, heads, T, d] -> [1, T, heads, d]."""
    unsupported = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported or attention_mask is not None:
        raise NotImplementedError(f"packed attention does not implement {unsupported or 'an attention mask'}")
    cu_seq_lens = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(name, None)
    if cu_seq_lens is None:  # one sample (e.g. an unbatched forward)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
    bounds = _Segments.of(cu_seq_lens)
    outputs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                      is_causal=True, **kwargs)[0] for a, b in zip(bounds, bounds[1:], strict=False)]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa)

SEQUENCE_MIXERS = ("linear_attn",)  # decoder-layer modules that mix tokens besides attention (Qwen3-Next/3.5/3.6)
_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class SampleWise:
    """Runs the decoder's sequence-mixing layers (gated delta-net linear attention with its causal conv1d)
    once per sample of a packed row, so that each starts from a clean state whatever kernels transformers
    found; everything else still runs over the whole row. A pre-hook on the decoder takes each forward's
    boundaries (`cu_seq_lens_q`); a forward without them (padded batches) runs the layers as they are."""

    def __init__(self, model: nn.Module):
        decoder = find_decoder(model).module
        self.modules = sequence_mixers(model)
        self.bounds: list[int] | None = None
        self._hook = decoder.register_forward_pre_hook(self._take_bounds, with_kwargs=True)
        self._own_forwards = [module.__dict__.get("forward") for module in self.modules]  # e.g. accelerate's hooks
        for module in self.modules:
            module.forward = self._per_sample(module.forward)

    def _take_bounds(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        self.bounds = None if cu_seq_lens is None else _Segments.of(cu_seq_lens)

    def _per_sample(self, forward):
        def per_sample(*args, **kwargs):
            bounds = self.bounds
            if bounds is None:  # not packed
                return forward(*args, **kwargs)
            hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
            args = args[1:] if args and hidden is args[0] else args
            for name in _BOUNDARY_KWARGS:  # each call sees one plain sequence
                kwargs.pop(name, None)
            outputs = [forward(hidden[:, a:b], *args, **kwargs) for a, b in zip(bounds, bounds[1:], strict=False)]
            if not all(isinstance(out, torch.Tensor) for out in outputs):
                raise NotImplementedError(f"sample-wise layers return tensors; got {type(outputs[0]).__name__}")
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

        return per_sample

    def remove(self) -> None:
        self._hook.remove()
        for module, forward in zip(self.modules, self._own_forwards, strict=True):
            if forward is None:
                del module.forward  # back to the class's own
            else:
                module.forward = forward


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
            layers = (f"; its {self.sample_wise_layers} linear-attention layers run once per sample"
                      if self.sample_wise_layers else "")
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


@torch.inference_mode()
def probe(model: nn.Module) -> str | None:
    """Run two unrelated samples packed and each alone; None when the second one's states at every layer
    are the same both ways (up to rounding), else where they differ."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    first, second = (Sample(i, torch.randint(0, vocab, (n,), generator=g), torch.ones(n, dtype=torch.long))
                     for i, n in enumerate(PROBE_LENGTHS))
    decoder = find_decoder(model).module
    try:
        packed = decoder(**make_packed_batch([first, second]).model_inputs(device), use_cache=False,
                         output_hidden_states=True).hidden_states
        alone = decoder(input_ids=second.input_ids[None].to(device), use_cache=False,
                        output_hidden_states=True).hidden_states
    except (NotImplementedError, TypeError, ValueError, RuntimeError) as err:
        return f"the packed forward failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    tolerance = 1e-3 if packed[0].dtype == torch.float32 else 5e-2  # a leak moves states by O(1)
    for layer, (p, a) in enumerate(zip(packed, alone, strict=True)):
        got, want = p[0, PROBE_LENGTHS[0]:].float(), a[0].float()
        error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
        if not error <= tolerance:
            return (f"a sample's states depend on the sample packed before it (layer output {layer}: relative "
                    f"difference {error:.2g}); this model's layers or kernels do not reset at sample boundaries")
    return None
