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
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..config import check_layer_ids
from ..data.batching import Batch
from .carry import Kept, carrying
from .gather import GatherFn
from .residual import residual_of
from .segments import forward_inputs

# the model's attribute naming the ids < L read at layer k's input rather than at layer k-1's output: where its
# forward changes the state between the two (proven by streamx.proof.ids, set by the run's plan)
READ_AT_INPUTS = "_streamx_read_at_inputs"


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
    """The decoder of `model`, found by what the model is, not by the names its family gives it: its layers are the
    module list whose blocks transformers records as the model's hidden states (each model class declares them:
    `_can_record_outputs["hidden_states"]`, applied to its own modules as transformers applies it), of the text
    model where a multimodal model has several stacks; for a family that declares none, the longest list of blocks
    of one class that a model class holds itself. The decoder is the model class that holds that list (streamx
    calls it: no lm_head), and its final norm a module it holds whose parameters are a norm's (_final_norm)."""
    recorded = _recorded_lists(model)
    stacks = [(owner, layers) for owner, layers in recorded.values() if _held_by(owner, layers)] \
        or _block_stacks(model)
    if not stacks:
        name = type(model).__name__
        if recorded:  # e.g. HRM: two stacks inside sub-modules, called in cycles (ids by layer would mean nothing)
            raise LayerDiscoveryError(f"cannot number the decoder layers of {name}: the blocks it records as hidden "
                                      f"states sit in {len(recorded)} module lists that no model class holds itself "
                                      f"({', '.join(recorded)}), a decoder of several stacks, not one list of layers")
        kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.ModuleList)})
        raise LayerDiscoveryError(f"cannot find the decoder layers of {name}: no module list whose "
                                  f"blocks it records as hidden states, nor a list of blocks of one class held by a "
                                  f"model class (module lists: {', '.join(kinds) or 'none'})")
    text = model.config.get_text_config() if hasattr(model, "config") else None
    owner, layers = max(stacks, key=lambda stack: (text is not None and _is_text_model(stack[0], text), len(stack[1])))
    return Decoder(owner, layers, _final_norm(owner, layers))


def _records(spec: Any, module: nn.Module, name: str) -> bool:
    """Whether transformers records `module` (at `name`) as a hidden state, under a model class's `spec`
    (a class, a class name, an OutputRecorder, or a list of them)."""
    if isinstance(spec, list):
        return any(_records(one, module, name) for one in spec)
    if isinstance(spec, str):
        return name.endswith(spec)
    if isinstance(spec, (type, tuple)):
        return isinstance(module, spec)
    target, suffix = getattr(spec, "target_class", None), getattr(spec, "class_name", None)
    matched = (target is not None and isinstance(module, target)) or (suffix is not None and name.endswith(suffix))
    layer = getattr(spec, "layer_name", None)
    return matched and (layer is None or f".{layer.strip('.')}." in name + ".")


def _recorded_lists(model: nn.Module) -> dict[str, tuple[nn.Module, nn.ModuleList]]:
    """By path, (model class, module list) for each list of blocks transformers records as hidden states, each under
    the declaration of the innermost model class that holds it (as transformers installs its recording hooks)."""
    lists: dict[str, tuple[nn.Module, nn.ModuleList]] = {}

    def walk(module: nn.Module, name: str, owner: nn.Module | None, spec: Any) -> None:
        if isinstance(module, PreTrainedModel):
            owner, spec = module, (type(module)._can_record_outputs or {}).get("hidden_states")
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}", owner, spec)
            if isinstance(module, nn.ModuleList) and spec is not None and owner is not None \
                    and _records(spec, child, f"{name}.{child_name}"):
                lists[name.lstrip(".")] = (owner, module)

    walk(model, "", None, None)
    return lists


def _block_stacks(model: nn.Module) -> list[tuple[nn.Module, nn.ModuleList]]:
    """(model class, module list) for each list of two or more blocks of one class a model class holds itself."""
    return [(owner, child) for owner in model.modules() if isinstance(owner, PreTrainedModel)
            for child in owner.children()
            if isinstance(child, nn.ModuleList) and len(child) > 1 and len({type(block) for block in child}) == 1]


def _held_by(owner: nn.Module, layers: nn.ModuleList) -> bool:
    """Whether `owner` holds `layers` itself, not inside a block of its own (a MoE's experts, a layer's sublayers)."""
    return any(child is layers for child in owner.children())


def _is_text_model(owner: nn.Module, text: Any) -> bool:
    config = getattr(owner, "config", None)
    return config is text or type(config) is type(text)


def _final_norm(owner: nn.Module, layers: nn.ModuleList) -> nn.Module | None:
    """Of the modules `owner` holds itself whose parameters are vectors of one length (a norm's weight and bias),
    the first after `layers`, else the last before them (OPT registers its final norm first): a structural guess,
    which verify's and the start-up check's comparison with the model's own last hidden state prove."""
    children = list(owner.children())
    at = next(i for i, child in enumerate(children) if child is layers)
    norms = [i for i, child in enumerate(children)
             if (params := list(child.parameters())) and all(p.dim() == 1 for p in params)
             and len({p.numel() for p in params}) == 1]
    after = [i for i in norms if i > at]
    return children[after[0]] if after else children[norms[-1]] if norms else None


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
        at_inputs = getattr(model, READ_AT_INPUTS, frozenset())  # (proof.ids: where the forward changes the state)
        for slot, layer_id in enumerate(self.layer_ids):
            stop = layer_id == deepest
            if layer_id == 0 or layer_id in at_inputs:
                hook = self._pre_hook(slot, stop)
                self._handles.append(self.layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True))
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
