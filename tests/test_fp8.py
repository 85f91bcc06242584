"""--storage fp8: the bytes equal speculators' own quantiser (hs_connectors, run in its isolated venv), on
edge cases and on real activations, and a run's fp8 store is that quantisation of its bf16 store."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamx.config import load_config
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.store.fp8 import FP8, dequantize_fp8, quantize_fp8

# In the speculators venv: speculators' quantiser and dequantiser on every tensor of a safetensors file.
HS_CONNECTORS = """
import sys
from safetensors.torch import load_file, save_file
from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
out = {}
for name, x in load_file(sys.argv[1]).items():
    values, scales = quantize_tensor_to_fp8(x)
    out[name + ".values"], out[name + ".scales"] = values, scales
    out[name + ".dequantised"] = dequantize_fp8_tensor(values, scales)
save_file(out, sys.argv[2])
"""


def edge_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=g) * torch.logspace(-30, 30, 64)[:, None, None]  # tiny to huge tokens
    x[3] = 0  # an all-zero token: the scale's 1e-12 floor
    x[4, 1, 7] = -1e4  # a token whose amax is a negative value
    x[5] = torch.linspace(-1, 1, 96).view(3, 32)  # values spread into fp8's subnormal range
    x[6, 0, 0] = 3e38  # close to bf16's largest
    return {"edge": x.bfloat16(), "fp32": torch.randn(9, 2, 16, generator=g)}


def speculators_quantised(speculators_venv, tensors: dict[str, torch.Tensor], tmp_path: Path) -> dict:
    save_file(tensors, tmp_path / "in.safetensors")
    proc = speculators_venv("-c", HS_CONNECTORS, str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(tmp_path / "out.safetensors")


def assert_same(ours: tuple[torch.Tensor, torch.Tensor], theirs: dict, name: str) -> None:
    values, scales = ours
    assert values.dtype == theirs[f"{name}.values"].dtype == FP8
    assert torch.equal(values.view(torch.uint8), theirs[f"{name}.values"].view(torch.uint8)), name  # bit for bit
    assert torch.equal(scales, theirs[f"{name}.scales"].flatten()), name
    assert torch.equal(dequantize_fp8(values, scales), theirs[f"{name}.dequantised"]), name


def test_quantiser_is_bit_exact_with_speculators(speculators_venv, tmp_path, monkeypatch):
    tensors = edge_cases()
    theirs = speculators_quantised(speculators_venv, tensors, tmp_path)
    monkeypatch.setattr("streamx.store.fp8.QUANTIZE_TOKENS", 5)  # several steps, the last one partial
    for name, x in tensors.items():
        assert_same(quantize_fp8(x), theirs, name)
    assert not torch.isnan(theirs["edge.values"].float()).any()  # no edge case overflowed to NaN


def test_fp8_store_is_speculators_quantisation_of_the_bf16_store(tiny_chat_model_dir, chat_jsonl, speculators_venv,
                                                                 tmp_path):
    stores = {}
    for storage in ("bf16", "fp8"):
        cfg = load_config(None, model=tiny_chat_model_dir, data=chat_jsonl, out=str(tmp_path / f"{storage}.zarr"),
                          layers="0,2,4", token_budget=512, max_length=256, sort_window=16, chunk_tokens=16,
                          shard_tokens=64, storage=storage)
        run(cfg, progress=False, log=lambda m: None)
        stores[storage] = open_store(cfg.out)
    bf16, fp8 = stores["bf16"], stores["fp8"]
    assert fp8.metadata.storage == "fp8" and fp8.metadata.hidden_states_dtype == "float8_e4m3fn"
    assert fp8.metadata.bytes_per_token == 3 * 64 + 4 and bf16.metadata.bytes_per_token == 3 * 64 * 2
    assert fp8.row_ids().tolist() == bf16.row_ids().tolist() and len(fp8) > 20

    # speculators quantises each sample's bf16 states the way its vLLM connector does, one sample at a time
    theirs = speculators_quantised(speculators_venv, {str(s.row_id): s.hidden_states for s in bf16.samples()},
                                   tmp_path)
    for s in bf16.samples():
        raw = fp8.sample(s.row_id, raw=True)
        assert torch.equal(raw.input_ids, s.input_ids) and torch.equal(raw.loss_mask, s.loss_mask)
        assert_same((raw.hidden_states, raw.hidden_states_scales), theirs, str(s.row_id))
        assert torch.equal(fp8.sample(s.row_id).hidden_states, theirs[f"{s.row_id}.dequantised"])  # the default read
    summary = json.loads(json.dumps(fp8.summary()))
    assert summary["hidden_state_bytes"] == fp8.num_tokens * (3 * 64 + 4)


def test_fp8_quantisation_error_is_bounded(tmp_path):
    """fp8 e4m3 keeps 3 mantissa bits: each value is within 2^-4 of itself, or below the token's scale times
    2^-9 (the subnormal step, halved) when it is tiny next to the token's largest value."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(200, 4, 64, generator=g) * torch.rand(200, 1, 1, generator=g) * 20).bfloat16()
    values, scales = quantize_fp8(x)
    error = (dequantize_fp8(values, scales).float() - x.float()).abs()
    bound = x.float().abs() * (2**-4 + 2**-8) + scales[:, None, None] * 2**-9 * (1 + 2**-7)
    assert (error <= bound).all()
    assert error.max() > 0  # it is lossy: the test would notice an identity "quantiser"


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_storage_setting_is_validated(storage):
    assert load_config(None, storage=storage).storage == storage
    with pytest.raises(ValueError, match="storage must be one of bf16, fp8; got 'int8'"):
        load_config(None, storage="int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantiser_on_cuda_is_bit_exact_with_the_cpu():
    """The run quantises on the GPU; speculators' reference is checked on the CPU: they must agree bit for bit."""
    x = edge_cases()["edge"].repeat(100, 1, 1)
    values, scales = quantize_fp8(x.cuda())
    want_values, want_scales = quantize_fp8(x)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)
