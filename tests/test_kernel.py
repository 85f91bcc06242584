"""The Triton gather-pack kernel against torch's own `.to(torch.bfloat16)`, bit for bit.

On CPU tensors streamx_kernels runs the kernel under Triton's interpreter by itself, so nothing
depends on TRITON_INTERPRET being set before triton's first import (conftest imports transformers,
which imports triton). The CUDA tests run the compiled kernel where a GPU is present.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import streamx.model.gather as streamx_gather
from streamx.config import load_config
from streamx.model.gather import select_gather_fn
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx_kernels.gather import gather_into_triton

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYOUTS = ["contiguous", "slice", "seq_major"]
PATTERNS = ["right_pad", "left_pad", "all", "none", "scattered"]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def reference(hidden: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    B, S, H = hidden.shape
    return hidden.reshape(B * S, H)[token_index].to(torch.bfloat16)


def activations(layout: str, B: int, S: int, H: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """[B, S, H] random activations (not bf16-representable unless bf16), laid out as a model may give them."""
    gen = torch.Generator().manual_seed(B * 10_000 + S * 100 + H)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 3).to(dtype).to(device)

    if layout == "contiguous":
        return rand(B, S, H)
    if layout == "slice":  # offset start, padded batch and sequence strides
        return rand(B + 2, S + 3, H + 5)[1:-1, 2:-1, 3:-2]
    return rand(S, B, H).transpose(0, 1)  # seq_major: [S, B, H] seen as [B, S, H]


def token_index(pattern: str, B: int, S: int) -> torch.Tensor:
    """Flat b * S + t of the real tokens for a padding pattern."""
    gen = torch.Generator().manual_seed(B * 100 + S)
    lengths = torch.randint(1, S + 1, (B,), generator=gen).tolist()
    if pattern == "right_pad":
        flat = [b * S + t for b in range(B) for t in range(lengths[b])]
    elif pattern == "left_pad":
        flat = [b * S + t for b in range(B) for t in range(S - lengths[b], S)]
    elif pattern == "all":
        flat = list(range(B * S))
    elif pattern == "none":
        flat = []
    else:  # scattered and unordered: the kernel must not rely on sorted indices
        flat = torch.randperm(B * S, generator=gen)[: B * S // 2].tolist()
    return torch.tensor(flat, dtype=torch.int64)


def check_pack(hidden: torch.Tensor, index: torch.Tensor, K: int, slot: int, **blocks: int) -> None:
    """Pack into a NaN-poisoned buffer: slot `slot` equals the reference bit for bit, other slots untouched."""
    N, H = index.numel(), hidden.shape[-1]
    states = torch.full((N, K, H), float("nan"), dtype=torch.bfloat16, device=hidden.device)
    gather_into_triton(states, slot, hidden, index, **blocks)
    want = reference(hidden, index)
    assert not want.isnan().any()
    assert torch.equal(bits(states[:, slot]), bits(want))
    assert states[:, :slot].isnan().all() and states[:, slot + 1 :].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("B, S, H, K, slot", [(3, 7, 70, 8, 5), (2, 5, 1500, 1, 0)])
def test_kernel_matches_torch(dtype, layout, pattern, B, S, H, K, slot):
    # H = 70 and 1500 are not multiples of the default H tile (128, 1024): the last tile is masked.
    check_pack(activations(layout, B, S, H, dtype), token_index(pattern, B, S), K, slot)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_small_tiles(dtype):
    """Tiles that divide neither N nor H: masking in both grid dimensions."""
    index = token_index("left_pad", 4, 9)
    assert index.numel() % 4 != 0
    check_pack(activations("slice", 4, 9, 70, dtype), index, K=3, slot=2, block_n=4, block_h=32)


def test_rounding_is_nearest_even_like_torch():
    """Every fp16 value, and fp32 ties, carries, overflow, subnormals and random bit patterns."""
    fp16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    edges = [0x3F808000, 0x3F818000, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x007FFFFF,
             0x00000001, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001]
    fp32 = torch.cat([torch.tensor(edges, dtype=torch.int64).to(torch.int32),
                      torch.randint(-(2**31), 2**31, (2**15,), generator=torch.Generator().manual_seed(0),
                                    dtype=torch.int64).to(torch.int32)]).view(torch.float32)
    for values in (fp16, fp32):
        hidden = values.view(1, -1, 1).expand(2, -1, 1)  # stride 0 over batch: also a legal layout
        index = torch.arange(values.numel(), 2 * values.numel())  # the second batch row
        states = torch.zeros(values.numel(), 1, 1, dtype=torch.bfloat16)
        gather_into_triton(states, 0, hidden, index, block_n=4096, block_h=1)
        got, want = states.flatten(), values.to(torch.bfloat16)
        nan = want.isnan()
        assert nan.any() and torch.equal(got.isnan(), nan)  # any NaN: its bits differ across torch builds
        assert torch.equal(bits(got[~nan]), bits(want[~nan]))


def test_rejects_what_it_cannot_write():
    hidden = activations("contiguous", 2, 3, 8, torch.float32)
    index = torch.arange(6)
    with pytest.raises(ValueError, match="bfloat16"):
        gather_into_triton(torch.zeros(6, 1, 8), 0, hidden, index)
    with pytest.raises(ValueError, match="contiguous"):
        gather_into_triton(torch.zeros(6, 1, 8, dtype=torch.bfloat16), 0, hidden.transpose(1, 2).contiguous().mT, index)


@pytest.mark.parametrize("packing", ["off", "on"])
def test_pipeline_store_is_identical_with_torch_and_triton(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch,
                                                           packing):
    """Same data, same model (fp32 on CPU): the triton path stores exactly the bytes of the torch path, gathering
    from padded batches and from states ones."""
    assert select_gather_fn("triton", torch.device("cpu")) is gather_into_triton
    calls = []

    def counted(*args, **kw):
        calls.append(args[1])
        gather_into_triton(*args, **kw)

    monkeypatch.setattr(streamx_gather, "gather_into_triton", counted)  # what select_gather_fn hands out
    stores = {}
    for kernel in ("torch", "triton"):
        cfg = load_config(None, model=tiny_chat_model_dir, data=chat_jsonl, out=str(tmp_path / f"{kernel}.zarr"),
                          kernel=kernel, layers="0,2,4", max_samples=8, token_budget=512, max_length=256,
                          sort_window=8, chunk_tokens=16, shard_tokens=64, packing=packing)
        summary = run(cfg, progress=False)
        assert summary.samples == 8 and (summary.padded_tokens > summary.real_tokens) == (packing == "off")
        stores[kernel] = open_store(cfg.out)
    assert sorted(set(calls)) == [0, 1, 2]  # the triton run really states through the kernel, every slot
    for row_id in stores["torch"].row_ids().tolist():
        a, b = stores["torch"].sample(row_id).hidden_states, stores["triton"].sample(row_id).hidden_states
        assert a.float().abs().max() > 0 and torch.equal(bits(a), bits(b)), row_id


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_kernel_matches_torch_on_cuda(dtype, layout):
    B, S = 4, 333
    check_pack(activations(layout, B, S, 5120, dtype, "cuda"), token_index("left_pad", B, S).cuda(), K=6, slot=4)


@cuda_only
def test_compiled_kernel_writes_pinned_host_memory():
    """The mapped-memory variant: the kernel stores straight into a pinned host buffer."""
    B, S, H = 3, 100, 4096
    hidden = activations("contiguous", B, S, H, torch.float32, "cuda")
    index = token_index("right_pad", B, S).cuda()
    states = torch.full((index.numel(), 2, H), float("nan"), dtype=torch.bfloat16).pin_memory()
    gather_into_triton(states, 1, hidden, index)
    torch.cuda.synchronize()
    assert torch.equal(bits(states[:, 1]), bits(reference(hidden, index).cpu())) and states[:, 0].isnan().all()


def test_the_checkout_does_not_shadow_the_pypi_package_named_kernels(tmp_path):
    """transformers 5.25+ requires and imports the PyPI package `kernels`; Python run in the checkout puts the
    checkout first on sys.path, so a `kernels/__init__.py` there broke every transformers import (CI's fresh
    Python 3.12 venv). A stand-in for the PyPI package, next on the path (before any installed one), must win."""
    stand_in = tmp_path / "site" / "kernels"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("FROM_PYPI = True\n")
    checkout = Path(__file__).resolve().parents[1]
    probe = f"import sys; sys.path.insert(1, {str(stand_in.parent)!r}); import kernels; print(kernels.FROM_PYPI)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=checkout, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
