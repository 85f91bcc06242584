"""Forward hooks on exactly the selected layers, packing their real tokens at hook time.

Layer ids follow the speculators convention (docs/layers.md), for a decoder of L layers:
  id 0        the embeddings output = input of layers[0]         (forward pre-hook on layers[0])
  id k, 1..L  the residual stream leaving layers[k-1]            (forward hook on layers[k-1])
so id L is the last layer's output *before* the final norm (HF's hidden_states[L] is after it).
Only the decoder stack runs (never the lm_head), and it stops right after the deepest hook.
"""

from __future__ import annotations

import torch
from torch import nn

from .batching import Batch
from .config import check_layer_ids
from .pack import PackFn

# Where decoder stacks live across transformers architectures (first match wins).
LAYER_PATHS = (
    "model.layers",  # Llama, Qwen2/3, Qwen3-MoE, Qwen3.5 text, Mistral, Gemma
    "model.language_model.layers",  # multimodal wrappers (Qwen3.5 / Gemma3 conditional generation)
    "language_model.model.layers",
    "model.decoder.layers",  # OPT
    "transformer.h",  # GPT-2 style
    "layers",  # a bare decoder
)


class LayerDiscoveryError(ValueError):
    pass


class _StopForward(Exception):
    """Raised by the deepest hook: nothing after it is needed."""


def find_decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The module to call (the decoder stack, without lm_head) and its list of layers."""
    for path in LAYER_PATHS:
        module: nn.Module | None = model
        for part in path.split(".")[:-1]:
            module = getattr(module, part, None)
        layers = getattr(module, path.split(".")[-1], None) if module is not None else None
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return module, layers
    raise LayerDiscoveryError(
        f"cannot find the decoder layers of {type(model).__name__}: looked for {', '.join(LAYER_PATHS)}"
    )


def num_decoder_layers(model: nn.Module) -> int:
    return len(find_decoder(model)[1])


class LayerCapture:
    """Hooks that write the selected layers of each forward into a packed [N, K, H] buffer.

    Use as a context manager (hooks are removed on exit) and call `forward(batch, packed)`."""

    def __init__(self, model: nn.Module, layer_ids: list[int], pack_fn: PackFn):
        self.decoder, self.layers = find_decoder(model)
        self.layer_ids = check_layer_ids(layer_ids, len(self.layers))
        self.pack_fn = pack_fn
        self._target: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed, token_index) of the running batch
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        deepest = max(self.layer_ids)
        for slot, layer_id in enumerate(self.layer_ids):
            stop = layer_id == deepest
            if layer_id == 0:
                hook = self._pre_hook(slot, stop)
                self._handles.append(self.layers[0].register_forward_pre_hook(hook, with_kwargs=True))
            else:
                self._handles.append(self.layers[layer_id - 1].register_forward_hook(self._post_hook(slot, stop)))

    def _pack(self, slot: int, hidden: torch.Tensor, stop: bool) -> None:
        if self._target is None:  # a forward outside `forward()`: leave it alone
            return
        packed, token_index = self._target
        self.pack_fn(packed, slot, hidden.to(packed.device) if hidden.device != packed.device else hidden, token_index)
        if stop:
            raise _StopForward

    def _pre_hook(self, slot: int, stop: bool):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._pack(slot, hidden, stop)

        return hook

    def _post_hook(self, slot: int, stop: bool):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output  # MoE/older layers return tuples
            self._pack(slot, hidden, stop)

        return hook

    @torch.inference_mode()
    def forward(self, batch: Batch, packed: torch.Tensor) -> None:
        """Run the decoder on `batch` and fill packed [batch.num_tokens, K, H] (bf16, on the model's device)."""
        device = packed.device
        self._target = (packed, batch.token_index.to(device, non_blocking=True))
        try:
            self.decoder(**batch.model_inputs(device), use_cache=False)
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

    def __enter__(self) -> LayerCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sample_is_finite(packed: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    """[B] bool: every captured value of sample b is finite (NaN/Inf samples are rejected, not stored).
    sample_index [N] maps each packed token to its sample; computed on the host, so no device sync here."""
    token_ok = torch.isfinite(packed).flatten(1).all(dim=1)
    bad = torch.zeros(num_samples, device=packed.device, dtype=torch.int32)
    bad.index_add_(0, sample_index.to(packed.device, non_blocking=True), (~token_ok).to(torch.int32))
    return bad == 0
