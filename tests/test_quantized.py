"""Quantized checkpoints (FP8 blocks: DeepSeek-V3/R1, Qwen3 FP8, Kimi K2; MXFP4 experts: gpt-oss), made here from
the zoo's tiny models in the formats those releases store (weights quantized by this file's own code, scales beside
them, the config's quantization_config), then run by streamx on the CPU: the states are the forward of the weights
transformers loads from the checkpoint (its own unbatched forward, loaded independently), not the original float
weights', and the log and the store say what was loaded."""

import json
from pathlib import Path

import pytest
import torch
from helpers import reference_states
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.utils import is_triton_available
from zoo_models import zoo_config, zoo_model

from streamx.config import RunConfig
from streamx.model.load import load_tokenizer
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.train.verify import verify

BLOCK = 32  # FP8 blocks of 32 x 32 (released checkpoints: 128 x 128), so the tiny weights hold several
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> float8_e4m3fn values and the float32 scale of each BLOCK x BLOCK block (weight_scale_inv: value x
    scale = weight), the last block of a dimension partial where it does not divide."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(grid[0], BLOCK, grid[1], BLOCK)
    scales = blocks.abs().amax((1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    values = (blocks / scales[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return values.to(torch.float8_e4m3fn), scales


def fp8_dequantized(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What a checkpoint's FP8 weight means: each value times its own block's scale."""
    full = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return values.float() * full[: values.shape[0], : values.shape[1]]


def mxfp4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> MXFP4: each group of 32 values as E2M1 codes, two a byte (low nibble first), and one E8M0 scale
    byte (a power of two, biased by 127) per group."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    codes = (groups[..., None] / torch.exp2(exponent)[..., None, None] - E2M1).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def quantized_checkpoint(family: str, method: str, tokenizer_dir: str, folder: Path) -> Path:
    """The zoo model of `family` saved as a checkpoint quantized as the releases are: FP8 on every decoder linear
    layer but the MoE router (kept, as modules_to_not_convert says), or MXFP4 on gpt-oss's experts (stored
    [experts, out, in / 32, 16] as the release stores them)."""
    zoo_model(family).save_pretrained(folder)
    load_tokenizer(tokenizer_dir).save_pretrained(folder)
    weights, quantized = load_file(folder / "model.safetensors"), {}
    for name, weight in weights.items():
        if method == "fp8" and "layers." in name and weight.ndim == 2 and not name.endswith(".gate.weight"):
            quantized[name], quantized[f"{name}_scale_inv"] = fp8_blocks(weight)
        elif method == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = mxfp4_blocks(weight.transpose(1, 2))
        else:
            quantized[name] = weight
    save_file(quantized, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK] * 2,
                "modules_to_not_convert": [f"model.layers.{i}.mlp.gate" for i in range(4)]},
        "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }[method]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def worst_difference(store, model) -> float:
    """The largest per-token relative difference over every stored row and id from `model`'s own unbatched forward
    (id L before the final norm)."""
    worst = 0.0
    for row in store.row_ids().tolist():
        sample = store.sample(row)
        want = torch.stack(reference_states(model, sample.input_ids), dim=1).float()
        got = sample.hidden_states.float()
        worst = max(worst, float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()))
    return worst


RUN = [("qwen3_moe", "fp8", "FP8 linear layers dequantized to float32 on load (on the CPU)"),
       ("gpt_oss", "mxfp4", "MXFP4 experts dequantized to float32 on load (on the CPU)")]


@pytest.mark.parametrize(("family", "method", "loaded"), RUN)
def test_a_quantized_checkpoint_gives_the_states_of_the_weights_it_stores(family, method, loaded, chat_jsonl,
                                                                          smollm2_dir, tmp_path):
    checkpoint = quantized_checkpoint(family, method, smollm2_dir, tmp_path / family)
    lines: list[str] = []
    run(RunConfig(model=str(checkpoint), data=chat_jsonl, out=str(tmp_path / "s.zarr"), layers="0,1,2,3,4",
                  max_samples=12, max_length=256, device="cpu"), progress=False, log=lines.append)
    store = open_store(str(tmp_path / "s.zarr"))
    assert f"  weights {loaded}: the states are those of the checkpoint's values" in lines
    assert store.metadata.model["weights"].startswith(loaded)

    # transformers' own load of the checkpoint (MXFP4 on the CPU only dequantized: its kernels come from the hub)
    options = {"quantization_config": Mxfp4Config(dequantize=True)} if method == "mxfp4" else {}
    own = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **options).eval()
    assert worst_difference(store, own) < 0.01  # bf16's rounding
    assert worst_difference(store, zoo_model(family)) > 0.02  # the float weights before quantizing: not these states

    report = verify(str(tmp_path / "s.zarr"), samples=4, device="cpu", log=lambda message: None)
    assert report.passed, "\n".join(report.lines())


def test_an_fp8_checkpoint_with_partial_blocks_is_refused_where_transformers_would_misplace_its_scales(
        chat_jsonl, smollm2_dir, tmp_path):
    """DeepSeek-V3's MLA projection kv_a_proj_with_mqa has 576 rows in blocks of 128 (here 40 in blocks of 32): the
    last block partial. transformers 5.25 dequantizes by the scales' grid (40 rows / 2 scales = blocks of 20), so its
    weights there are not the checkpoint's, while a weight that tiles exactly is; streamx refuses such a checkpoint
    where it would be dequantized, before reading a weight."""
    checkpoint = quantized_checkpoint("deepseek_v3", "fp8", smollm2_dir, tmp_path / "deepseek_v3")
    stored = load_file(checkpoint / "model.safetensors")
    own = dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).named_parameters())
    for name, partial in (("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", True),
                          ("model.layers.0.self_attn.o_proj.weight", False)):
        assert stored[name].shape[0] % BLOCK != 0 if partial else all(n % BLOCK == 0 for n in stored[name].shape)
        meant = fp8_dequantized(stored[name], stored[f"{name}_scale_inv"])
        assert torch.allclose(own[name], meant) != partial, name  # when transformers fixes this, lift the refusal

    with pytest.raises(ValueError, match=r"^transformers dequantizes FP8 blocks by the scales' grid, wrong for "
                                         r"model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight \(40 x 64 in blocks "
                                         r"of 32 x 32, the last one partial\)"):
        run(RunConfig(model=str(checkpoint), data=chat_jsonl, out=str(tmp_path / "s.zarr"), max_samples=4,
                      device="cpu"),
            progress=False, log=lambda message: None)


def test_the_support_tables_quantized_column_is_these_tests():
    from streamx.model.support import QUANTIZED_TESTED

    ran = [family for family, _, _ in RUN] + ["deepseek_v3"]  # (the refusal's test)
    assert set(QUANTIZED_TESTED) == {zoo_config(family).model_type for family in ran}


def test_plan_sizes_a_quantized_checkpoint_as_stored_and_dequantize_as_loaded(chat_jsonl, smollm2_dir, tmp_path):
    """gpt-oss's expert matrices at 4.25 bits a weight as stored (bf16 elsewhere, their biases too), their bf16 bytes
    with --dequantize: the difference is the expert matrices' parameters at 16 - 4.25 bits."""
    from typer.testing import CliRunner

    from streamx.cli import app

    checkpoint = quantized_checkpoint("gpt_oss", "mxfp4", smollm2_dir, tmp_path / "gpt_oss")
    args = ["plan", "--model", str(checkpoint), "--data", chat_jsonl, "--out", str(tmp_path / "p.zarr"), "--json"]
    stored, dequantized = (json.loads(CliRunner().invoke(app, args + extra).stdout)["footprints"][0]["weights"]
                           for extra in ([], ["--dequantize"]))
    said = CliRunner().invoke(app, args[:-1] + ["--dequantize"]).stdout
    assert "  weights: MXFP4 experts dequantized to the compute dtype (--dequantize), sized so" in said
    experts = sum(p.numel() for name, p in zoo_model("gpt_oss").named_parameters() if name.endswith("_proj"))
    assert abs((dequantized - stored) - experts * (16 - 4.25) / 8) < 16, (dequantized - stored, experts)


def test_the_partial_block_is_found_where_a_weight_and_its_scales_lie_in_different_shards(tmp_path):
    """A sharded checkpoint may store a weight in one file and its scales in the next: the headers of all are read."""
    from transformers import DeepseekV3Config

    from streamx.model.quantized import check_dequantizable

    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    values, scales = fp8_blocks(torch.randn(40, 64))
    save_file({name: values}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({f"{name}_scale_inv": scales, "model.norm.weight": torch.ones(64)},
              tmp_path / "model-00002-of-00002.safetensors")
    config = DeepseekV3Config(quantization_config={"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]})
    with pytest.raises(ValueError, match=rf"wrong for {name} \(40 x 64 in blocks of 32 x 32"):
        check_dequantizable(config, tmp_path)
    config.quantization_config["weight_block_size"] = [8, 8]  # (the same grid, read as 8 x 8 blocks: no partial one)
    check_dequantizable(config, tmp_path)


@pytest.mark.skipif(not is_triton_available("3.5.0"), reason="transformers needs Triton 3.5+ to try MXFP4's kernels")
def test_kernels_that_cannot_be_fetched_fail_in_one_line_that_names_dequantize(smollm2_dir, tmp_path, monkeypatch):
    """On a GPU transformers keeps MXFP4 as stored, with kernels it fetches from the hub: a node that cannot reach it
    (here: the CPU taken for such a GPU, the fetch failing) gets the reason and the way out, --dequantize."""
    import streamx.model.load as load
    from streamx.model.load import load_model

    def unreachable(*args, **kwargs):
        raise ValueError("Kernel repository 'kernels-community/gpt-oss-triton-kernels' could not be fetched.\nmore")

    checkpoint = quantized_checkpoint("gpt_oss", "mxfp4", smollm2_dir, tmp_path / "gpt_oss")
    monkeypatch.setattr(load, "load_options", lambda config, device, dequantize: {})  # as on a GPU: transformers' call
    monkeypatch.setattr("transformers.integrations.hub_kernels.get_kernel", unreachable)
    with pytest.raises(ValueError) as refused:
        load_model(str(checkpoint), device="cpu")
    assert str(refused.value) == (
        "transformers could not load the MXFP4 experts as stored (Kernel repository 'kernels-community/gpt-oss-triton-"
        "kernels' could not be fetched): streamx run --dequantize loads them dequantized, in 2-4x the memory (plan "
        "--dequantize sizes it)")
