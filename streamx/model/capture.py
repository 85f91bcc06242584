"""Forward hooks on exactly the selected layers, gathering their real tokens at hook time.

Layer ids follow the speculators convention (docs/layers.md), for a decoder of L layers:
  id 0        the embeddings output = input of layers[0]         (forward pre-hook on layers[0])
  id k, 1..L  the residual stream leaving layers[k-1]            (forward hook on layers[k-1])
so id L is the last layer's output *before* the final norm (HF's hidden_states[L] is after it).
Only the decoder stack runs (never the lm_head), and it stops right after the deepest hook. Each
hook gathers its layer's real tokens into one slot of the [N, K, H] states buffer (streamx.model.gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import check_layer_ids
from ..data.batching import Batch
from .carry import Kept, carrying
from .gather import GatherFn
from .residual import residual_of
from .segments import forward_inputs

# Where decoder stacks live across transformers architectures (first match wins); each is tested
# (tests/test_capture.py), since bench, verify and packing call the decoder found here too.
LAYER_PATHS = (
    "model.layers",  # Llama, Qwen2/3, Qwen3-MoE, Qwen3.5 text, Mistral, Gemma
    "model.language_model.layers",  # multimodal wrappers (Qwen3.5 / Gemma3 conditional generation)
    "language_model.model.layers",  # older multimodal wrappers (LLaVA style)
    "layers",  # a bare decoder
)


FINAL_NORMS = ("norm", "final_layernorm", "final_norm", "norm_f", "ln_f")  # the decoder's final norm, by family
# (Llama and most; Jamba, Phi; Falcon-H1; Mamba; GPT-2)


class LayerDiscoveryError(ValueError):
    pass


class _StopForward(Exception):
    """Raised by the deepest hook: nothing after it is needed."""


@dataclass(frozen=True)
class Decoder:
    """The part of a causal LM that streamx runs: the decoder stack without the lm_head."""

    module: nn.Module  # called with a batch's inputs (Batch.model_inputs)
    layers: nn.ModuleList
    norm: nn.Module | None  # the final norm: id L is its input (verify)


def find_decoder(model: nn.Module) -> Decoder:
    """The decoder of `model`, wherever its architecture keeps it (LAYER_PATHS)."""
    for path in LAYER_PATHS:
        module: nn.Module | None = model
        for part in path.split(".")[:-1]:
            module = getattr(module, part, None)
        layers = getattr(module, path.split(".")[-1], None) if module is not None else None
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            norm = next((n for name in FINAL_NORMS if isinstance(n := getattr(module, name, None), nn.Module)), None)
            return Decoder(module, layers, norm)
    raise LayerDiscoveryError(
        f"cannot find the decoder layers of {type(model).__name__}: looked for {', '.join(LAYER_PATHS)}"
    )


class LayerCapture:
    """Hooks that write the selected layers of each forward into an [N, K, H] states buffer.

    Use as a context manager (hooks are removed on exit) and call `forward(batch, states)`; the states a cut
    tree's batches keep for the later ones are its own (`kept`)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], gather_fn: GatherFn):
        decoder = find_decoder(model)
        self.decoder, self.layers = decoder.module, decoder.layers
        self.layer_ids = check_layer_ids(layer_ids, len(self.layers))
        self.gather_fn = gather_fn
        self.residual = residual_of(model.config)  # several streams per token: stored whole, flattened
        self.kept = Kept()
        self._target: tuple[torch.Tensor, torch.Tensor] | None = None  # (states, token_index) of the running batch
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        deepest = max(self.layer_ids)
        for slot, layer_id in enumerate(self.layer_ids):
            stop = layer_id == deepest
            if layer_id == 0:
                hook = self._pre_hook(slot, stop)
                self._handles.append(self.layers[0].register_forward_pre_hook(hook, with_kwargs=True))
            else:
                self._handles.append(self.layers[layer_id - 1].register_forward_hook(self._post_hook(slot, stop)))

    def _gather(self, slot: int, hidden: torch.Tensor, stop: bool) -> None:
        if self._target is None:  # a forward outside `forward()`: leave it alone
            return
        states, token_index = self._target
        hidden = self.residual.flat(hidden)
        self.gather_fn(states, slot, hidden.to(states.device) if hidden.device != states.device else hidden,
                       token_index)
        if stop:
            raise _StopForward

    def _pre_hook(self, slot: int, stop: bool):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._gather(slot, hidden, stop)

        return hook

    def _post_hook(self, slot: int, stop: bool):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output  # MoE/older layers return tuples
            self._gather(slot, hidden, stop)

        return hook

    @torch.inference_mode()
    def forward(self, batch: Batch, states: torch.Tensor) -> None:
        """Run the decoder on `batch` and fill states [batch.num_tokens, K, H] (bf16, on the model's device).
        Batches of a tree cut into several run in order (streamx.model.carry)."""
        device = states.device
        self._target = (states, batch.token_index.to(device, non_blocking=True))
        try:
            with carrying(batch.carry, self.kept):
                try:
                    self.decoder(**forward_inputs(batch, device, self.kept), use_cache=False)
                except _StopForward:
                    pass
                else:
                    raise RuntimeError("the forward finished without reaching the deepest selected layer's hook")
        finally:
            self._target = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.kept.clear()  # a run that stopped inside a cut tree kept states no later batch will read

    def __enter__(self) -> LayerCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def segment_is_finite(states: torch.Tensor, segment_index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """[B] bool: every captured value of segment b is finite (rows reading NaN/Inf are rejected, not stored).
    segment_index [N] maps each token to its segment; computed on the host, so no device sync here."""
    token_ok = torch.isfinite(states).flatten(1).all(dim=1)
    bad = torch.zeros(num_segments, device=states.device, dtype=torch.int32)
    bad.index_add_(0, segment_index.to(states.device, non_blocking=True), (~token_ok).to(torch.int32))
    return bad == 0
