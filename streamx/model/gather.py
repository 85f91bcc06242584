"""Gather the real tokens of one layer's activations into slot k of the bf16 states buffer.

`gather_into(states, slot, hidden, token_index)` is what the capture hooks call, once per
selected layer: states is [N, K, H] bfloat16, hidden is [B, S, H] (any float dtype, H
contiguous), token_index holds the flat b * S + t of the N real tokens. The torch path runs
everywhere; the Triton kernel (streamx_kernels, in kernels/) takes the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:  # triton ships for Linux only; elsewhere the torch path is the only one
    from streamx_kernels.gather import gather_into_triton
except ImportError as err:
    gather_into_triton, _no_triton = None, err

GatherFn = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], None]


def gather_into_torch(states: torch.Tensor, slot: int, hidden: torch.Tensor, token_index: torch.Tensor) -> None:
    B, S, H = hidden.shape
    if hidden.is_contiguous():
        rows = hidden.view(B * S, H).index_select(0, token_index)
    else:  # e.g. a strided view: index (b, t) directly rather than copying the whole activation
        rows = hidden[token_index // S, token_index % S]
    states[:, slot].copy_(rows)  # copy_ rounds to bf16 to nearest-even, like .to(torch.bfloat16)


def select_gather_fn(kernel: str, device: torch.device) -> GatherFn:
    """auto: the Triton kernel on CUDA when it is available, else torch."""
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return gather_into_torch
    if gather_into_triton is None:
        if kernel == "triton":
            raise RuntimeError(f"--kernel triton is not available: {_no_triton}")
        return gather_into_torch
    return gather_into_triton

