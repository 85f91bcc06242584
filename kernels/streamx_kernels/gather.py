"""Triton gather: one layer's real tokens -> slot k of the bf16 states buffer, in one pass.

Same contract as `streamx.gather.gather_into_torch`: states [N, K, H] bfloat16, hidden [B, S, H]
(bf16/fp16/fp32, any batch/sequence strides, H contiguous), token_index int64 [N] holding
b * S + t. Each program copies a [BLOCK_N, BLOCK_H] tile: it reads the rows straight from the
strided activation and writes bf16, so nothing is materialised in between.

On CUDA tensors the compiled kernel runs; on CPU tensors the same kernel runs under Triton's
interpreter (tests, and `--kernel triton` on a CPU machine). With CUDA activations, states may
also be pinned host memory, written directly over the bus (mapped via UVA; checked by the CUDA
tests, measured by bench/kernel_bench.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _gather_rows(
    hidden_ptr, states_ptr, index_ptr,  # states_ptr points at states[0, slot]
    N, H, S, stride_b, stride_s, stride_n,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < N
    idx = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    src = (idx // S) * stride_b + (idx % S) * stride_s  # int64: activations can exceed 2**31 elements
    dst = rows.to(tl.int64) * stride_n
    mask = row_ok[:, None] & (cols < H)[None, :]
    x = tl.load(hidden_ptr + src[:, None] + cols[None, :], mask=mask)
    if x.dtype != tl.bfloat16:
        # Round to nearest even on the fp32 bit pattern, as torch does; NaN stays a (quiet) NaN.
        # Done by hand because Triton's interpreter truncates on casts, even with
        # fp_downcast_rounding="rtne"; on the GPU these few integer ops hide under the memory traffic.
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)
        x = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(states_ptr + dst[:, None] + cols[None, :], x, mask=mask)


def _interpreted(fn):
    """`fn` under Triton's CPU interpreter, whatever TRITON_INTERPRET was when triton was imported:
    triton.jit reads the variable when it decorates, and other modules (transformers) import triton early."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return triton.jit(fn)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


_gather_rows_gpu = triton.jit(_gather_rows)
_gather_rows_cpu = _interpreted(_gather_rows)


def gather_into_triton(states: torch.Tensor, slot: int, hidden: torch.Tensor, token_index: torch.Tensor, *,
                       block_n: int | None = None, block_h: int | None = None) -> None:
    """states[n, slot, :] = hidden[b, t, :].to(bfloat16) for each n, with b, t = divmod(token_index[n], S).

    block_n / block_h override the tile (for benchmark sweeps); the default is a 4096-element tile."""
    B, S, H = hidden.shape
    N = token_index.numel()
    if states.dtype != torch.bfloat16 or states.stride(-1) != 1 or hidden.stride(-1) != 1:
        raise ValueError("gather_into_triton needs a bfloat16 states buffer and H contiguous in both tensors")
    if N == 0:
        return
    block_h = block_h or min(triton.next_power_of_2(H), 1024)
    block_n = block_n or max(1, 4096 // block_h)
    out = states[:, slot]  # a view: its data pointer carries the slot offset
    kernel = _gather_rows_gpu if hidden.is_cuda else _gather_rows_cpu
    grid = (triton.cdiv(N, block_n), triton.cdiv(H, block_h))
    kernel[grid](hidden, out, token_index, N, H, S, hidden.stride(0), hidden.stride(1), out.stride(0),
                 BLOCK_N=block_n, BLOCK_H=block_h)
