"""What id k holds, proven on the loaded model against its own definition, before any batch.

streamx's hooks read id 0 at the first layer's input and id k at layer k-1's output (model.capture). What the model
itself says its layers produce is its `output_hidden_states`: transformers records each call of the blocks the
model class declares (`_can_record_outputs`), or the family's forward fills the tuple itself. The two agree for a
decoder that calls each layer once, in order, and passes each layer's output on as the next one's input. Where they
do not (a layer called twice per forward, a layer the forward skips, a block whose output the forward changes before
the next layer reads it), a store of the hooks' views would hold states the model's own tuple contradicts: the seed
bug of this project, an id that means something else than its number. So on one probe row the hooks' views are
compared with the tuple, and the run stores each id where the tuple holds it (a layer's output, or the next layer's
input where the forward changes the state between them), or is refused in one line.

The tuple is aligned as its family fills it: from the embeddings (transformers' recorded blocks and most families), or
from the first layer's output (Mamba's and RWKV's forwards, which leave the embeddings out). Its last entry is after
the final norm: id L (before it) is the last layer's output in every family.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from ..model.capture import find_decoder
from ..model.residual import residual_of
from .tolerance import relative_error

PROBE_TOKENS = 24  # the probe row's length
AGREE = 1e-4  # the hooks see the very tensors the tuple records: equal but for a copy's rounding


class CaptureRefused(ValueError):
    """The hooks' view of an id is not what the model's own forward records: one line saying where and why."""


@dataclass(frozen=True)
class IdProof:
    """What the probe forward proved: the ids read at the next layer's input rather than the previous one's
    output (the forward changes the state between them), and how the model's tuple is aligned."""

    inputs: frozenset[int] = field(default_factory=frozenset)
    offset: int = 0  # the tuple's entry j holds id j + offset: 0 from the embeddings, 1 from the first layer's output
    norm: str = ""  # what the final norm was found to do (id L through it against the tuple's last entry)

    def note(self) -> str:
        taps = (f"; ids {', '.join(map(str, sorted(self.inputs)))} read at the next layer's input (the forward "
                "changes the state after the layer before)") if self.inputs else ""
        start = "the first layer's output" if self.offset else "the embeddings"
        return f"every id < L is the model's own output_hidden_states (which start at {start}){taps}{self.norm}"


def probe_ids(vocab_size: int) -> torch.Tensor:
    """[1, PROBE_TOKENS] token ids spread over the vocabulary (none of them special by construction)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (1, PROBE_TOKENS), generator=generator)


@torch.inference_mode()
def prove_ids(model: nn.Module) -> IdProof:
    """Prove on one probe row that every id < L the hooks read is the model's own output_hidden_states entry (see the
    module's docstring); returns where each id is read, raises CaptureRefused where no hook gives it."""
    decoder, residual = find_decoder(model), residual_of(model.config)
    calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, its input, its output), in call order
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(decoder.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: seen.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
        handles.append(layer.register_forward_hook(
            lambda m, args, out, i=i: calls.append((i, seen[i], out[0] if isinstance(out, (tuple, list)) else out))))
    device = next(model.parameters()).device
    text = model.config.get_text_config()
    try:
        out = decoder.module(input_ids=probe_ids(text.vocab_size).to(device), output_hidden_states=True,
                             use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    L = len(decoder.layers)
    counts = Counter(i for i, _, _ in calls)
    again = sorted(i for i, n in counts.items() if n > 1)
    if again:
        raise CaptureRefused(
            f"the model's forward calls layer{'s' if len(again) > 1 else ''} {', '.join(map(str, again))} of its "
            f"{L} more than once (a loop: {len(calls)} calls, which its output_hidden_states records one by one); "
            "streamx numbers ids by layer and would store a later call's states where the model's own tuple holds "
            "an earlier one's: not supported")
    skipped = [i for i in range(L) if i not in counts]
    if skipped:
        raise CaptureRefused(
            f"the model's forward does not call layer{'s' if len(skipped) > 1 else ''} "
            f"{', '.join(map(str, skipped))} of its {L} on a text row (e.g. Mllama's cross-attention layers without "
            "an image): the ids next to them hold no state of their own; not supported")
    # (the last entry, after the final norm or a multi-stream residual's contraction, is compared with no id)
    flat = [residual.flat(h) for h in out.hidden_states[:-1]] + [None] if out.hidden_states is not None else []
    by_layer = sorted(calls, key=lambda call: call[0])  # (each layer called once: checked above)
    inputs = [residual.flat(x) for _, x, _ in by_layer]
    outputs = [residual.flat(y) for _, _, y in by_layer]
    if len(flat) != L + 1:
        raise CaptureRefused(f"the model's output_hidden_states holds {len(flat)} states for its {L} layers (L + 1 "
                             "expected): streamx cannot prove what its ids hold")
    best = None
    for offset in (0, 1):
        proof, first_wrong = _aligned(flat, inputs, outputs, offset, L)
        if first_wrong is None:
            return IdProof(frozenset(proof), offset, _final_norm(model, decoder, residual, outputs[-1],
                                                                 out.hidden_states[-1]))
        best = first_wrong if best is None or first_wrong[0] > best[0] else best
    k, error = best
    raise CaptureRefused(
        f"id {k}, layer {k - 1}'s output as its hook sees it (and layer {k}'s input), differs from the model's own "
        f"output_hidden_states by {error:.3g} (relative): the forward changes the state in a way streamx cannot "
        "read from the layers; not supported")


def _aligned(flat: list[torch.Tensor | None], inputs: list[torch.Tensor], outputs: list[torch.Tensor], offset: int,
             L: int) -> tuple[set[int], tuple[int, float] | None]:
    """With the tuple's entry j holding id j + offset: the ids read at the next layer's input, and the first id
    (with its difference) that neither the previous layer's output nor the next layer's input gives (None: all do).
    Compares ids 0..L-1 (offset 0) or 1..L (offset 1): the tuple's last entry is after the final norm."""
    at_inputs: set[int] = set()
    for j in range(L):
        k = j + offset
        want = flat[j]
        views = [("output", outputs[k - 1])] if k > 0 else []
        views += [("input", inputs[k])] if k < L else []
        errors = {name: _relative(view, want) for name, view in views}
        name, error = min(errors.items(), key=lambda item: item[1])
        if error > AGREE:
            return at_inputs, (k, error)
        if k > 0 and errors.get("output", float("inf")) > AGREE:
            at_inputs.add(k)
    return at_inputs, None


def _final_norm(model: nn.Module, decoder, residual, last: torch.Tensor, after: torch.Tensor) -> str:
    """What the decoder's final norm (as find_decoder found it) does to id L against the tuple's last entry: the
    trainers' converts that take the state after the norm apply it."""
    if residual.streams > 1:  # (the last entry is the streams' contraction, normed: the converts apply both)
        return ""
    if decoder.norm is None:
        return "; no final norm found (the converts that take the state after it refuse this model)"
    name = next(name for name, module in model.named_modules() if module is decoder.norm)
    error = _relative(decoder.norm(last), after)
    if error <= AGREE:
        return f"; {name} applied to id L gives its last hidden state (the final norm)"
    return (f"; {name} applied to id L differs from its last hidden state by {error:.3g}: the converts that take the "
            "state after the final norm would write other states than the model's")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest per-token relative difference (proof.check's measure); inf where the shapes differ."""
    return float(relative_error(got.float(), want.float()).max()) if got.shape == want.shape else float("inf")
